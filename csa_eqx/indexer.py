"""Lightning-indexer scoring: ``I[t,s] = d_I^-1/2 · Σ_h w[t,h] · ReLU(q[t,h] · k[s])``.

Scores are float32. With ``head_chunk > 0`` the heads are processed ``head_chunk`` at a time in a
``lax.scan`` whose body is rematerialised, so the ``[B, H, S, T]`` per-head tensor never exists in
the forward or the backward pass; only the float32 ``[B, S, T]`` accumulator does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["indexer_scores", "split_head_chunks"]


def _score_heads(q: Array, w: Array, k: Array) -> Array:
    acc = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=acc)
    return jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), w.astype(acc))


def split_head_chunks(x: Array, chunk: int) -> Array:
    """``[B, S, H, ...] -> [H/chunk, B, S, chunk, ...]`` (scan-major head chunks)."""
    b, s, h = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, s, h // chunk, chunk, *x.shape[3:]), 2, 0)


def indexer_scores(
    q: Float[Array, "batch seq heads dim"],
    weights: Float[Array, "batch seq heads"],
    keys: Float[Array, "batch entries dim"],
    *,
    head_chunk: int = 0,
) -> Float[Array, "batch seq entries"]:
    """Float32 indexer scores of every query against every key (no masking).

    ``weights`` are the per-head weights *including* the ``H^-1/2`` factor; the ``d^-1/2``
    factor is applied here. ``head_chunk`` must divide the head count (0 = all heads at once).
    """
    h, d = q.shape[2], q.shape[3]
    if head_chunk and h % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {h} indexer heads")
    w = weights.astype(jnp.float32) * d**-0.5
    if not head_chunk:
        return _score_heads(q, w, keys)

    def body(acc, qw):
        return acc + _score_heads(qw[0], qw[1], keys), None

    acc = jnp.zeros((q.shape[0], q.shape[1], keys.shape[1]), jnp.float32)
    acc, _ = jax.lax.scan(
        jax.checkpoint(body),
        acc,
        (split_head_chunks(q, head_chunk), split_head_chunks(w, head_chunk)),
    )
    return acc
