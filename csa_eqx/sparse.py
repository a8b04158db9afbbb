"""Gather-based sparse attention with an optional per-head sink (no dense ``[S, T]`` mask).

Each query attends to the keys named by its own index list (``-1`` = no key). The sink adds
``exp(s_h)`` to the softmax denominator only. A query with no valid key returns zeros.

Keys that *every* query may see once visible (HCA's compressed entries, CSA's entries in the
dense warm-up) are better attended with a plain matmul than gathered per query: pass them as
``dense=DenseKeys(...)``; their visibility is computed per query block from the entry layout,
and they share one softmax with the gathered keys. CSA's *selected* entries can go the same
way (``DenseKeys(picks=...)``, masked to each query's picks) while the entry count is a small
multiple of ``k``: a masked matmul over ``T`` entries is far cheaper than gathering ``k`` rows
per query, and its gradient needs no scatter-add (``prefers_masked_picks``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .compressor import EntryLayout
from .selection import entry_visibility

__all__ = [
    "sparse_attention",
    "gather_keys",
    "sparse_query_block",
    "DenseKeys",
    "prefers_masked_picks",
    "picked_mask",
]


class DenseKeys(NamedTuple):
    """Entries attended by matmul: ``keys [B, T, d]``, visible to query ``t`` per
    ``entry_visibility(query_index, query_segment, layout)``; ``values [B, T, vdim]`` default to
    the keys (V4) and are separate for MLA (V3.2). With ``picks [B, S, p]`` (distinct entry
    slots, ``-1`` = none) a query attends only to its visible picks."""

    keys: Float[Array, "batch entries dim"]
    layout: EntryLayout
    query_index: Int[Array, "batch seq"]
    query_segment: Int[Array, "batch seq"]
    values: Float[Array, "batch entries vdim"] | None = None
    picks: Int[Array, "batch seq picks"] | None = None


_MASKED_PICKS_RATIO = 4


def prefers_masked_picks(entries: int, picks: int) -> bool:
    """Whether ``picks`` of ``entries`` per query are cheaper as a masked matmul over all
    entries (``DenseKeys(picks=...)``) than gathered: up to 4 entries per pick."""
    return entries <= _MASKED_PICKS_RATIO * picks


def picked_mask(
    picks: Int[Array, "batch seq p"], entries: int
) -> Bool[Array, "batch seq {entries}"]:
    """``mask[b, s, j]``: entry ``j`` is among ``picks[b, s]`` (``-1`` picks nothing).

    The mask's rows are sharded like the picks' rows (needed under an Explicit mesh)."""
    b, s, _ = picks.shape
    slot = jnp.where(picks >= 0, picks, entries)  # out of range: dropped
    rows = (jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], slot)
    mesh, spec = jax.typeof(picks).sharding.mesh, jax.typeof(picks).sharding.spec
    out = None if mesh.empty else NamedSharding(mesh, P(*spec[:2], None))
    return jnp.zeros((b, s, entries), bool).at[rows].set(True, mode="drop", out_sharding=out)


_BLOCK_ELEMENTS = 1 << 24


def gather_keys(kv: Float[Array, "batch keys dim"], indices: Int[Array, "batch seq k"]) -> Array:
    """``kv[b, indices[b, s, i]]`` as ``[B, S, k, dim]`` (``-1`` reads row 0; mask it)."""
    b, s, k = indices.shape
    flat = jnp.clip(indices, 0, kv.shape[1] - 1).reshape(b, s * k)
    return jnp.take_along_axis(kv, flat[..., None], axis=1).reshape(b, s, k, kv.shape[-1])


def attention_logits(q: Array, keys: Array, indices: Array, scale: float) -> Array:
    """Masked float32 logits ``[B, S, H, k]`` of each query head against its gathered keys."""
    acc = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bshd,bskd->bshk", q, keys, preferred_element_type=acc) * scale
    return jnp.where((indices >= 0)[:, :, None, :], logits, -jnp.inf)


def sparse_query_block(batch: int, heads: int, dim: int, k: int, entries: int = 0) -> int:
    """Automatic query block: keeps the gathered ``[B, Qb, k, dim]`` keys (and values) plus
    the ``[B, Qb, H, k]`` logits of one block, and the ``[B, Qb, H, entries]`` logits and mask
    of entries attended by matmul, near 64 MiB of float32."""
    per_row = k * (dim + heads) + entries * (heads + 1)
    rows = max(_BLOCK_ELEMENTS // max(batch * per_row, 1), 1)
    return 1 << (rows.bit_length() - 1)


def sparse_attention(
    q: Float[Array, "batch seq heads dim"],
    kv: Float[Array, "batch keys dim"],
    indices: Int[Array, "batch seq k"],
    sinks: Float[Array, " heads"] | None,
    scale: float,
    values: Float[Array, "batch keys vdim"] | None = None,
    return_lse: bool = False,
    *,
    query_block: int = 0,
    dense: DenseKeys | None = None,
) -> (
    Float[Array, "batch seq heads vdim"]
    | tuple[Float[Array, "batch seq heads vdim"], Float[Array, "batch seq heads"]]
):
    """Softmax attention of each query over its selected keys (shared across heads).

    ``values`` defaults to ``kv`` (V4's key = value); pass it for MLA's separate values.
    ``return_lse=True`` also returns each head's float32 log-normaliser (log of the softmax
    denominator, sink included; ``-inf`` for a row with neither keys nor sink), which the
    indexer's KL target needs to rebuild the attention probabilities.

    Queries are processed ``query_block`` rows at a time (0 = automatic, see
    ``sparse_query_block``) in a ``lax.map`` with a rematerialised body, so the gathered
    ``[B, S, k, dim]`` keys never exist at once, in the forward or the backward pass.

    ``dense`` adds entries every query attends to (when visible) through a matmul, in the
    same softmax (their values: ``dense.values``, else the keys as in V4).
    """
    b, s, h, d = q.shape
    width = d if values is None else d + values.shape[-1]  # gathered keys (+ values) per pick
    entries = 0 if dense is None else dense.keys.shape[1]
    qb = query_block or sparse_query_block(b, h, width, indices.shape[-1], entries)
    if qb >= s:
        return _attend(q, kv, indices, sinks, scale, values, return_lse, dense)
    n = -(-s // qb)

    def blocks(x: Array, fill) -> Array:
        x = jnp.pad(x, [(0, 0), (0, n * qb - s)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(b, n, qb, *x.shape[2:]), 1, 0)

    def unblocks(y: Array) -> Array:
        return jnp.moveaxis(y, 0, 1).reshape(b, n * qb, *y.shape[3:])[:, :s]

    def body(qi: tuple[Array, ...]):
        block_dense = None
        if dense is not None:
            picks = qi[4] if len(qi) > 4 else None
            block_dense = dense._replace(query_index=qi[2], query_segment=qi[3], picks=picks)
        return _attend(qi[0], kv, qi[1], sinks, scale, values, return_lse, block_dense)

    rows = (q, indices)
    if dense is not None:
        rows += (dense.query_index, dense.query_segment)
        rows += () if dense.picks is None else (dense.picks,)
    fills = (0, -1, -1, -1, -1)  # padded query rows see no key
    out = jax.lax.map(
        jax.checkpoint(body),
        tuple(blocks(x, f) for x, f in zip(rows, fills[: len(rows)], strict=True)),
    )
    return jax.tree.map(unblocks, out)


def _attend(q, kv, indices, sinks, scale, values, return_lse, dense=None):
    """Unblocked sparse attention (one block of queries; see ``sparse_attention``)."""
    keys = gather_keys(kv, indices)
    vals = keys if values is None else gather_keys(values, indices)
    logits = attention_logits(q, keys, indices, scale)
    k = logits.shape[-1]
    if dense is not None:
        dense_logits = (
            jnp.einsum(
                "bshd,btd->bsht", q, dense.keys.astype(q.dtype), preferred_element_type=logits.dtype
            )
            * scale
        )
        visible = entry_visibility(dense.query_index, dense.query_segment, dense.layout)
        if dense.picks is not None:
            visible &= picked_mask(dense.picks, dense.keys.shape[1])
        dense_logits = jnp.where(visible[:, :, None, :], dense_logits, -jnp.inf)
        logits = jnp.concatenate([logits, dense_logits], axis=-1)
    peak = jnp.max(logits, axis=-1)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(peak.dtype), peak.shape)
        peak = jnp.maximum(peak, sink)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - peak)
    probs = p / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.einsum(
        "bshk,bskd->bshd",
        probs[..., :k].astype(vals.dtype),
        vals,
        preferred_element_type=probs.dtype,
    )
    if dense is not None:
        dense_vals = dense.keys if dense.values is None else dense.values
        out = out + jnp.einsum(
            "bsht,btd->bshd",
            probs[..., k:].astype(vals.dtype),
            dense_vals.astype(vals.dtype),
            preferred_element_type=probs.dtype,
        )
    if return_lse:
        return out.astype(q.dtype), peak + jnp.log(denom)
    return out.astype(q.dtype)
