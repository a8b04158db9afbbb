"""Visibility of compressed entries, exact top-k with a ``-1`` sentinel, and the selection
strategy interface (docs/concepts.md, "The lightning indexer" and "Exact top-k").

A selection strategy (``AbstractSelection``) answers one question, "which ``k`` entries does
each query read?", for a ``SelectionProblem``; ``DenseSelection`` scores every entry at once.
The streaming, sharded and automatic strategies live in ``csa_eqx.streaming``,
``csa_eqx.ShardedSelection`` and ``csa_eqx.auto``. Strategies score through the problem's
``scorer`` (the kernel seam, ``AbstractScorer``) and size their tiles by its ``tiles``
(``TileSizes``, resolved for the backend by ``csa_eqx.auto.backend_tiles``).

Ties go to the lower index everywhere. ReLU-based scores produce both ``-0.0`` and ``+0.0``,
which must tie, so scores are canonicalised (all zeros made ``+0.0``) before they are ranked.
Selections list their picks in increasing index order (a set; the attention does not care
about order), which lets an exact radix select replace a sort (``exact_topk``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ._scorer import AbstractScorer
from ._scorer_xla import XlaScorer
from .compressor import EntryLayout

__all__ = [
    "entry_visibility",
    "select_topk",
    "exact_topk",
    "canonical_scores",
    "scatter_rows",
    "Visibility",
    "TileSizes",
    "SelectionProblem",
    "AbstractSelection",
    "DenseSelection",
]


def entry_visibility(
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
) -> Bool[Array, "batch seq slots"]:
    """Entry ``j`` is visible to query ``t`` iff its window closed at or before ``t`` in ``t``'s
    segment (``w < (t + 1) // m`` without packing; docs/concepts.md, "Visibility").

    Arguments:
        query_index: int32 ``[B, S]`` row index of each query (its stream index in ``extend``);
            ``-1`` sees nothing.
        query_segment: int32 ``[B, S]`` segment id of each query.
        layout: the entries' ``EntryLayout`` (``end = -1``: empty slot).

    Returns:
        bool ``[B, S, T]``.
    """
    end = layout.end[:, None, :]
    return (
        (end >= 0)
        & (end <= query_index[:, :, None])
        & (layout.segment[:, None, :] == query_segment[:, :, None])
    )


def canonical_scores(scores: Array) -> Array:
    """Map ``-0.0`` to ``+0.0`` so that equal scores tie (XLA sorts by total order). XLA
    flushes subnormals to zero, so they become ``+0.0`` here too.

    Arguments: float ``scores`` of any shape.

    Returns: the same shape and dtype, without ``-0.0``.
    """
    return jnp.where(scores == 0, jnp.zeros_like(scores), scores)


def scatter_rows(index: Int[Array, "*rows n"], updates: Array, width: int, fill) -> Array:
    """``out[..., index[..., i]] = updates[..., i]`` in a new ``[*rows, width]`` array of
    ``fill``; indices outside ``[0, width)`` are dropped. Under an Explicit mesh the result's
    rows are sharded like ``index``'s rows (a scatter cannot infer that by itself).

    Arguments: int ``index [*rows, n]``, ``updates`` of the same shape, the output ``width``
    and the ``fill`` value.

    Returns: ``[*rows, width]`` in ``updates``' dtype.
    """
    lead = index.shape[:-1]
    rows = tuple(jnp.arange(n).reshape((n,) + (1,) * (len(lead) - i)) for i, n in enumerate(lead))
    sharding = jax.typeof(index).sharding
    explicit = any(t == AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ()))
    out = NamedSharding(sharding.mesh, P(*sharding.spec[:-1], None)) if explicit else None
    target = jnp.full((*lead, width), fill, jnp.result_type(updates))
    return target.at[(*rows, index)].set(updates, mode="drop", out_sharding=out)


def _order_keys(values: Array) -> Array:
    """``uint32`` keys in the order of the float32 ``values`` (``-0.0`` and ``+0.0`` equal)."""
    bits = jax.lax.bitcast_convert_type(canonical_scores(values.astype(jnp.float32)), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _compact(count: Int[Array, "*rows n"], k: int, unroll: bool) -> Int[Array, "*rows {k}"]:
    """The positions of the picks in increasing order, ``-1`` past the last: pick ``j`` is the
    first position where the running pick ``count`` reaches ``j + 1``, found by a binary search
    per pick (``[*rows, k]`` gathers). A scatter of every position to its slot would need
    ``[*rows, n]`` index tuples, 12 bytes per element, the largest buffers of a selection."""
    n = count.shape[-1]
    target = jnp.arange(1, k + 1, dtype=jnp.int32)
    lo = jnp.zeros((*count.shape[:-1], k), jnp.int32)

    def halve(_, bounds):  # invariant: the answer is in [lo, hi]; hi = n means none
        lo, hi = bounds
        mid = (lo + hi) // 2
        short = jnp.take_along_axis(count, jnp.minimum(mid, n - 1), axis=-1) < target
        return jnp.where(short, mid + 1, lo), jnp.where(short, hi, mid)

    steps = max(n, 1).bit_length()
    pos = jax.lax.fori_loop(0, steps, halve, (lo, jnp.full_like(lo, n)), unroll=unroll)[0]
    return jnp.where(pos < n, pos, -1)


def exact_topk(
    values: Float[Array, "*rows n"], valid: Bool[Array, "*rows n"], k: int, *, unroll: bool = False
) -> tuple[Float[Array, "*rows {k}"], Int[Array, "*rows {k}"]]:
    """The ``k`` largest valid values of each row and their positions, in increasing position
    order (the set a full sort would pick, ties to the lower position); ``(-inf, -1)`` fill
    the rest.

    A radix select, not a sort: 32 halving steps find each row's k-th largest value (as an
    order-preserving ``uint32`` key) by counting, then the picks are compacted by a binary
    search per pick over their running count. On
    CPU this is ~4x faster than ``lax.top_k`` at indexer sizes (k = 512 of 1024), and the
    cost does not grow with ``k`` (docs/concepts.md, "Top-k selection").

    Arguments: float ``values [*rows, n]``, bool ``valid [*rows, n]``, ``k > 0`` and
    ``unroll``: unroll the 32 steps (faster on accelerators, where each loop iteration costs a
    predicate round trip; on CPU unrolling only slows compiles, ~1.5 s per layer). The
    strategies take it from ``TileSizes.unroll``, chosen for the backend in ``csa_eqx.auto``.

    Returns: ``(top values, positions)``, float32 and int32 ``[*rows, k]``.
    """
    want = min(k, values.shape[-1])
    key = jnp.where(valid, _order_keys(values), jnp.uint32(0))  # valid keys are > 0

    def halve(_, bounds):  # invariant: at least `want` keys >= lo; none >= hi + 1 would do
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        enough = jnp.sum(key >= mid[..., None], axis=-1, dtype=jnp.int32) >= want
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo = jnp.zeros(key.shape[:-1], jnp.uint32)
    kth, _ = jax.lax.fori_loop(0, 32, halve, (lo, jnp.full_like(lo, 0xFFFFFFFF)), unroll=unroll)
    above, tied = key > kth[..., None], key == kth[..., None]
    room = want - jnp.sum(above, axis=-1, dtype=jnp.int32)
    pick = valid & (above | (tied & (jnp.cumsum(tied, -1, dtype=jnp.int32) <= room[..., None])))
    pos = _compact(jnp.cumsum(pick, -1, dtype=jnp.int32), k, unroll)
    picked = jnp.take_along_axis(values.astype(jnp.float32), jnp.maximum(pos, 0), axis=-1)
    return jnp.where(pos >= 0, picked, -jnp.inf), pos


def select_topk(
    scores: Float[Array, "batch seq entries"],
    visible: Bool[Array, "batch seq entries"],
    k: int,
    *,
    unroll: bool = False,
) -> Int[Array, "batch seq {k}"]:
    """Indices of the ``k`` best visible entries per query, in increasing index order
    (docs/concepts.md, "Top-k selection").

    Exact: the set a full sort would pick, ties to the lower index (see ``exact_topk``).

    Arguments:
        scores: float ``[B, S, T]`` (``-0.0`` ties ``+0.0``).
        visible: bool ``[B, S, T]``; invisible entries are never picked.
        k: picks per query (> 0).
        unroll: unroll the radix select's steps (``exact_topk``; same result).

    Returns:
        int32 ``[B, S, k]``: picks beyond the visible count are ``-1`` (at the end); when ``k``
        exceeds ``T`` the result is padded with ``-1`` so its shape is always ``[..., k]``.
    """
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    return exact_topk(scores, visible, k, unroll=unroll)[1]


class Visibility(NamedTuple):
    """Which entries each query may see (docs/concepts.md, "Visibility"): an entry is visible
    when it closed at or before the query, in the query's segment.

    Arguments:
        query_index: int32 ``[B, S]`` stream index of each query.
        query_segment: int32 ``[B, S]`` segment of each query.
        layout: the entries' ``EntryLayout`` (``[B, T]`` each).
    """

    query_index: Int[Array, "batch seq"]
    query_segment: Int[Array, "batch seq"]
    layout: EntryLayout

    def mask(self) -> Bool[Array, "batch seq entries"]:
        """Returns: the dense bool ``[B, S, T]`` mask (``entry_visibility``); only dense
        paths form it."""
        return entry_visibility(self.query_index, self.query_segment, self.layout)


class TileSizes(NamedTuple):
    """The backend-dependent sizes of the selection and the indexer loss (tiles, buffers,
    unrolling). ``csa_eqx.auto.backend_tiles()`` chooses them for the backend (what the layers
    use, through ``Execution.tiles``); the defaults are the CPU sizes.

    Arguments:
        elements: elements of the largest per-tile tensor ``[B, Qb, heads at once, Kb]`` (and
            of one top-k row buffer); also the size up to which the automatic choices stay
            dense (default 2^24: 64 MiB of float32, cache-sized on CPU).
        key_block: automatic entries per key tile (default 128).
        max_query_block: largest automatic query block (default 256).
        unroll: unroll the radix select's 32 steps (``exact_topk``; default ``False``).
        attention_elements: the elements one query block of the attention keeps (gathered
            keys and logits, ``csa_eqx.auto.attention_query_block``; default 2^24).
    """

    elements: int = 1 << 24
    key_block: int = 128
    max_query_block: int = 256
    unroll: bool = False
    attention_elements: int = 1 << 24


_REFERENCE, _CPU_TILES = XlaScorer(), TileSizes()


class SelectionProblem(NamedTuple):
    """Everything a selection strategy needs: "what may each query read, and how good is it".

    Arguments:
        project: maps per-token ``rows`` to the indexer queries ``[B, S, H, d]`` and head
            weights ``[B, S, H]`` (float32, ``H^-1/2`` included). It must act row by row, so a
            strategy may call it on any block of rows (streaming never forms the whole
            ``[B, S, H, d]`` queries). Must be hashable (a lambda, not a bound Module method).
        rows: per-token inputs of ``project``, each ``[B, S, ...]``.
        keys: the entries' indexer keys ``[B, T, d]``.
        visibility: query indices / segments and the entries' layout.
        head_chunk: indexer heads scored at once (0 = all; must divide ``H``).
        score_dtype: the dtype scores are rounded to (``None``: float32; see
            ``csa_eqx.indexer_scores``), as the layer's numerics say.
        scorer: the scoring kernel (``AbstractScorer``; default ``XlaScorer()``, the
            reference), as ``Execution.scorer`` says.
        tiles: the backend's tile sizes (``TileSizes``; default the CPU sizes), as
            ``Execution.tiles`` resolves them.
    """

    project: Callable[..., tuple[Array, Array]]
    rows: tuple[Array, ...]
    keys: Float[Array, "batch entries dim"]
    visibility: Visibility
    head_chunk: int = 0
    score_dtype: str | None = None
    scorer: AbstractScorer = XlaScorer()
    tiles: TileSizes = TileSizes()

    @classmethod
    def from_queries(
        cls,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch entries dim"],
        visibility: Visibility,
        head_chunk: int = 0,
        score_dtype: str | None = None,
        scorer: AbstractScorer = _REFERENCE,
        tiles: TileSizes = _CPU_TILES,
    ) -> SelectionProblem:
        """A problem whose queries and head weights are already projected.

        Arguments:
            q: float ``[B, S, H, d]`` indexer queries; weights: float ``[B, S, H]``.
            keys, visibility, head_chunk, score_dtype, scorer, tiles: as for the class.

        Returns: the ``SelectionProblem`` (its ``project`` is the identity).
        """
        return cls(
            _identity, (q, weights), keys, visibility, head_chunk, score_dtype, scorer, tiles
        )

    def with_queries(
        self, q: Float[Array, "batch seq heads dim"], weights: Float[Array, "batch seq heads"]
    ) -> SelectionProblem:
        """Arguments: projected queries ``[B, S, H, d]`` and weights ``[B, S, H]``.

        Returns: this problem over them (its ``project`` the identity), all else kept.
        """
        return self._replace(project=_identity, rows=(q, weights))

    def sizes(self) -> tuple[int, int, int, int]:
        """Returns: ``(batch, seq, entries, heads scored at once)`` (no computation)."""
        b, s, h, _ = jax.eval_shape(self.project, *self.rows)[0].shape
        return b, s, self.keys.shape[1], self.head_chunk or h

    def queries(self) -> tuple[Array, Array]:
        """Returns: the whole float ``[B, S, H, d]`` queries and ``[B, S, H]`` weights."""
        return self.project(*self.rows)

    def scores(
        self,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch entries dim"],
    ) -> Float[Array, "batch seq entries"]:
        """Arguments: queries ``[B, S, H, d]``, weights ``[B, S, H]`` (any block of the
        problem's rows) and keys ``[B, T', d]`` (any block of its entries).

        Returns: their float32 scores ``[B, S, T']`` by the problem's ``scorer``, with its
        ``head_chunk`` and ``score_dtype``.
        """
        return self.scorer.scores(
            q, weights, keys, head_chunk=self.head_chunk, score_dtype=self.score_dtype
        )


def _identity(q: Array, w: Array) -> tuple[Array, Array]:
    return q, w


class AbstractSelection(eqx.Module):
    """How the indexer's top-k is computed. Every strategy returns the same selection bitwise:
    the ``k`` best visible entries per query (ties to the lower index), in increasing index
    order, ``-1`` past the visible count. A strategy scores through ``problem.scores`` (the
    problem's scorer) and sizes its tiles by ``problem.tiles``."""

    @abc.abstractmethod
    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        """Arguments: the ``problem`` and ``k > 0`` picks per query.

        Returns: int32 ``[B, S, k]`` entry indices, ``-1`` = none.
        """


class DenseSelection(AbstractSelection):
    """Score every query against every entry (``[B, S, T]`` float32), then one exact top-k.
    Fastest while that tensor is small; see ``csa_eqx.auto.AutoSelection``.

    Arguments: none. ``select`` returns int32 ``[B, S, k]``, ``-1`` = none.
    """

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        scores = problem.scores(*problem.queries(), problem.keys)
        return select_topk(scores, problem.visibility.mask(), k, unroll=problem.tiles.unroll)
