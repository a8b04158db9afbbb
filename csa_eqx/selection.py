"""Visibility of compressed entries and exact top-k selection with a ``-1`` sentinel.

Ties go to the lower index everywhere. XLA's TopK orders ``-0.0`` below ``+0.0``, and ReLU-based
scores produce both, so scores are canonicalised (all zeros made ``+0.0``) before sorting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .compressor import EntryLayout
from .indexer import indexer_scores

__all__ = ["entry_visibility", "select_topk", "canonical_scores", "select_entries"]


def entry_visibility(
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
) -> Bool[Array, "batch seq slots"]:
    """Entry ``j`` is visible to query ``t`` iff its window closed at or before ``t`` in ``t``'s
    segment (``w < (t + 1) // m`` without packing)."""
    end = layout.end[:, None, :]
    return (
        (end >= 0)
        & (end <= query_index[:, :, None])
        & (layout.segment[:, None, :] == query_segment[:, :, None])
    )


def canonical_scores(scores: Array) -> Array:
    """Map ``-0.0`` to ``+0.0`` so that equal scores tie (XLA sorts by total order)."""
    return jnp.where(scores == 0, jnp.zeros_like(scores), scores)


def select_topk(
    scores: Float[Array, "batch seq entries"],
    visible: Bool[Array, "batch seq entries"],
    k: int,
) -> Int[Array, "batch seq {k}"]:
    """Indices of the ``k`` best visible entries per query, best first, ties to the lower index.

    Picks beyond the visible count are ``-1``; when ``k`` exceeds the number of entries the
    result is padded with ``-1`` so its shape is always ``[..., k]``.
    """
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    n = scores.shape[-1]
    masked = jnp.where(visible, canonical_scores(scores.astype(jnp.float32)), -jnp.inf)
    _, idx = jax.lax.top_k(masked, min(k, n))
    idx = jnp.where(jnp.take_along_axis(visible, idx, axis=-1), idx, -1).astype(jnp.int32)
    if k > n:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, k - n)], constant_values=-1)
    return idx


def select_entries(
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
    """The indexer's selection: score, mask to visible entries, exact top-k with ``-1``.

    This is the whole per-query-row selection stage; it is what row sharding replaces. V3.2
    selects raw tokens with ``entry_layout(segment_ids, 1)``. When the dense score tensor would
    be large, or ``key_block > 0`` asks for it, the same selection is computed by
    ``csa_eqx.streaming.stream_select_entries`` (tiles of ``query_block x key_block``,
    0 = automatic) without materialising any score matrix.
    """
    from .streaming import prefers_streaming, stream_select_entries  # streaming imports us

    b, s, h, _ = q.shape
    if key_block or prefers_streaming(b, s, keys.shape[1], head_chunk or h):
        return stream_select_entries(
            q,
            weights,
            keys,
            query_index,
            query_segment,
            layout,
            k,
            head_chunk=head_chunk,
            key_block=key_block,
            query_block=query_block,
        )
    scores = indexer_scores(q, weights, keys, head_chunk=head_chunk)
    return select_topk(scores, entry_visibility(query_index, query_segment, layout), k)
