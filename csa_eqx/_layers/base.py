"""The one protocol of every attention layer (``V4Attention``, ``V41Attention``,
``V32Attention``): construction, the public forward and ``extend`` (input checks, the empty-input
rule, positions, the placement, the indexer loss, the aux contract and the stack state of a
layer kind that has one), the per-call training stage and switching execution. A layer kind
writes only its pipeline (``forward_rows``) and its cache; its indexer (``csa_eqx._indexer``)
does the indexer's work."""

import abc
import copy
import dataclasses
import typing
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from equinox import AbstractVar
from jaxtyping import Array, ArrayLike, Float, Int, TypeCheckError, jaxtyped

from .. import _checks as checks
from .._decode.cache import AbstractCache
from .._decode.chunks import ChunkSource, chunk_rows
from .._indexer.base import AbstractIndexer
from .._layout import segment_positions, token_rows
from .._mesh import typed_mesh
from .._numerics.base import DeepSeekFormats
from .._placement.base import Carried, SingleDevice
from .._rows import Rows, whole_rows
from .forward import Forward, carried, published

__all__ = ["AbstractIndexedAttention"]


class AbstractIndexedAttention(eqx.Module):
    """What every attention layer shares: its architecture ``config``, its ``execution``, its
    ``indexer`` (an ``AbstractIndexer``, or ``None``) and one call protocol (``__call__`` and
    ``extend``, the same for every layer kind).

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

    State shared across the layers of a stack is an optional keyword of both calls,
    ``shared=``: when given it comes back after ``y`` (and the cache). A layer kind that reads
    and publishes some names its state's type in ``stack_state`` (V4.1's, docs/v41.md)
    and starts from an empty one when given another (``csa_eqx.run_stack`` starts a stack from
    nothing published); every other kind passes the state on as it came.
    """

    config: AbstractVar[Any]
    execution: AbstractVar[Any]
    indexer: AbstractVar[AbstractIndexer | None]
    formats: ClassVar[DeepSeekFormats]
    stack_state: ClassVar[type | None] = None

    @typing.no_type_check  # the named input checks first, then jaxtyping's (``_call``)
    def __call__(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        positions: Int[ArrayLike, "batch seq"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
        shared: Any = None,
    ):
        """The layer's forward (docs/concepts.md, "The DeepSeek-V4 attention block": the
        sliding window plus the compressed entries; "DeepSeek-V3.2 DSA": sparse MLA over the
        tokens the indexer selects; docs/v41.md: V4.1's shared entries and selections).

        **Arguments:**

        - ``x``: hidden states ``[B, S, hidden]``, floating point; or one sequence ``[S,
            hidden]`` (as ``eqx.nn`` layers take it, so ``jax.vmap(layer)`` maps sequences; its
            ``positions`` / ``segment_ids`` then ``[S]``, its outputs without the batch axis;
            not with ``shared``).
        - ``positions``: integer RoPE positions ``[B, S]``; default: the index inside each
            segment.
        - ``segment_ids``: integer packed-document ids ``[B, S]`` (contiguous runs, ``>= 0``);
            tokens only see their own segment, and V4's compression windows restart at each
            segment.
        - ``return_aux``: also return the aux dict.
        - ``indexer_loss``: the indexer's training stage for this call (``"off"``, ``"dense"``:
            attend to every visible entry and distil towards that, ``"sparse"``: attend to
            the selection and distil over it); ``None`` = ``execution.indexer_loss``.
        - ``shared``: what the earlier layers of a stack published (a V4.1 layer's
            state, docs/v41.md); ``None``: nothing (and nothing is returned). A V4.1
            reindex or reuse layer needs its sources' entries, keys and selection.

        **Returns:**

        ``y`` ``[B, S, hidden]`` in ``x``'s dtype; then, when ``shared`` is given, the state
        after this layer; then, with ``return_aux``, the aux dict: ``aux["selection"]`` int32
        ``[B, S, index_topk]`` in increasing order (V4 / V4.1: entry slots, V3.2: token
        indices; ``-1`` = none; a V4.1 reuse layer's is the one it inherits; ``None`` for a
        layer that reads no selection) and ``aux["indexer_loss"]`` a float32 scalar, or
        ``None`` when the stage is ``"off"`` (the default ``Execution.indexer_loss``) or the
        layer runs no indexer of its own: then no loss reaches the indexer, and ``task +
        aux["indexer_loss"]`` raises a ``TypeError``; ask for ``indexer_loss="dense"`` or
        ``"sparse"`` to train it (docs/training.md).

        The execution's placement runs it (``Execution.heads`` / ``context``): ``shared``
        crosses it as carried state.

        An empty ``x`` (no rows or no tokens) gives zeros, an empty selection, a zero loss and
        ``shared`` unchanged, before any compute. Wrong input types and shapes raise an error
        whose first line names the argument, what it must be and what came (``TypeError`` /
        ``ValueError``; the type checker's account follows).
        """
        if jnp.ndim(x) == 2 and shared is None:  # one sequence: a batch of one
            one = [None if a is None else jnp.asarray(a)[None] for a in (positions, segment_ids)]
            out = self(jnp.asarray(x)[None], *one, return_aux, indexer_loss=indexer_loss)
            if not return_aux:
                return out[0]
            y, aux = out
            selection = aux["selection"]
            return y[0], {**aux, "selection": None if selection is None else selection[0]}
        inputs = (x, positions, segment_ids)
        try:
            with typed_mesh(inputs, self):  # jitted without jax.set_mesh: the inputs' mesh
                return self._call(*inputs, return_aux, indexer_loss, shared)
        except TypeCheckError as error:
            raise checks.readable(error, self.config.hidden_size, *inputs) from None

    @jaxtyped(typechecker=beartype)
    def _call(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        positions: Int[ArrayLike, "batch seq"] | None,
        segment_ids: Int[ArrayLike, "batch seq"] | None,
        return_aux: bool,
        indexer_loss: str | None,
        shared: Any,
    ):
        """``__call__`` with its arguments' shapes checked by jaxtyping."""
        c, ex = self.config, self.execution
        stage = self.stage(indexer_loss)
        x, positions, segment_ids = checks.layer_inputs(c.hidden_size, x, positions, segment_ids)
        checks.warn_dtype_mismatch(self, x)
        trains = self.indexer is not None and stage != "off"
        if x.size == 0:
            topk = c.index_topk if self.selects else None
            y, aux = checks.empty_outputs(x, topk, trains, True)
            return _outputs((y,), shared, aux if return_aux else None)
        dtype, x = x.dtype, ex.numerics.layer_input(x)
        placement = ex.placement
        rows = self._whole_rows(placement, x, positions, segment_ids)
        want_loss = return_aux and trains
        state = self._state(shared)
        given = Carried() if state is None else carried(state._asdict(), state.per_row)
        body = partial(_body, stage, want_loss, return_aux)
        y, selection, sums, out = placement.run(body, self, x, rows, given)
        y = y.astype(dtype)
        aux = None
        if return_aux:
            loss = sums[0] / jnp.maximum(sums[1], 1.0) if want_loss else None
            aux = {"selection": selection, "indexer_loss": loss}
        after = shared if state is None or shared is None else published(state, out)
        return _outputs((y,), after, aux)

    def indexer_scores(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        queries: Sequence[int] | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        *,
        shared: Any = None,
    ) -> tuple[Float[Array, "batch nq entries"], Int[Array, "batch nq k"]]:
        """The indexer scores behind the layer's selection, for the chosen queries: what the
        forward's top-k ranks (docs/concepts.md, "The lightning indexer"), as its numerics
        and scorer compute them. For exploring (notebooks, ``csa_eqx.plot_picks``): it runs
        the forward on one device and forms ``[B, nq, T]`` scores.

        **Arguments:**

        - ``x``, ``positions``, ``segment_ids``, ``shared``: as for ``__call__``.
        - ``queries``: the query rows to score (Python ints in ``[0, S)``); ``None``: all.

        **Returns:** ``(scores, picks)``: float32 ``[B, nq, T]`` scores of each chosen query
        against every entry (V4 / V4.1: compressed-entry slots, V3.2: tokens), ``-inf`` where
        the entry is not visible to it (not closed yet, another document's, or outside V4.1's
        candidates), and its picks, int32 ``[B, nq, index_topk]`` (``aux["selection"]``'s
        rows: the top-k of the finite scores, ties to the lower index, ``-1`` = none). A
        ``ValueError`` for a layer with no indexer of its own or a query out of range.
        """
        if self.indexer is None:
            raise ValueError(
                f"indexer_scores needs a layer with an indexer of its own (CSA, V3.2, or a "
                f"V4.1 index source); this one has none ({type(self).__name__})"
            )
        c = self.config
        x, positions, segment_ids = checks.layer_inputs(c.hidden_size, x, positions, segment_ids)
        s = x.shape[1]
        chosen = np.arange(s) if queries is None else np.asarray(queries)
        ints = chosen.ndim == 1 and chosen.size > 0 and np.issubdtype(chosen.dtype, np.integer)
        if not (ints and ((chosen >= 0) & (chosen < s)).all()):
            raise ValueError(
                f"queries must be a non-empty sequence of query rows, ints in [0, {s}) "
                f"(got {queries!r})"
            )
        rows = self._whole_rows(SingleDevice(), x, positions, segment_ids)
        state = self._state(shared)
        x = self.execution.numerics.layer_input(x)
        f = self.forward_rows(x, rows, "off", False, *(() if state is None else (state,)))
        p = f.problem
        q, w = p.project(*(r[:, chosen] for r in p.rows))
        scores = p.scorer.scores(q, w, p.keys, head_chunk=p.head_chunk, score_dtype=p.score_dtype)
        visible = p.visibility.mask()[:, chosen]
        return jnp.where(visible, scores, -jnp.inf), f.selection[:, chosen]

    def _state(self, shared: Any):
        """The stack state this layer kind reads (``None`` for a kind without one): ``shared``
        when it is one, else an empty one."""
        kind = self.stack_state
        if kind is None:
            return None
        return shared if isinstance(shared, kind) else kind()

    def _whole_rows(self, placement, x, positions, segment_ids) -> Rows:
        """The whole sequence's ``Rows`` of a forward that ``placement`` runs, from the checked
        ``x``, ``positions`` and ``segment_ids`` (default positions: the index inside each
        segment)."""
        like, positions, segment_ids = placement.rows_inputs(x, positions, segment_ids)
        seg, query_index = token_rows(like, segment_ids)
        positions = segment_positions(seg) if positions is None else positions
        return whole_rows(positions, seg, query_index, self.entry_rate)

    def __repr__(self) -> str:
        """A few lines: the layer's class and kind, its key sizes (``summary``), its weights'
        dtype and its execution's fields that differ from the defaults, each on one line
        (``eqx.tree_pprint(layer)`` prints every array)."""
        kind, sizes = self.summary()
        leaves = jax.tree.leaves(self)  # arrays, or their shapes (``eqx.filter_eval_shape``)
        matrices = [w for w in leaves if getattr(w, "ndim", 0) >= 2]
        dtypes = sorted({str(w.dtype) for w in matrices if jnp.issubdtype(w.dtype, jnp.inexact)})
        listed = [f"{name}={value}" for name, value in sizes.items()]
        listed.append(f"weights={'/'.join(dtypes)}")
        rows = [", ".join(listed[i : i + 4]) for i in range(0, len(listed), 4)]
        lines = [f"{type(self).__name__}({kind},", *[f"  {row}," for row in rows]]
        ex = self.execution
        changed = ", ".join(
            f"{f.name}={eqx.tree_pformat(getattr(ex, f.name), width=1 << 16)}"
            for f in dataclasses.fields(ex)
            if getattr(ex, f.name) != f.default
        )
        return "\n".join([*lines, f"  execution={type(ex).__name__}({changed}))"])

    @abc.abstractmethod
    def summary(self) -> tuple[str, dict[str, int]]:
        """**Returns:** the layer's kind in words (``"CSA (compressed sparse attention)"``) and
        its key sizes by config field name (compression rate, top-k, window, heads, ...), as
        the layer's ``repr`` shows them."""

    @abc.abstractmethod
    def head_specs(self, axis: str) -> tuple:
        """How head parallelism splits the layer's arrays.

        **Arguments:** the mesh ``axis`` the heads are split over.

        **Returns:** ``(specs, heads)``: a function from the layer's arrays (``eqx.partition(layer,
        eqx.is_array)[0]``) to a ``PartitionSpec`` per array, and the head counts the axis size
        must divide (by config field name).
        """

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
        *state,
    ) -> Forward:
        """The layer's pipeline after ``__call__``'s or ``extend``'s checks, over ``source``:
        the forward's ``Rows`` (all of a sequence, or one device's chunks with their halos
        under context parallelism) or ``extend``'s ``ChunkSource`` (the cache, then the
        chunk). It reads keys only through the source (``csa_eqx._rows``), so ``extend`` is the
        forward over ``[cache ; chunk]``.

        **Arguments:** hidden states ``x [B', L, hidden]``, their source, the checked training
        ``stage``, whether the indexer loss' inputs are wanted and, for a layer kind with a
        ``stack_state``, the state published so far (a kind without one gets nothing).

        **Returns:** a ``Forward``: ``y``, the selection, the indexer's ``SelectionProblem``
        (``None`` without an indexer), the ``AttentionTarget`` (``None`` unless
        ``want_loss``), the source after the reads (``source.cache_after()``: ``extend``'s
        new cache) and the state fields the layer publishes.
        """

    @typing.no_type_check  # the named input checks first, then jaxtyping's (``_extend``)
    def extend(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        cache: AbstractCache,
        lengths: Int[ArrayLike, " batch"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
        shared: Any = None,
    ):
        """Run the chunk ``x`` after the tokens in ``cache``: equal to the full forward over the
        whole stream (prefill, chunked prefill or a decode step; docs/concepts.md, "Decoding:
        prefill and decode with a cache"). The indexer runs the forward's selection strategy
        and the chunk reads what the forward reads: the entries through the execution's
        ``picks`` and V4's sliding window through its ``window`` over ``[ring ; chunk]`` rows
        (``BandRows(history=...)``). It runs on one device: an execution with head or context
        parallelism is refused (``ValueError``). A chunk that would take a row past the cache's
        ``max_length`` raises ``decode cache overflow: ...``, naming the cache, its
        ``max_length`` and the fix: a ``ValueError`` when the rows' lengths are concrete, else
        at run time (``equinox.EquinoxRuntimeError`` under ``eqx.filter_jit``: compile
        ``extend`` with it, not ``jax.jit``).

        **Arguments:**

        - ``x``: the chunk's hidden states ``[B, T, hidden]``, floating point.
        - ``cache``: the layer's cache after the earlier tokens (``init_cache`` for none).
        - ``lengths``: integer real tokens per row ``[B]`` (right padding); default all ``T``.
        - ``segment_ids``: integer packed-document ids ``[B, T]`` (``>= 0``); ``None``
            continues each row's last segment.
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
        empty chunk returns ``[B, 0, hidden]``, the cache and ``shared`` unchanged. Wrong input
        types and shapes raise as ``__call__``'s.
        """
        try:
            with typed_mesh((x, cache, lengths, segment_ids), self):  # as __call__
                return self._extend(
                    x, cache, lengths, segment_ids, return_aux, indexer_loss, shared
                )
        except TypeCheckError as error:
            size = self.config.hidden_size
            raise checks.readable(error, size, x, None, segment_ids, lengths) from None

    @jaxtyped(typechecker=beartype)
    def _extend(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        cache: AbstractCache,
        lengths: Int[ArrayLike, " batch"] | None,
        segment_ids: Int[ArrayLike, "batch seq"] | None,
        return_aux: bool,
        indexer_loss: str | None,
        shared: Any,
    ):
        """``extend`` with its arguments' shapes checked by jaxtyping."""
        stage = self.stage(indexer_loss)
        self.execution.check_one_device("extend")
        x, lengths, segment_ids = checks.chunk_inputs(self, x, cache, lengths, segment_ids)
        checks.warn_dtype_mismatch(self, x)
        if x.shape[1] == 0:  # an empty chunk: nothing to attend to, nothing to write
            topk = self.config.index_topk if self.selects else None
            y, aux = checks.empty_outputs(x, topk, None, True)
            return _outputs((y, cache), shared, aux if return_aux else None)
        rows = chunk_rows(cache, x.shape[1], lengths, segment_ids)
        dtype, x = x.dtype, self.execution.numerics.layer_input(x)
        state = self._state(shared)
        given = () if state is None else (state,)
        f = self.forward_rows(x, ChunkSource.start(cache, rows), stage, False, *given)
        after = shared if state is None or shared is None else state._replace(**f.published)
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


def config_sizes(config: Any, *names: str) -> dict[str, int]:
    """**Returns:** the ``config``'s fields ``names``, by name, in that order (the sizes a
    layer's ``summary`` shows)."""
    return {name: getattr(config, name) for name in names}


def _body(
    stage: str,
    want_loss: bool,
    aux: bool,
    layer: AbstractIndexedAttention,
    x: Array,
    rows: Rows,
    given: Carried,
) -> tuple:
    """What every placement runs (``AbstractPlacement.run``): the layer's forward over ``rows``
    from the stack state it got (``given``, as carried; nothing for a kind without a state),
    returning ``(y, selection, sums, carried)``: the selection when ``aux`` asks for it, the
    indexer loss sums when ``want_loss`` (``AbstractIndexer.loss_sums``) and the state fields
    the layer published."""
    kind = layer.stack_state
    state = () if kind is None else (kind(**given.per_row, **given.whole),)
    f = layer.forward_rows(x, rows, stage, want_loss, *state)
    sums = ()
    if want_loss:
        args = (rows, stage, f.selection, f.problem, f.target, layer.execution)
        sums = layer.indexer.loss_sums(*args)
    out = carried(f.published, () if kind is None else kind.per_row)
    return f.y, f.selection if aux else None, sums, out


def _outputs(head: tuple, shared: Any, aux: dict | None):
    """A call's results: ``head`` (``y``, and ``extend``'s cache), then ``shared`` when given,
    then ``aux`` when asked for; a lone ``y`` alone."""
    out = head + (() if shared is None else (shared,)) + (() if aux is None else (aux,))
    return out[0] if len(out) == 1 else out
