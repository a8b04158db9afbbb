"""Streaming indexer selection: exact top-k over key blocks, no score matrix.

Queries are processed in blocks. For each query block a loop visits only the key blocks that
can hold a visible entry (a dynamic trip count, so fully invisible blocks cost nothing under
``jit``), scores one ``[B, Qb, Kb]`` tile with :func:`csa_eqx.indexer_scores` (head-chunked when
asked), takes the tile's top-k and merges it into the running top-k of each query. Neither
``[B, H, S, T]`` nor ``[B, S, T]`` is ever formed: memory is linear in the sequence length.
``select_projected_entries`` also projects the indexer queries one query block at a time, so
the ``[B, S, H, d]`` queries (the largest remaining tensor at V4 sizes) never exist either.

Given the same scores this is exactly :func:`csa_eqx.select_topk`: blocks are merged in
increasing order with the running list first, so ties keep the lower index; invisible picks
become ``-1``. The selection is integer-valued, so its inputs are ``stop_gradient``-ed and the
loops never need differentiating.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .compressor import EntryLayout
from .indexer import indexer_scores
from .selection import canonical_scores, entry_visibility, select_topk

__all__ = [
    "stream_select_entries",
    "stream_select_projected",
    "select_projected_entries",
    "streaming_block_sizes",
    "prefers_streaming",
]

_TILE_ELEMENTS = 1 << 24  # largest per-tile tensor [B, Qb, heads at once, Kb] (64 MiB float32)
_KEY_BLOCK = 1024
_MAX_QUERY_BLOCK = 512
_BIG = jnp.iinfo(jnp.int32).max


def prefers_streaming(batch: int, seq: int, entries: int, heads_at_once: int) -> bool:
    """Whether the dense path's largest score tensor ``[B, S, heads, T]`` would be large."""
    return batch * seq * entries * max(heads_at_once, 1) > _TILE_ELEMENTS


def streaming_block_sizes(
    batch: int, seq: int, entries: int, heads_at_once: int, key_block: int = 0, query_block: int = 0
) -> tuple[int, int]:
    """``(query_block, key_block)``: given sizes (0 = automatic), clipped to the sequence.

    The automatic query block keeps one ``[B, Qb, heads, Kb]`` tile near 64 MiB of float32.
    """
    kb = max(1, min(key_block or _KEY_BLOCK, entries))
    qb = query_block
    if not qb:
        budget = max(_TILE_ELEMENTS // (batch * max(heads_at_once, 1) * kb), 1)
        qb = min(max(1 << (budget.bit_length() - 1), 16), _MAX_QUERY_BLOCK)
    return max(1, min(qb, seq)), kb


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


def _merge_tile(
    running: tuple[Array, Array], scores: Array, visible: Array, offset: Array, k: int
) -> tuple[Array, Array]:
    """Merge one tile's top-k into the running top-k (running first: ties keep lower index)."""
    run_val, run_idx = running
    idx = select_topk(scores, visible, min(k, scores.shape[-1]))
    picked = jnp.take_along_axis(canonical_scores(scores), jnp.maximum(idx, 0), axis=-1)
    val = jnp.where(idx >= 0, picked, -jnp.inf)
    idx = jnp.where(idx >= 0, idx + offset, -1)
    val, pos = jax.lax.top_k(jnp.concatenate([run_val, val], axis=-1), k)
    return val, jnp.take_along_axis(jnp.concatenate([run_idx, idx], axis=-1), pos, axis=-1)


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
) -> Int[Array, "batch seq {k}"]:
    """Exact indexer top-k (as ``select_topk`` of the dense scores) without a score matrix.

    Arguments:
        q, weights, keys: indexer queries, head weights (with ``H^-1/2``) and entry keys.
        query_index, query_segment, layout: visibility, as in ``entry_visibility``; valid
            ``layout.end`` values must be nondecreasing for blocks to be skipped.
        k: picks per query; padded with ``-1`` beyond the visible count.
        head_chunk: heads scored at once inside a tile (0 = all).
        key_block, query_block: entries and queries per tile (0 = automatic).
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
    # Integer output: nothing here is differentiated (closed-over parameters included).
    block = [jax.ShapeDtypeStruct((r.shape[0], qb, *r.shape[2:]), r.dtype) for r in rows]
    project, consts = jax.closure_convert(project, *block)
    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))
    lo, hi = _key_block_ranges(query_index, query_segment, layout, qb, kb)
    q_starts, k_starts = _block_starts(s, qb), _block_starts(t, kb)

    def take(x: Array, start: Array, size: int) -> Array:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)

    def query_block_body(i, out):
        r0 = q_starts[i]
        qi, qs = take(query_index, r0, qb), take(query_segment, r0, qb)
        qx, wx = project(*(take(r, r0, qb) for r in rows), *consts)

        def key_block_body(j, running):
            c0 = k_starts[j]
            end = take(layout.end, c0, kb)
            tile = EntryLayout(end, take(layout.segment, c0, kb), end >= 0)
            # A pulled-back last block re-reads entries already merged: hide them.
            fresh = c0 + jnp.arange(kb) >= j * kb
            visible = entry_visibility(qi, qs, tile) & fresh
            scores = indexer_scores(qx, wx, take(keys, c0, kb), head_chunk=head_chunk)
            return _merge_tile(running, scores, visible, c0, k)

        running = (jnp.full((b, qb, k), -jnp.inf), jnp.full((b, qb, k), -1, jnp.int32))
        _, idx = jax.lax.fori_loop(lo[i], hi[i], key_block_body, running)
        return jax.lax.dynamic_update_slice_in_dim(out, idx, r0, axis=1)

    out = jnp.full((b, s, k), -1, jnp.int32)
    return jax.lax.fori_loop(0, q_starts.shape[0], query_block_body, out)
