"""The lightning indexer as a part of a layer (docs/concepts.md, "The lightning indexer"): an
``AbstractIndexer`` owns its weights (the query heads and head weights, V4's own key
compressor, V3.2's key projection) and everything the indexer does with them when a layer
calls it with its execution: the selection problem (queries projected block by block, head
sharded when the execution says so), the selection strategy run on it (tagged for remat), the
KL loss' sums, and its candidate rule (``AbstractCandidateRule``: what its queries may pick
and what it publishes besides its selection; ``NoCandidates`` unless V4.1 says otherwise).
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox import AbstractVar
from jaxtyping import Array, Float, Int

from .._backend import backend_tiles
from .._layout import Visibility, entry_visibility
from .._loss.base import AttentionTarget
from .._numerics.base import EXACT, AbstractNumerics, DeepSeekFormats
from .._rows import Rows
from .._selection.base import SelectionProblem
from ..remat import tag_selection
from .sharding import constrain_heads, on_context_mesh, tensor_axis_auto

__all__ = ["AbstractIndexer", "AbstractCandidateRule", "NoCandidates"]


class AbstractCandidateRule(eqx.Module):
    """An indexer's part in a pre-filter of what its queries may pick (V4.1's candidates,
    docs/v41.md): what they may see, from the state a stack published, and how the indexer
    selects and what it publishes besides its selection."""

    @abc.abstractmethod
    def visibility(self, visibility: Visibility, state: Any) -> Any:
        """**Arguments:** the entries' ``visibility`` and the stack state published so far
        (``None``: a layer kind that reads none).

        **Returns:** what the queries may pick (a ``Visibility``, or one that answers its
        calls)."""

    def select(self, indexer: "AbstractIndexer", problem: SelectionProblem, execution) -> tuple:
        """**Arguments:** the ``indexer``, its ``problem`` and the layer's ``execution``.

        **Returns:** ``(selection [B, S, topk], published)``: the selection
        (``indexer.select``) and the stack state fields the rule publishes besides it (by
        name; none here)."""
        return indexer.select(problem, execution), {}


class NoCandidates(AbstractCandidateRule):
    """No pre-filter: the queries pick among every visible entry; nothing is published."""

    def visibility(self, visibility, state):
        return visibility


class AbstractIndexer(eqx.Module):
    """A layer's lightning indexer. An implementation holds its weights and says how they make
    the per-head queries (``query_weight``, ``heads``, ``rope_queries``) and head weights
    (``head_weights``), how many entries a query picks (``topk``) and its candidate rule
    (``candidates``); where the keys it scores come from is the layer's pipeline. Called with
    the layer's execution, it makes and solves its selection problem (``__call__``) and, for
    the KL loss, its sums (``loss_sums``).
    """

    topk: AbstractVar[int]
    heads: AbstractVar[int]
    query_weight: AbstractVar[Array]
    candidates: AbstractVar[AbstractCandidateRule]

    def queries(
        self,
        qr: Float[Array, "batch seq q_lora"],
        positions: Int[Array, "batch seq"],
        numerics: AbstractNumerics = EXACT,
    ) -> Float[Array, "batch seq heads dim"]:
        """**Arguments:** the query latent ``qr [B, S, q_lora_rank]``, int32 ``positions``
        ``[B, S]`` and the layer's ``numerics``.

        **Returns:** the roped per-head queries ``[B, S, H_I, d_I]``: ``qr`` through the
        numerics' ``linear`` with ``query_weight``, split into ``heads``, then ``rope_queries``.
        """
        b, s, _ = qr.shape
        q = numerics.linear(qr, self.query_weight).reshape(b, s, self.heads, -1)
        return self.rope_queries(q, positions[..., None])

    @abc.abstractmethod
    def rope_queries(self, q: Array, positions: Array) -> Array:
        """**Returns:** the per-head queries ``q [B, S, H_I, d_I]`` rotated for ``positions``
        ``[B, S, 1]`` (the implementation's RoPE table and channel layout)."""

    @abc.abstractmethod
    def head_weights(
        self, x: Float[Array, "batch seq hidden"], numerics: AbstractNumerics
    ) -> Float[Array, "batch seq heads"]:
        """**Arguments:** the layer input ``x [B, S, hidden]`` and the layer's ``numerics``.

        **Returns:** float32 per-head weights ``[B, S, H_I]``, ``H_I^-1/2`` included."""

    def __call__(self, *inputs, state: Any = None) -> tuple:
        """The indexer's selection over the entries' index keys.

        **Arguments:** the ``inputs`` of ``problem`` (``x``, ``qr``, ``positions``, ``keys``,
        ``visibility``, ``execution``, ``formats``), the entries' visibility before the
        candidate rule narrows it, and the stack ``state`` published so far (for the candidate
        rule; ``None``: none).

        **Returns:** ``(selection, problem, published)``: int32 ``[B, S, topk]`` entry indices
        (``-1`` = none), the ``SelectionProblem`` it solved (the KL loss' too) and the state
        fields the candidate rule publishes.
        """
        x, qr, positions, keys, visibility, execution, formats = inputs
        seen = self.candidates.visibility(visibility, state)
        problem = self.problem(x, qr, positions, keys, seen, execution, formats)
        selection, published = self.candidates.select(self, problem, execution)
        return selection, problem, published

    def problem(
        self,
        x: Float[Array, "batch seq hidden"],
        qr: Float[Array, "batch seq q_lora"],
        positions: Int[Array, "batch seq"],
        keys: Float[Array, "batch entries index_dim"],
        visibility: Any,
        execution,
        formats: DeepSeekFormats,
    ) -> SelectionProblem:
        """The indexer's side of "what a query reads", shared by the selection, the KL loss and
        ``extend``.

        **Arguments:**

        - ``x``, ``qr``, ``positions``: per-token hidden states, query latents and RoPE positions
            (``[B, S, ...]``); ``x`` and ``qr`` are detached.
        - ``keys``: the index keys of the entries (V4: compressed entries, V3.2: tokens), as
            the numerics round them; the queries are rounded here.
        - ``visibility``: which entries each query may pick (a ``Visibility``, or one that
            answers its calls: V4.1's ``CandidateVisibility``).
        - ``execution``, ``formats``: the layer's (its numerics, head chunk, scorer, tiles and
            ``indexer_heads_axis``).

        **Returns:** a ``SelectionProblem`` projecting the rows block by block to the queries
        and head weights (on ``execution.indexer_heads_axis`` over the heads when that is set).
        """
        nx, axis = execution.numerics, execution.indexer_heads_axis

        def on_heads(a):
            return a if axis is None else constrain_heads(a, axis)

        def project(x, qr, positions):  # a fresh closure: hashable, and row by row
            indexer = on_context_mesh(self)  # its weights typed as the stage's arrays
            q = nx.indexer(indexer.queries(qr, positions, nx), formats)
            return on_heads(q), on_heads(indexer.head_weights(x, nx))

        rows = (*jax.lax.stop_gradient((x, qr)), positions)
        chunk, scorer = execution.qk_head_chunk_size, execution.scorer
        score_dtype, tiles = nx.score_dtype(formats), backend_tiles(execution.tiles)
        return SelectionProblem(project, rows, keys, visibility, chunk, score_dtype, scorer, tiles)

    def select(self, problem: SelectionProblem, execution) -> Int[Array, "batch seq k"]:
        """Run the execution's selection strategy on ``problem``.

        **Arguments:** the ``problem`` and the layer's ``execution``.

        **Returns:** int32 ``[B, S, topk]`` entry indices, ``-1`` = none (``run``'s)."""
        k = self.topk
        return self.run(problem, execution, lambda p: (execution.selection.select(p, k),))[0]

    def run(self, problem: SelectionProblem, execution, strategy: Callable) -> tuple:
        """``strategy(problem)`` (a tuple of ``[B, S, n]`` arrays, the selection first), under
        ``execution.indexer_heads_axis`` Auto when the activations are head-sharded; the
        selection named for remat when ``execution.save_selection`` (with it saved, the
        backward needs nothing else of the indexer).

        **Returns:** ``strategy``'s tuple."""

        def stage(rows, keys, visibility):
            return strategy(problem._replace(rows=rows, keys=keys, visibility=visibility))

        axis = execution.indexer_heads_axis
        if axis is not None:
            stage = tensor_axis_auto(stage, axis, problem.visibility.query_index)
        first, *rest = stage(problem.rows, problem.keys, problem.visibility)
        return tag_selection(first, execution.save_selection), *rest

    def loss_sums(
        self,
        rows: Rows,
        stage: str,
        selection: Int[Array, "batch seq k"] | None,
        problem: SelectionProblem,
        target: AttentionTarget,
        execution,
    ) -> tuple[Array, Array]:
        """The indexer's KL distillation (docs/concepts.md, "Training the indexer") over ``rows``
        by ``execution.indexer_kl``: over every entry the problem may pick (``"dense"`` stage)
        or over the ``selection``, as ``(mean x count, count)`` over the queries with a
        candidate, so that the shards' shares sum to the mean. With the heads split over
        devices, each device computes the loss alike from every head's target
        (``rows.all_heads``): ``T`` equal sums over ``T`` equal counts, the same mean and
        gradient."""
        target = target._replace(
            q=rows.all_heads(target.q, 2), log_normalizer=rows.all_heads(target.log_normalizer, 2)
        )
        dense = stage == "dense"
        loss = execution.indexer_kl.loss(problem, target, None if dense else selection)
        count = jnp.sum(_has_candidates(rows, selection, dense), dtype=jnp.float32)
        return loss * count, count


def _has_candidates(rows: Rows, selection: Array, dense: bool) -> Array:
    """Which queries of ``rows`` have a candidate in the indexer loss (``[B', L]``): a pick
    (sparse stage), else a visible entry, found 256 queries at a time (never the dense
    ``[B', L, T]`` visibility). Within V4.1 candidates too: the block of a query's newest
    visible entry is always kept."""
    if not dense:
        return jnp.any(selection >= 0, axis=-1)

    def visible(query):  # one query row of every batch row: [B'] each
        index, segment = query
        seen = entry_visibility(index[:, None], segment[:, None], rows.layout)
        return jnp.any(seen[:, 0], axis=-1)

    rows_first = (rows.query_index.T, rows.segment.T)
    return jax.lax.map(visible, rows_first, batch_size=256).T
