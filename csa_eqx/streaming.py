"""Streaming indexer selection: exact top-k over key blocks, no score matrix.

Queries are processed in blocks. For each query block a loop visits only the key tiles that
can hold a visible entry (a dynamic trip count, so fully invisible tiles cost nothing under
``jit``) and scores each ``[B, Qb, Kb]`` tile with :func:`csa_eqx.indexer_scores` (head-chunked
when asked) into a row buffer of ``topk_block`` entries; each buffer gets one top-k, merged
into the running top-k of each query. The buffer holds all entries unless ``[B, Qb, T]`` would
pass ~64 MiB, so at usual sizes there is one top-k per query row and no merge at all. Neither
``[B, H, S, T]`` nor ``[B, S, T]`` is ever formed: memory is linear in the sequence length.
``select_projected_entries`` also projects the indexer queries one query block at a time, so
the ``[B, S, H, d]`` queries (the largest remaining tensor at V4 sizes) never exist either.

Given the same scores this is exactly :func:`csa_eqx.select_topk`: buffers are merged in
increasing order with the running list first, so ties keep the lower index and picks stay in
increasing index order; invisible picks become ``-1``. The selection is integer-valued, so
its inputs are ``stop_gradient``-ed and the loops never need differentiating.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .compressor import EntryLayout
from .indexer import indexer_scores
from .selection import entry_visibility, exact_topk

__all__ = [
    "stream_select_entries",
    "stream_select_projected",
    "select_projected_entries",
    "streaming_block_sizes",
    "topk_block_size",
    "prefers_streaming",
]

_BIG = jnp.iinfo(jnp.int32).max


class _Tiles(NamedTuple):
    elements: int  # largest per-tile tensor [B, Qb, heads at once, Kb], and row buffer
    key_block: int
    max_query_block: int


# CPU: tiles that stay in cache (64 MiB float32 at most). Accelerators: every loop iteration
# costs launches and a predicate round trip, so tiles are 4x larger and loops 4-16x shorter
# (measured on an H200: 128-entry tiles made the selection ~1.3x slower than 512).
_CPU_TILES = _Tiles(1 << 24, 128, 256)
_ACCELERATOR_TILES = _Tiles(1 << 26, 512, 1024)


def _tiles() -> _Tiles:
    """Automatic tile sizes for the backend the computation is traced for."""
    return _CPU_TILES if jax.default_backend() == "cpu" else _ACCELERATOR_TILES


def prefers_streaming(batch: int, seq: int, entries: int, heads_at_once: int) -> bool:
    """Whether the dense path's largest score tensor ``[B, S, heads, T]`` would be large
    (more than one automatic tile: 2^24 elements on CPU, 2^26 on accelerators)."""
    return batch * seq * entries * max(heads_at_once, 1) > _tiles().elements


def streaming_block_sizes(
    batch: int, seq: int, entries: int, heads_at_once: int, key_block: int = 0, query_block: int = 0
) -> tuple[int, int]:
    """``(query_block, key_block)``: given sizes (0 = automatic), clipped to the sequence.

    Automatic: key tiles of 128 entries on CPU (512 on accelerators) and the largest power-of-two
    query block (up to 256 rows on CPU, 1024 on accelerators) whose ``[B, Qb, heads, Kb]``
    tile stays within 2^24 elements (2^26 on accelerators).
    """
    tiles = _tiles()
    kb = max(1, min(key_block or tiles.key_block, entries))
    qb = query_block
    if not qb:
        budget = max(tiles.elements // (batch * max(heads_at_once, 1) * kb), 1)
        qb = min(max(1 << (budget.bit_length() - 1), 16), tiles.max_query_block)
    return max(1, min(qb, seq)), kb


def topk_block_size(
    batch: int, query_block: int, entries: int, key_block: int, topk_block: int = 0
) -> int:
    """Entries per top-k pass, a multiple of ``key_block``: ``topk_block`` rounded up, or
    (0 = automatic) all entries when one ``[B, Qb, T]`` score buffer fits one tile's budget
    (see ``streaming_block_sizes``), else as many key tiles as do."""
    tiles = -(-entries // key_block)
    per_pass = (
        -(-topk_block // key_block)
        if topk_block
        else _tiles().elements // (batch * query_block * key_block)
    )
    return max(1, min(per_pass, tiles)) * key_block


def _block_starts(n: int, block: int) -> Array:
    """Start of each block; the last one is pulled back to end at ``n`` (no padding copies)."""
    return jnp.minimum(jnp.arange(-(-n // block), dtype=jnp.int32) * block, n - block)


def _key_block_ranges(
    query_index: Array, query_segment: Array, layout: EntryLayout, qb: int, kb: int
) -> tuple[Array, Array]:
    """Per query block, the range ``[lo, hi)`` of key blocks that may hold a visible entry.

    A key block is needed when, for some batch row, its earliest valid entry closes at or
    before the block's last query and its segment range overlaps the queries' segments.
    """
    s, t = query_index.shape[1], layout.end.shape[1]
    rows = _block_starts(s, qb)[:, None] + jnp.arange(qb)
    slots = _block_starts(t, kb)[:, None] + jnp.arange(kb)
    qi, qs = query_index[:, rows], query_segment[:, rows]  # [B, nq, qb]
    end, seg = layout.end[:, slots], layout.segment[:, slots]  # [B, nk, kb]
    valid = end >= 0
    first_end = jnp.min(jnp.where(valid, end, _BIG), axis=-1)
    seg_lo = jnp.min(jnp.where(valid, seg, _BIG), axis=-1)
    seg_hi = jnp.max(jnp.where(valid, seg, -_BIG), axis=-1)
    need = (
        (first_end[:, None, :] <= jnp.max(qi, axis=-1)[:, :, None])
        & (seg_hi[:, None, :] >= jnp.min(qs, axis=-1)[:, :, None])
        & (seg_lo[:, None, :] <= jnp.max(qs, axis=-1)[:, :, None])
    ).any(axis=0)  # [nq, nk]
    blocks = jnp.arange(need.shape[1], dtype=jnp.int32)
    hi = jnp.max(jnp.where(need, blocks + 1, 0), axis=-1)
    lo = jnp.minimum(jnp.min(jnp.where(need, blocks, need.shape[1]), axis=-1), hi)
    return lo, hi


def _padded_keys(keys: Array, layout: EntryLayout, width: int) -> tuple[Array, EntryLayout]:
    """Keys and layout padded with invalid entries to a multiple of ``width`` slots."""
    pad = -keys.shape[1] % width
    if not pad:
        return keys, layout
    keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0)))
    end = jnp.pad(layout.end, ((0, 0), (0, pad)), constant_values=-1)
    segment = jnp.pad(layout.segment, ((0, 0), (0, pad)), constant_values=-1)
    return keys, EntryLayout(end, segment, jnp.pad(layout.has_prior, ((0, 0), (0, pad))))


def _top_of(scores: Array, visible: Array, offset: Array, k: int) -> tuple[Array, Array]:
    """``(values, slots)`` of the ``k`` best visible scores of a row buffer whose first entry
    is slot ``offset``, as ``exact_topk`` (``(-inf, -1)`` fill)."""
    val, pos = exact_topk(scores, visible, k)
    return val, jnp.where(pos >= 0, pos + offset, -1)


def _merge(running: tuple[Array, Array], new: tuple[Array, Array], k: int):
    """Top-k of two candidate lists; the running list holds the lower slots and comes first,
    so ties keep it and the slots stay in increasing order."""
    idx = jnp.concatenate([running[1], new[1]], axis=-1)
    val, pos = exact_topk(jnp.concatenate([running[0], new[0]], axis=-1), idx >= 0, k)
    return val, jnp.where(pos >= 0, jnp.take_along_axis(idx, jnp.maximum(pos, 0), -1), -1)


def stream_select_entries(
    q: Float[Array, "batch seq heads dim"],
    weights: Float[Array, "batch seq heads"],
    keys: Float[Array, "batch slots dim"],
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
    k: int,
    *,
    head_chunk: int = 0,
    key_block: int = 0,
    query_block: int = 0,
    topk_block: int = 0,
) -> Int[Array, "batch seq {k}"]:
    """Exact indexer top-k (as ``select_topk`` of the dense scores) without a score matrix.

    Arguments:
        q, weights, keys: indexer queries, head weights (with ``H^-1/2``) and entry keys.
        query_index, query_segment, layout: visibility, as in ``entry_visibility``; valid
            ``layout.end`` values must be nondecreasing for blocks to be skipped.
        k: picks per query; padded with ``-1`` beyond the visible count.
        head_chunk: heads scored at once inside a tile (0 = all).
        key_block, query_block: entries and queries per tile (0 = automatic).
        topk_block: entries scored into one row buffer per top-k (0 = automatic, see
            ``topk_block_size``); more entries are merged into a running top-k.
    """
    return stream_select_projected(
        lambda q, w: (q, w),
        (q, weights),
        keys,
        query_index,
        query_segment,
        layout,
        k,
        head_chunk=head_chunk,
        key_block=key_block,
        query_block=query_block,
        topk_block=topk_block,
    )


def select_projected_entries(
    project: Callable[..., tuple[Array, Array]],
    rows: tuple[Array, ...],
    keys: Float[Array, "batch slots dim"],
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
    k: int,
    *,
    head_chunk: int = 0,
    key_block: int = 0,
    query_block: int = 0,
) -> Int[Array, "batch seq {k}"]:
    """``select_entries(*project(*rows), keys, ...)``, streaming from the rows when it would.

    ``project`` maps per-token inputs (``rows``, each ``[B, S, ...]``) to the indexer queries
    ``[B, S, H, d]`` and head weights ``[B, S, H]``; it must act row by row. On the streaming
    path (same rule as ``select_entries``) it runs one query block at a time, so the full
    ``[B, S, H, d]`` queries never exist either.
    """
    from .selection import select_entries

    b, s, h, _ = jax.eval_shape(project, *rows)[0].shape
    tiles = dict(head_chunk=head_chunk, key_block=key_block, query_block=query_block)
    if key_block or prefers_streaming(b, s, keys.shape[1], head_chunk or h):
        return stream_select_projected(
            project, rows, keys, query_index, query_segment, layout, k, **tiles
        )
    return select_entries(*project(*rows), keys, query_index, query_segment, layout, k, **tiles)


def stream_select_projected(
    project: Callable[..., tuple[Array, Array]],
    rows: tuple[Array, ...],
    keys: Float[Array, "batch slots dim"],
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
    k: int,
    *,
    head_chunk: int = 0,
    key_block: int = 0,
    query_block: int = 0,
    topk_block: int = 0,
) -> Int[Array, "batch seq {k}"]:
    """``stream_select_entries`` with queries and weights computed per query block by
    ``project(*row_block)`` (see ``select_projected_entries``)."""
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    b, s, h, _ = jax.eval_shape(project, *rows)[0].shape
    t = keys.shape[1]
    if t == 0 or s == 0:
        return jnp.full((b, s, k), -1, jnp.int32)
    qb, kb = streaming_block_sizes(b, s, t, head_chunk or h, key_block, query_block)
    group = topk_block_size(b, qb, t, kb, topk_block)
    # Integer output: nothing here is differentiated (closed-over parameters included).
    block = [jax.ShapeDtypeStruct((r.shape[0], qb, *r.shape[2:]), r.dtype) for r in rows]
    project, consts = jax.closure_convert(project, *block)
    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))
    keys, layout = _padded_keys(keys, layout, group)
    tiles_per_group, last_group = group // kb, keys.shape[1] // group - 1
    lo, hi = _key_block_ranges(query_index, query_segment, layout, qb, kb)
    q_starts = _block_starts(s, qb)

    def take(x: Array, start: Array, size: int) -> Array:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)

    def query_block_body(i, out):
        r0 = q_starts[i]
        qi, qs = take(query_index, r0, qb), take(query_segment, r0, qb)
        qx, wx = project(*(take(r, r0, qb) for r in rows), *consts)

        def group_top(g):
            """Score the needed key tiles of group ``g`` into one row buffer, then its top-k."""
            first = g * tiles_per_group

            def tile(j, buffer):
                scores = indexer_scores(qx, wx, take(keys, j * kb, kb), head_chunk=head_chunk)
                return jax.lax.dynamic_update_slice_in_dim(buffer, scores, (j - first) * kb, 2)

            tiles = (jnp.maximum(lo[i], first), jnp.minimum(hi[i], first + tiles_per_group))
            buffer = jax.lax.fori_loop(*tiles, tile, jnp.zeros((b, qb, group), jnp.float32))
            c0 = first * kb
            end = take(layout.end, c0, group)
            visible = entry_visibility(
                qi, qs, EntryLayout(end, take(layout.segment, c0, group), end >= 0)
            )
            return _top_of(buffer, visible, c0, k)

        # Groups before lo hold nothing visible; the first needed one starts the running list.
        g_lo, g_hi = lo[i] // tiles_per_group, -(-hi[i] // tiles_per_group)
        running = group_top(jnp.minimum(g_lo, last_group))
        running = jax.lax.fori_loop(
            g_lo + 1, g_hi, lambda g, r: _merge(r, group_top(g), k), running
        )
        return jax.lax.dynamic_update_slice_in_dim(out, running[1], r0, axis=1)

    out = jnp.full((b, s, k), -1, jnp.int32)
    return jax.lax.fori_loop(0, q_starts.shape[0], query_block_body, out)
