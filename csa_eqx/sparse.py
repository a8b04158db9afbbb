"""Gather-based sparse attention with an optional per-head sink (no dense ``[S, T]`` mask).

Each query attends to the keys named by its own index list (``-1`` = no key). The sink adds
``exp(s_h)`` to the softmax denominator only. A query with no valid key returns zeros.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["sparse_attention", "gather_keys"]


def gather_keys(kv: Float[Array, "batch keys dim"], indices: Int[Array, "batch seq k"]) -> Array:
    """``kv[b, indices[b, s, i]]`` as ``[B, S, k, dim]`` (``-1`` reads row 0; mask it)."""
    b, s, k = indices.shape
    flat = jnp.clip(indices, 0, kv.shape[1] - 1).reshape(b, s * k)
    return jnp.take_along_axis(kv, flat[..., None], axis=1).reshape(b, s, k, kv.shape[-1])


def attention_logits(q: Array, keys: Array, indices: Array, scale: float) -> Array:
    """Masked float32 logits ``[B, S, H, k]`` of each query head against its gathered keys."""
    logits = jnp.einsum("bshd,bskd->bshk", q, keys, preferred_element_type=jnp.float32) * scale
    return jnp.where((indices >= 0)[:, :, None, :], logits, -jnp.inf)


def sparse_attention(
    q: Float[Array, "batch seq heads dim"],
    kv: Float[Array, "batch keys dim"],
    indices: Int[Array, "batch seq k"],
    sinks: Float[Array, " heads"] | None,
    scale: float,
    values: Float[Array, "batch keys vdim"] | None = None,
) -> Float[Array, "batch seq heads vdim"]:
    """Softmax attention of each query over its selected keys (shared across heads).

    ``values`` defaults to ``kv`` (V4's key = value); pass it for MLA's separate values.
    """
    keys = gather_keys(kv, indices)
    vals = keys if values is None else gather_keys(values, indices)
    logits = attention_logits(q, keys, indices, scale)
    peak = jnp.max(logits, axis=-1)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32), peak.shape)
        peak = jnp.maximum(peak, sink)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - peak)
    probs = p / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.einsum(
        "bshk,bskd->bshd", probs.astype(vals.dtype), vals, preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype)
