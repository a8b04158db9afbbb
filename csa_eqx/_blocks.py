"""Query and key blocks shared by the streaming selection and the streaming KL loss."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from ._layout import EntryLayout, take
from ._tiles import block_starts

__all__ = ["block_starts", "key_block_ranges", "padded_keys", "take"]

_BIG = jnp.iinfo(jnp.int32).max


def key_block_ranges(
    query_index: Array, query_segment: Array, layout: EntryLayout, qb: int, kb: int
) -> tuple[Array, Array]:
    """Per query block, the range ``[lo, hi)`` of key blocks that may hold a visible entry.

    A key block is needed when, for some batch row, its earliest valid entry closes at or
    before the block's last query and its segment range overlaps the queries' segments.
    """
    s, t = query_index.shape[1], layout.end.shape[1]
    rows = block_starts(s, qb)[:, None] + jnp.arange(qb)
    slots = block_starts(t, kb)[:, None] + jnp.arange(kb)
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


def padded_keys(keys: Array, layout: EntryLayout, width: int) -> tuple[Array, EntryLayout]:
    """Keys and layout padded with invalid entries to a multiple of ``width`` slots."""
    pad = -keys.shape[1] % width
    if not pad:
        return keys, layout
    keys = jnp.pad(keys, ((0, 0), (0, pad), (0, 0)))
    end = jnp.pad(layout.end, ((0, 0), (0, pad)), constant_values=-1)
    segment = jnp.pad(layout.segment, ((0, 0), (0, pad)), constant_values=-1)
    return keys, EntryLayout(end, segment, jnp.pad(layout.has_prior, ((0, 0), (0, pad))))
