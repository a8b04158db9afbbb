"""``ExpandedAttention``: DeepSeek-V3.2's prefill attention (its ``MLA.forward`` with a mask), the
kernel ``AutoAttention`` runs for MLA under numerics that follow it (``LatentUp.expanded``:
``DeepSeekInference``). Each head's keys ``[k_nope ; k_rope]`` and values are multiplied out of
the cached latent through the up-projection (the numerics' ``linear``: DeepSeek's FP8 product),
then the scores, the scaled scores, the softmax and ``P·V`` are each rounded to the activations'
dtype (bf16), queries in blocks.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from .._backend import backend_tiles
from .._layout import Visibility
from .._numerics.base import EXACT
from .._ops import round_to
from .._tiles import TileSizes, map_row_blocks, power_of_two_block
from .base import AbstractAttentionKernel, LatentUp
from .reads import Reads, picked_mask

__all__ = ["ExpandedAttention", "expanded_query_block"]


def expanded_query_block(batch: int, heads: int, entries: int, elements: int = 1 << 24) -> int:
    """The query block of an attention whose keys and values are expanded per head
    (``[B, block, H, T]`` scores and masks per block).

    **Arguments:** the queries' ``batch`` and ``heads``, the ``entries`` each query may read and
    the block's budget of ``elements`` (``TileSizes.attention_elements``).

    **Returns:** the query block, a power of two >= 1.
    """
    return power_of_two_block(batch, entries * (heads + 1), elements)


class ExpandedAttention(AbstractAttentionKernel):
    """DeepSeek's bf16 prefill arithmetic (module docstring) over keys and values expanded per
    head: MLA's (``latent``) or, through ``attend``, keys shared by the heads. It reads dense
    entries (masked to their visibility and picks) or one set of gathered rows (V3.2's picks),
    without sinks; a query that sees a non-finite key or value (or whose own query is) returns
    NaN, one that sees nothing zeros. **Arguments:** none."""

    def query_block_for(self, batch: int, heads: int, reads: Reads, tiles: TileSizes) -> int:
        entries = _table(reads)[0].shape[1]
        return expanded_query_block(batch, heads, entries, tiles.attention_elements)

    def attend(self, q, reads, sinks, scale, *, return_lse=False, query_block, numerics=None):
        if sinks is not None:
            raise ValueError("ExpandedAttention (DeepSeek's V3.2 prefill) takes no sinks")
        keys, values, mask_rows, mask = _table(reads)
        heads = q.shape[2]
        k = jnp.broadcast_to(keys[:, :, None], (*keys.shape[:2], heads, keys.shape[-1]))
        v = jnp.broadcast_to(values[:, :, None], (*values.shape[:2], heads, values.shape[-1]))
        out = _expanded(q, k, v, mask_rows, mask, scale, query_block)
        return out if return_lse else out[0]

    def latent(
        self,
        q_nope,
        q_rope,
        reads,
        up: LatentUp,
        scale,
        *,
        return_lse=False,
        numerics=None,
        query_block=0,
        tiles=None,
    ):
        numerics = EXACT if numerics is None else numerics
        latents, _, mask_rows, mask = _table(reads)
        b, t = latents.shape[:2]
        lora, dt = latents.shape[-1] - q_rope.shape[-1], q_nope.dtype
        kv = numerics.linear(latents[..., :lora], up.weight)
        kv = kv.reshape(b, t, -1, up.nope_dim + up.value_dim)
        heads = kv.shape[2]
        rope = latents[:, :, None, lora:]
        k_rope = jnp.broadcast_to(rope, (b, t, heads, rope.shape[-1]))
        k = jnp.concatenate([kv[..., : up.nope_dim], k_rope.astype(dt)], axis=-1)
        v = kv[..., up.nope_dim :]
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        elements = backend_tiles(tiles).attention_elements
        block = query_block or expanded_query_block(b, heads, t, elements)
        out = _expanded(q, k, v, mask_rows, mask, scale, block)
        return out if return_lse else out[0]


def _table(reads: Reads) -> tuple:
    """The one table of keys ``reads`` holds and what masks each query's row of it:
    ``(keys [B, T, d], values [B, T, dv], per-row arrays, mask(*rows of a block) -> [B, Qb, T])``
    for dense entries (their visibility, within the picks) or one set of gathered rows (the
    rows each query names)."""
    if reads.band is None and reads.dense is not None and not reads.gathered:
        dense = reads.dense
        t = dense.keys.shape[1]
        values = dense.value_rows()
        values = dense.keys if values is None else values
        rows = (dense.query_index, dense.query_segment, dense.picks)

        def mask(index, segment, picks):
            seen = Visibility(index, segment, dense.layout).mask()
            return seen if picks is None else seen & picked_mask(picks, t)

        return dense.keys, values, rows, mask
    if reads.band is None and reads.dense is None and len(reads.gathered) == 1:
        (g,) = reads.gathered
        t = g.keys.shape[1]
        values = g.value_rows()
        values = g.keys if values is None else values
        return g.keys, values, (g.indices,), lambda indices: picked_mask(indices, t)
    raise ValueError(
        "ExpandedAttention reads dense entries or one set of gathered rows (V3.2's picks), "
        "not a sliding window or several key sets: use XlaAttention"
    )


def _expanded(q, k, v, mask_rows, mask, scale, query_block: int):
    """``(o [B, S, H, dv], lse [B, S, H])`` of queries ``q [B, S, H, d]`` over per-head keys
    ``k`` and values ``v`` ``[B, T, H, ...]``, masked per query block by ``mask`` of the block's
    ``mask_rows``, in DeepSeek's bf16 prefill arithmetic (module docstring)."""
    s, dt = q.shape[1], q.dtype
    bad = ~jnp.all(jnp.isfinite(k), axis=(2, 3)) | ~jnp.all(jnp.isfinite(v), axis=(2, 3))
    k, v = (jnp.where(bad[:, :, None, None], 0, a) for a in (k, v))
    q_bad = ~jnp.all(jnp.isfinite(q), axis=(2, 3))
    q = jnp.where(q_bad[:, :, None, None], 0, q)
    scale = jnp.float32(scale)

    def block(start: Array, rows):
        q, q_bad, *per_row = rows
        seen = mask(*per_row)
        logits = jnp.einsum("bshd,bthd->bsht", q, k, preferred_element_type=jnp.float32)
        logits = round_to(round_to(logits, dt).astype(jnp.float32) * scale, dt)
        logits = jnp.where(seen[:, :, None, :], logits.astype(jnp.float32), -jnp.inf)
        peak = jnp.max(logits, axis=-1)
        peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
        p = jnp.exp(logits - peak[..., None])
        denom = jnp.sum(p, axis=-1)
        weights = round_to(p / jnp.where(denom > 0, denom, 1.0)[..., None], dt)
        o = jnp.einsum("bsht,bthd->bshd", weights, v, preferred_element_type=jnp.float32)
        poisoned = q_bad | jnp.any(seen & bad[:, None, :], axis=-1)
        o = round_to(jnp.where(poisoned[:, :, None, None], jnp.nan, o), dt)
        return o, jnp.where(poisoned[..., None], jnp.nan, peak + jnp.log(denom))

    return map_row_blocks(block, (q, q_bad, *mask_rows), min(query_block, max(s, 1)))
