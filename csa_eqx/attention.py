"""What the attention layers with a lightning indexer share (``V4Attention``,
``V32Attention``): construction, the indexer's selection problem, the per-call training stage,
switching execution, and ``extend``'s entry point."""

from __future__ import annotations

import abc
import copy

import equinox as eqx
import jax
from jaxtyping import Array, ArrayLike, Float, Int

from . import checks
from .decode import ChunkRows, chunk_rows
from .execution import Execution, check_stage, checked_execution
from .selection import SelectionProblem, Visibility

__all__ = ["AbstractIndexedAttention"]


class AbstractIndexedAttention(eqx.Module):
    """What the attention layers with a lightning indexer share: their ``indexer`` (with
    ``queries(qr, positions)`` and ``head_weights(x)``), architecture ``config`` and
    ``execution``, and how those make the indexer's selection problem.

    Layers are built as ``Layer(config, *, key, dtype=jnp.float32, execution=None)``:

    Arguments:
        config: the layer's architecture (``V4AttentionConfig`` / ``V32AttentionConfig``).
        key: PRNG key of the random initialisation (``csa_eqx.hf`` loads real weights).
        dtype: parameter dtype (norm weights and sinks stay float32).
        execution: how the layer runs (``csa_eqx.Execution``; ``None``: automatic).
    """

    def indexer_problem(
        self,
        x: Float[Array, "batch seq hidden"],
        qr: Float[Array, "batch seq q_lora"],
        positions: Int[Array, "batch seq"],
        keys: Float[Array, "batch entries index_dim"],
        visibility: Visibility,
    ) -> SelectionProblem:
        """The indexer's side of "what a query reads", shared by the selection, the KL loss and
        ``extend``.

        Arguments:
            x, qr, positions: per-token hidden states, query latents and RoPE positions
                (``[B, S, ...]``); ``x`` and ``qr`` are detached.
            keys: the indexer keys of the entries (V4: compressed entries, V3.2: tokens).
            visibility: which entries each query may see.

        Returns:
            A ``SelectionProblem`` projecting the rows block by block to the indexer's queries
            and head weights (head-sharded when ``execution.indexer_heads_axis`` is set).
        """
        ix, ex = self.indexer, self.execution

        def project(x, qr, positions):  # a fresh closure: hashable, and row by row
            return ex.on_heads(ix.queries(qr, positions)), ex.on_heads(ix.head_weights(x))

        rows = (*jax.lax.stop_gradient((x, qr)), positions)
        return SelectionProblem(project, rows, keys, visibility, ex.qk_head_chunk_size)

    def extend(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        cache: eqx.Module,
        lengths: Int[ArrayLike, " batch"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
    ):
        """Run the chunk ``x`` after the tokens in ``cache``: equal to the full forward over the
        whole stream (prefill, chunked prefill or a decode step; docs/concepts.md, "Decoding:
        prefill and decode with a cache"). The indexer runs the forward's selection strategy
        and the entries are read as in the forward (``Execution.entry_parts``).

        Arguments:
            x: the chunk's hidden states ``[B, T, hidden]``.
            cache: the layer's cache after the earlier tokens (``init_cache`` for none).
            lengths: real tokens per row ``[B]`` (right padding); default all ``T``.
            segment_ids: packed-document ids ``[B, T]`` (``>= 0``); ``None`` continues each
                row's last segment.
            return_aux: also return ``{"selection": ...}``.
            indexer_loss: the training stage whose attention to run (``"dense"`` reads every
                visible entry); ``None`` = ``execution.indexer_loss``.

        Returns:
            ``(y, cache)``: outputs ``[B, T, hidden]`` and the updated cache; with
            ``return_aux``, ``(y, cache, {"selection": ...})``: int32 ``[B, T, index_topk]``
            (V4: cache entry slots in closing order; V3.2: stream indices; ``-1`` = none;
            ``None`` for a V4 layer without an indexer).
        """
        stage = self.stage(indexer_loss)
        x, lengths, segment_ids = checks.chunk_inputs(self, x, cache, lengths, segment_ids)
        if x.shape[1] == 0:  # an empty chunk: nothing to attend to, nothing to write
            topk = None if self.indexer is None else self.config.index_topk
            y, aux = checks.empty_outputs(x, topk, None, True)
            return (y, cache, aux) if return_aux else (y, cache)
        rows = chunk_rows(cache, x.shape[1], lengths, segment_ids)
        y, cache, selection = self.extend_rows(x, cache, rows, stage)
        return (y, cache, {"selection": selection}) if return_aux else (y, cache)

    @abc.abstractmethod
    def extend_rows(self, x: Array, cache: eqx.Module, rows: ChunkRows, stage: str) -> tuple:
        """``extend`` after its checks.

        Arguments: the chunk ``x [B, T, hidden]``, the ``cache``, its ``ChunkRows`` and the
        checked training ``stage``.

        Returns: ``(y, new cache, selection or None)`` as in ``extend``.
        """

    def with_execution(self, execution: Execution):
        """The same parameters, run as ``execution`` says (e.g. another selection strategy).

        Arguments: the ``csa_eqx.Execution`` (checked against the config).

        Returns: a new layer sharing this one's arrays.
        """
        new = copy.copy(self)
        # a static field, so not a leaf ``eqx.tree_at`` could replace
        object.__setattr__(new, "execution", checked_execution(execution, self.config))
        return new

    def stage(self, indexer_loss: str | None) -> str:
        """The training stage of one call, checked against the head chunk.

        Arguments: the call's ``indexer_loss`` (``None``: ``execution.indexer_loss``).

        Returns: ``"off"``, ``"dense"`` or ``"sparse"``; a ``ValueError`` otherwise.
        """
        stage = self.execution.indexer_loss if indexer_loss is None else indexer_loss
        check_stage(stage)
        if indexer_loss is not None:
            self.execution.check(self.config.index_n_heads, self.config.num_heads, stage)
        return stage
