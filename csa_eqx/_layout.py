"""Where compressed entries come from and who may read them: the slots' ``EntryLayout``, segment
positions and rows, and the visibility rule (docs/concepts.md, "Compressed entries" and
"Visibility"). The shared vocabulary of the selection, the attention and the placements.

Compressed entries live in *slots*: entry ``j`` is the window whose last token has row index
``end[j]`` with ``end[j] // m == j``. Windows are aligned to the start of each segment, so a
packed row gives every document exactly the entries it would get alone; a slot whose window
does not close inside the row is empty (``end = -1``). Without segments this is the plain layout
``end[j] = j·m + m − 1``. Entry ``j`` is visible to query ``t`` iff its window closed at or
before ``t`` in ``t``'s segment.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, Shaped

__all__ = [
    "EntryLayout",
    "entry_layout",
    "segment_positions",
    "token_rows",
    "Visibility",
    "entry_visibility",
    "scatter_rows",
    "gather_keys",
    "take",
]


class EntryLayout(NamedTuple):
    """Where each compressed-entry slot comes from (docs/concepts.md, "Compressed entries").

    **Arguments:**

    - ``end``: int32 ``[B, T]`` row index of the last token of the entry's window;
        ``-1`` = empty slot.
    - ``segment``: int32 ``[B, T]`` the window's segment.
    - ``has_prior``: bool ``[B, T]`` whether a previous window of the same segment exists
        (CSA's overlap half; it restarts at a segment start).
    """

    end: Int[Array, "batch slots"]
    segment: Int[Array, "batch slots"]
    has_prior: Bool[Array, "batch slots"]


def segment_positions(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Index of each token inside its segment (segments are contiguous runs of one id).

    **Arguments:**

    - ``segment_ids``: int ``[B, S]``.

    **Returns:**

    int32 ``[B, S]``: 0 at each segment's first token (the default RoPE positions).
    """
    s = segment_ids.shape[1]
    idx = jnp.arange(s, dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - first


def token_rows(
    x: Float[Array, "batch seq *rest"], segment_ids: Int[Array, "batch seq"] | None
) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
    """``(segment ids, row index)`` of every token, int32, laid out like ``x``'s first two axes
    (so they carry its sharding on Explicit meshes; no segments = one segment). The zeros pass
    an optimisation barrier: without segment ids everything integer would be a constant, and
    XLA's constant folding of the entry layout (a reduce-window over ``S`` rows) made compile
    time grow with ``S`` (docs/v41.md, "V4 against V4.1": the 1M-token compile never ended)."""
    base = jnp.zeros_like(x[..., 0] if x.ndim > 2 else x, dtype=jnp.int32)
    base = jax.lax.optimization_barrier(base)
    seg = base if segment_ids is None else base + jnp.asarray(segment_ids, jnp.int32)
    return seg, base + jnp.arange(x.shape[1], dtype=jnp.int32)


def entry_layout(segment_ids: Int[Array, "batch seq"], m: int) -> EntryLayout:
    """Slots of the compressed entries of a row, windows aligned to each segment's start
    (docs/concepts.md, "Packed sequences: segment-aligned windows").

    **Arguments:**

    - ``segment_ids``: int ``[B, S]``.
    - ``m``: compression rate (1: one entry per token, V3.2's selection over tokens).

    **Returns:**

    An ``EntryLayout`` of ``ceil(S / m)`` slots: window end row (``-1`` = empty slot), its
    segment, and whether a previous window of the same segment exists (CSA's overlap).
    """
    b, s = segment_ids.shape
    slots = -(-s // m)
    pos = segment_positions(segment_ids)
    # slot j holds the (at most one) window closing at a row in [j*m, j*m + m)
    closing = jnp.where((pos + 1) % m == 0, jnp.arange(s, dtype=jnp.int32), -1)
    closing = jnp.pad(closing, [(0, 0), (0, slots * m - s)], constant_values=-1)
    end = jnp.max(closing.reshape(b, slots, m), axis=-1)
    safe = jnp.maximum(end, 0)
    segment = jnp.take_along_axis(segment_ids, safe, axis=1)
    has_prior = (end >= 0) & (jnp.take_along_axis(pos, safe, axis=1) >= 2 * m - 1)
    return EntryLayout(end, segment, has_prior)


def entry_visibility(
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
) -> Bool[Array, "batch seq slots"]:
    """Entry ``j`` is visible to query ``t`` iff its window closed at or before ``t`` in ``t``'s
    segment (``w < (t + 1) // m`` without packing; docs/concepts.md, "Visibility").

    **Arguments:**

    - ``query_index``: int32 ``[B, S]`` row index of each query (its stream index in ``extend``);
        ``-1`` sees nothing.
    - ``query_segment``: int32 ``[B, S]`` segment id of each query.
    - ``layout``: the entries' ``EntryLayout`` (``end = -1``: empty slot).

    **Returns:**

    bool ``[B, S, T]``.
    """
    end = layout.end[:, None, :]
    return (
        (end >= 0)
        & (end <= query_index[:, :, None])
        & (layout.segment[:, None, :] == query_segment[:, :, None])
    )


def gather_keys(kv: Shaped[Array, "batch keys dim"], indices: Int[Array, "batch seq k"]) -> Array:
    """**Arguments:** ``kv [B, N, dim]`` and int32 ``indices [B, S, k]``.

    **Returns:** ``kv[b, indices[b, s, i]]`` as ``[B, S, k, dim]`` (``-1`` reads row 0; mask it).
    """
    b, s, k = indices.shape
    flat = jnp.clip(indices, 0, kv.shape[1] - 1).reshape(b, s * k)
    return jnp.take_along_axis(kv, flat[..., None], axis=1).reshape(b, s, k, kv.shape[-1])


def scatter_rows(index: Int[Array, "*rows n"], updates: Array, width: int, fill) -> Array:
    """``out[..., index[..., i]] = updates[..., i]`` in a new ``[*rows, width]`` array of
    ``fill``; indices outside ``[0, width)`` are dropped. Under an Explicit mesh the result's
    rows are sharded like ``index``'s rows (a scatter cannot infer that by itself).

    **Arguments:** int ``index [*rows, n]``, ``updates`` of the same shape, the output ``width``
    and the ``fill`` value.

    **Returns:** ``[*rows, width]`` in ``updates``' dtype.
    """
    lead = index.shape[:-1]
    rows = tuple(jnp.arange(n).reshape((n,) + (1,) * (len(lead) - i)) for i, n in enumerate(lead))
    sharding = jax.typeof(index).sharding
    explicit = any(t == AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ()))
    out = NamedSharding(sharding.mesh, P(*sharding.spec[:-1], None)) if explicit else None
    target = jnp.full((*lead, width), fill, jnp.result_type(updates))
    return target.at[(*rows, index)].set(updates, mode="drop", out_sharding=out)


class Visibility(NamedTuple):
    """Which entries each query may see (docs/concepts.md, "Visibility"): an entry is visible
    when it closed at or before the query, in the query's segment.

    What a selection or loss strategy asks of a visibility (``csa_eqx.CandidateVisibility``,
    V4.1's pre-filter, answers the same calls): ``mask()``, ``rows`` / ``pad_rows`` /
    ``with_layout`` (the same visibility over other query rows or entries), ``tile`` (a
    block of entries) and ``slots`` (each query's own entries, for gathering).

    **Arguments:**

    - ``query_index``: int32 ``[B, S]`` stream index of each query.
    - ``query_segment``: int32 ``[B, S]`` segment of each query.
    - ``layout``: the entries' ``EntryLayout`` (``[B, T]`` each).
    """

    query_index: Int[Array, "batch seq"]
    query_segment: Int[Array, "batch seq"]
    layout: EntryLayout

    def mask(self) -> Bool[Array, "batch seq entries"]:
        """**Returns:** the dense bool ``[B, S, T]`` mask (``entry_visibility``); only dense
        paths form it."""
        return entry_visibility(self.query_index, self.query_segment, self.layout)

    def rows(self, start: Int[Array, ""] | int, size: int) -> Visibility:
        """**Arguments:** the first query row ``start`` and the number of rows ``size``.

        **Returns:** the visibility of query rows ``start .. start + size``."""
        qi, qs = (take(a, start, size) for a in (self.query_index, self.query_segment))
        return self._replace(query_index=qi, query_segment=qs)

    def pad_rows(self, n: int) -> Visibility:
        """**Arguments:** a number of rows ``n``.

        **Returns:** the visibility with ``n`` query rows appended that see no entry."""
        pad = [(0, 0), (0, n)]
        return self._replace(
            query_index=jnp.pad(self.query_index, pad, constant_values=-1),
            query_segment=jnp.pad(self.query_segment, pad),
        )

    def with_layout(self, layout: EntryLayout) -> Visibility:
        """**Arguments:** another ``layout`` of the same entries (e.g. padded with empty slots).

        **Returns:** the visibility over it."""
        return self._replace(layout=layout)

    def tile(self, start: Int[Array, ""] | int, width: int) -> Bool[Array, "batch seq {width}"]:
        """**Arguments:** the first entry slot ``start`` and the number of slots ``width``
        (within the layout).

        **Returns:** bool ``[B, S, width]``: which of slots ``start .. start + width`` each
        query sees."""
        end = take(self.layout.end, start, width)
        tile = EntryLayout(end, take(self.layout.segment, start, width), end >= 0)
        return entry_visibility(self.query_index, self.query_segment, tile)

    def slots(self) -> Int[Array, "batch seq n"]:
        """**Returns:** int32 ``[B, S, T]``: each query's own entry slots in increasing order,
        ``-1`` where it does not see one (every slot is a query's own here)."""
        t = self.layout.end.shape[1]
        return jnp.where(self.mask(), jnp.arange(t, dtype=jnp.int32), -1)


def take(x: Array, start: Int[Array, ""] | int, size: int) -> Array:
    """Rows ``start .. start + size`` of ``x`` along axis 1."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
