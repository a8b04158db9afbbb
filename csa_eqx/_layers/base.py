"""The one protocol of every attention layer (``V4Attention``, ``V41Attention``,
``V32Attention``): construction, the public forward and ``extend`` (input checks, the empty-input
rule, positions, the placement, the indexer loss, the aux contract and the state a layer
passes on to the later layers of a stack), the indexer's selection problem, the per-call
training stage and switching execution. A layer kind writes only its pipeline
(``forward_rows``) and its cache."""

from __future__ import annotations

import abc
import copy
from functools import partial
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, ArrayLike, Float, Int, jaxtyped

from .._layout import Visibility, entry_visibility, segment_positions, token_rows
from .._loss.base import AttentionTarget
from .._numerics.base import DeepSeekFormats
from .._rows import Rows, whole_rows
from .._selection.base import SelectionProblem
from .._selection.candidates import CandidateVisibility
from . import checks
from .cache import AbstractCache
from .decode import ChunkSource, chunk_rows
from .forward import Forward, V41Shared, carried, published

__all__ = ["AbstractIndexedAttention"]


class AbstractIndexedAttention(eqx.Module):
    """What every attention layer shares: its ``indexer`` (``None``, or with
    ``queries(qr, positions, numerics)`` and ``head_weights(x, numerics)``), architecture
    ``config`` and ``execution``, how those make the indexer's selection problem, and one call
    protocol (``__call__`` and ``extend``, the same for every layer kind).

    Layers are built as ``Layer(config, *, key, dtype=jnp.float32, execution=None)``:

    **Arguments:**

    - ``config``: the layer's architecture (``V4AttentionConfig`` / ``V32AttentionConfig``).
    - ``key``: PRNG key of the random initialisation (``csa_eqx.hf`` loads real weights).
    - ``dtype``: parameter dtype (norm weights and sinks stay float32).
    - ``execution``: how the layer runs (``csa_eqx.Execution``; ``None``: automatic).

    A layer implements ``forward_rows`` (its pipeline, written once against a source of the
    keys seen so far: the forward's ``Rows`` or ``extend``'s ``ChunkSource``), ``init_cache``,
    ``entry_rate``, ``context_halo``, ``head_specs`` and ``selects``, and says in the class
    variable ``formats`` what DeepSeek's inference quantises in its family.

    State shared across the layers of a stack (``csa_eqx.V41Shared``: V4.1's published
    entries, index keys, selections and candidates) is an optional keyword of both calls,
    ``shared=``: when given it comes back after ``y`` (and the cache), with what the layer
    published (V4 and V3.2 layers publish nothing); without it the layer starts from nothing
    published.
    """

    formats: ClassVar[DeepSeekFormats]

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        positions: Int[ArrayLike, "batch seq"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
        shared: V41Shared | None = None,
    ):
        """The layer's forward (docs/concepts.md, "The DeepSeek-V4 attention block": the
        sliding window plus the compressed entries; "DeepSeek-V3.2 DSA": sparse MLA over the
        tokens the indexer selects; docs/v41.md: V4.1's shared entries and selections).

        **Arguments:**

        - ``x``: hidden states ``[B, S, hidden]``.
        - ``positions``: RoPE positions ``[B, S]``; default: the index inside each segment.
        - ``segment_ids``: packed-document ids ``[B, S]`` (contiguous runs, ``>= 0``); tokens
            only see their own segment, and V4's compression windows restart at each
            segment.
        - ``return_aux``: also return the aux dict.
        - ``indexer_loss``: the indexer's training stage for this call (``"off"``, ``"dense"``:
            attend to every visible entry and distil towards that, ``"sparse"``: attend to
            the selection and distil over it); ``None`` = ``execution.indexer_loss``.
        - ``shared``: what the earlier layers of a stack published (``csa_eqx.V41Shared``);
            ``None``: nothing (and nothing is returned). A V4.1 reindex or reuse layer needs
            its sources' entries, keys and selection.

        **Returns:**

        ``y`` ``[B, S, hidden]`` in ``x``'s dtype; then, when ``shared`` is given, the state
        after this layer; then, with ``return_aux``, the aux dict: ``aux["selection"]`` int32
        ``[B, S, index_topk]`` in increasing order (V4 / V4.1: entry slots, V3.2: token
        indices; ``-1`` = none; a V4.1 reuse layer's is the one it inherits; ``None`` for a
        layer that reads no selection) and ``aux["indexer_loss"]`` a float32 scalar (``None``
        when the stage is ``"off"`` or the layer runs no indexer of its own).

        The execution's placement runs it (``Execution.heads`` / ``context``): ``shared``
        crosses it as carried state, the selection and candidates per query row, the entries,
        keys and layout whole-sequence.

        An empty ``x`` (no rows or no tokens) gives zeros, an empty selection, a zero loss and
        ``shared`` unchanged, before any compute.
        """
        c, ex = self.config, self.execution
        stage = self.stage(indexer_loss)
        x, positions, segment_ids = checks.layer_inputs(c.hidden_size, x, positions, segment_ids)
        trains = self.indexer is not None and stage != "off"
        if x.size == 0:
            topk = c.index_topk if self.selects else None
            y, aux = checks.empty_outputs(x, topk, trains, True)
            return _outputs((y,), shared, aux if return_aux else None)
        dtype, x = x.dtype, ex.numerics.layer_input(x)
        placement = ex.placement
        rows = self._whole_rows(placement, x, positions, segment_ids)
        want_loss = return_aux and trains
        given = V41Shared() if shared is None else shared
        body = partial(_body, stage, want_loss, return_aux)
        y, selection, sums, state = placement.run(body, self, x, rows, carried(given._asdict()))
        y = y.astype(dtype)
        aux = None
        if return_aux:
            loss = sums[0] / jnp.maximum(sums[1], 1.0) if want_loss else None
            aux = {"selection": selection, "indexer_loss": loss}
        return _outputs((y,), None if shared is None else published(given, state), aux)

    def _whole_rows(self, placement, x, positions, segment_ids) -> Rows:
        """The whole sequence's ``Rows`` of a forward that ``placement`` runs, from the checked
        ``x``, ``positions`` and ``segment_ids`` (default positions: the index inside each
        segment)."""
        like, positions, segment_ids = placement.rows_inputs(x, positions, segment_ids)
        seg, query_index = token_rows(like, segment_ids)
        positions = segment_positions(seg) if positions is None else positions
        return whole_rows(positions, seg, query_index, self.entry_rate)

    def _kl_loss(self, problem: SelectionProblem, target: AttentionTarget, selection, stage):
        """The indexer's KL distillation (docs/concepts.md, "Training the indexer") over every
        visible entry the problem may pick (``"dense"`` stage) or over the selection."""
        candidates = None if stage == "dense" else selection
        return self.execution.kl_loss(problem, target, candidates)

    def _loss_sums(self, rows: Rows, stage: str, selection, problem, target) -> tuple:
        """The indexer loss of a forward over ``rows`` as ``(mean x count, count)`` over the
        queries with a candidate, so that the shards' shares sum to the mean. With the heads
        split over devices, each device computes the loss alike from every head's target
        (``rows.all_heads``): ``T`` equal sums over ``T`` equal counts, the same mean and
        gradient."""
        target = target._replace(
            q=rows.all_heads(target.q, 2), log_normalizer=rows.all_heads(target.log_normalizer, 2)
        )
        loss = self._kl_loss(problem, target, selection, stage)
        count = jnp.sum(self._has_candidates(rows, selection, stage), dtype=jnp.float32)
        return loss * count, count

    @abc.abstractmethod
    def head_specs(self, axis: str) -> tuple:
        """How head parallelism splits the layer's arrays.

        **Arguments:** the mesh ``axis`` the heads are split over.

        **Returns:** ``(specs, heads)``: a function from the layer's arrays (``eqx.partition(layer,
        eqx.is_array)[0]``) to a ``PartitionSpec`` per array, and the head counts the axis size
        must divide (by config field name).
        """

    @staticmethod
    def _has_candidates(rows: Rows, selection: Array, stage: str) -> Array:
        """Which queries of ``rows`` have a candidate in the indexer loss (``[B', L]``): a pick
        (sparse stage), else a visible entry, found 256 queries at a time (never the dense
        ``[B', L, T]`` visibility). Within V4.1 candidates too: the block of a query's newest
        visible entry is always kept."""
        if stage != "dense":
            return jnp.any(selection >= 0, axis=-1)

        def visible(query):  # one query row of every batch row: [B'] each
            index, segment = query
            seen = entry_visibility(index[:, None], segment[:, None], rows.layout)
            return jnp.any(seen[:, 0], axis=-1)

        rows_first = (rows.query_index.T, rows.segment.T)
        return jax.lax.map(visible, rows_first, batch_size=256).T

    @property
    @abc.abstractmethod
    def entry_rate(self) -> int:
        """**Returns:** tokens per entry the attention reads besides its window (V4:
        ``compress_rate``, 0 for a sliding layer; V3.2: 1, every token is an entry)."""

    @property
    @abc.abstractmethod
    def context_halo(self) -> int:
        """**Returns:** rows before a chunk of the sequence that its forward needs besides the
        entries (context parallelism's halo)."""

    @property
    @abc.abstractmethod
    def selects(self) -> bool:
        """**Returns:** whether the layer's attention reads through a selection (its own or an
        inherited one): whether ``aux["selection"]`` is an array."""

    @abc.abstractmethod
    def forward_rows(
        self,
        x: Float[Array, "batch rows hidden"],
        source: Rows | ChunkSource,
        stage: str,
        want_loss: bool,
        shared: V41Shared,
    ) -> Forward:
        """The layer's pipeline after ``__call__``'s or ``extend``'s checks, over ``source``:
        the forward's ``Rows`` (all of a sequence, or one device's chunks with their halos
        under context parallelism) or ``extend``'s ``ChunkSource`` (the cache, then the
        chunk). It reads keys only through the source (``csa_eqx._rows``), so ``extend`` is the
        forward over ``[cache ; chunk]``.

        **Arguments:** hidden states ``x [B', L, hidden]``, their source, the checked training
        ``stage``, whether the indexer loss' inputs are wanted and the state published so far
        (``V41Shared()``: nothing).

        **Returns:** a ``Forward``: ``y``, the selection, the indexer's ``SelectionProblem``
        (``None`` without an indexer), the ``AttentionTarget`` (``None`` unless
        ``want_loss``), the source after the reads (``source.cache_after()``: ``extend``'s
        new cache) and the fields the layer publishes.
        """

    def indexer_problem(
        self,
        x: Float[Array, "batch seq hidden"],
        qr: Float[Array, "batch seq q_lora"],
        positions: Int[Array, "batch seq"],
        keys: Float[Array, "batch entries index_dim"],
        visibility: Visibility | CandidateVisibility,
    ) -> SelectionProblem:
        """The indexer's side of "what a query reads", shared by the selection, the KL loss and
        ``extend``.

        **Arguments:**

        - ``x``, ``qr``, ``positions``: per-token hidden states, query latents and RoPE positions
            (``[B, S, ...]``); ``x`` and ``qr`` are detached.
        - ``keys``: the indexer keys of the entries (V4: compressed entries, V3.2: tokens), as
            the numerics round them (``execution.numerics.indexer``); the queries are
            rounded here.
        - ``visibility``: which entries each query may see (and pick: within V4.1's
            candidates, a ``CandidateVisibility``).

        **Returns:**

        A ``SelectionProblem`` projecting the rows block by block to the indexer's queries
        and head weights (head-sharded when ``execution.indexer_heads_axis`` is set),
        scored by ``execution.scorer`` (``Execution.problem``).
        """
        ix, ex, formats = self.indexer, self.execution, self.formats

        def project(x, qr, positions):  # a fresh closure: hashable, and row by row
            nx = ex.numerics
            q = nx.indexer(ix.queries(qr, positions, nx), formats)
            return ex.on_heads(q), ex.on_heads(ix.head_weights(x, nx))

        rows = (*jax.lax.stop_gradient((x, qr)), positions)
        return ex.problem(project, rows, keys, visibility, ex.numerics.score_dtype(formats))

    def extend(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        cache: AbstractCache,
        lengths: Int[ArrayLike, " batch"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
        shared: V41Shared | None = None,
    ):
        """Run the chunk ``x`` after the tokens in ``cache``: equal to the full forward over the
        whole stream (prefill, chunked prefill or a decode step; docs/concepts.md, "Decoding:
        prefill and decode with a cache"). The indexer runs the forward's selection strategy
        and the chunk reads what the forward reads: the entries through
        ``Execution.entry_reads`` and V4's sliding window through ``Execution.window`` over
        ``[ring ; chunk]`` rows (``BandRows(history=...)``). It runs on one device: an
        execution with head or context parallelism is refused (``ValueError``).

        **Arguments:**

        - ``x``: the chunk's hidden states ``[B, T, hidden]``.
        - ``cache``: the layer's cache after the earlier tokens (``init_cache`` for none).
        - ``lengths``: real tokens per row ``[B]`` (right padding); default all ``T``.
        - ``segment_ids``: packed-document ids ``[B, T]`` (``>= 0``); ``None`` continues each
            row's last segment.
        - ``return_aux``: also return ``{"selection": ...}``.
        - ``indexer_loss``: the training stage whose attention to run (``"dense"`` reads every
            visible entry; no loss is computed); ``None`` = ``execution.indexer_loss``.
        - ``shared``: what the earlier layers published for this chunk (their ``extend``; a
            V4.1 KV source's entries and keys are every entry its cache holds); ``None``:
            nothing (and nothing is returned).

        **Returns:**

        ``(y, cache)``: outputs ``[B, T, hidden]`` and the updated cache; then the state after
        this layer when ``shared`` is given; then, with ``return_aux``, ``{"selection": ...}``:
        int32 ``[B, T, index_topk]`` (V4 / V4.1: cache entry slots in closing order; V3.2:
        stream indices; ``-1`` = none; ``None`` for a layer that reads no selection). An
        empty chunk returns ``[B, 0, hidden]``, the cache and ``shared`` unchanged.
        """
        stage = self.stage(indexer_loss)
        self.execution.check_one_device("extend")
        x, lengths, segment_ids = checks.chunk_inputs(self, x, cache, lengths, segment_ids)
        if x.shape[1] == 0:  # an empty chunk: nothing to attend to, nothing to write
            topk = self.config.index_topk if self.selects else None
            y, aux = checks.empty_outputs(x, topk, None, True)
            return _outputs((y, cache), shared, aux if return_aux else None)
        rows = chunk_rows(cache, x.shape[1], lengths, segment_ids)
        dtype, x = x.dtype, self.execution.numerics.layer_input(x)
        given = V41Shared() if shared is None else shared
        f = self.forward_rows(x, ChunkSource.start(cache, rows), stage, False, given)
        after = None if shared is None else given._replace(**f.published)
        aux = {"selection": f.selection} if return_aux else None
        return _outputs((f.y.astype(dtype), f.source.cache_after()), after, aux)

    def with_execution(self, execution):
        """The same parameters, run as ``execution`` says (e.g. another selection strategy).

        **Arguments:** the ``csa_eqx.Execution`` (checked against the config:
        ``Execution.checked``).

        **Returns:** a new layer sharing this one's arrays.
        """
        new = copy.copy(self)
        # a static field, so not a leaf ``eqx.tree_at`` could replace
        checked = type(self.execution).checked(execution, self.config, self.formats)
        object.__setattr__(new, "execution", checked)
        return new

    def stage(self, indexer_loss: str | None) -> str:
        """The training stage of one call, checked against the head chunk.

        **Arguments:** the call's ``indexer_loss`` (``None``: ``execution.indexer_loss``).

        **Returns:** ``"off"``, ``"dense"`` or ``"sparse"``; a ``ValueError`` otherwise.
        """
        if indexer_loss is None:  # the execution's own, checked when it was made
            return self.execution.indexer_loss
        self.execution.check(self.config.index_n_heads, self.config.num_heads, indexer_loss)
        return indexer_loss


def _body(
    stage: str,
    want_loss: bool,
    aux: bool,
    layer: AbstractIndexedAttention,
    x: Array,
    rows: Rows,
    state,
) -> tuple:
    """What every placement runs (``AbstractPlacement.run``): the layer's forward over ``rows``
    from the published state (a ``Carried`` of ``V41Shared`` fields), returning ``(y,
    selection, sums, carried)``: the selection when ``aux`` asks for it, the indexer loss sums
    when ``want_loss`` (``_loss_sums``) and only the state fields the layer published."""
    given = V41Shared(**state.per_row, **state.whole)
    f = layer.forward_rows(x, rows, stage, want_loss, given)
    sums = layer._loss_sums(rows, stage, f.selection, f.problem, f.target) if want_loss else ()
    return f.y, f.selection if aux else None, sums, carried(f.published)


def _outputs(head: tuple, shared: V41Shared | None, aux: dict | None):
    """A call's results: ``head`` (``y``, and ``extend``'s cache), then ``shared`` when given,
    then ``aux`` when asked for; a lone ``y`` alone."""
    out = head + (() if shared is None else (shared,)) + (() if aux is None else (aux,))
    return out[0] if len(out) == 1 else out
