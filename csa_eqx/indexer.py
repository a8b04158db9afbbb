"""Lightning-indexer scoring: ``I[t,s] = d_I^-1/2 · Σ_h w[t,h] · ReLU(q[t,h] · k[s])``.

Scores are float32. With ``head_chunk > 0`` the heads are processed ``head_chunk`` at a time in a
``lax.scan`` whose body is rematerialised, so the ``[B, H, S, T]`` per-head tensor never exists in
the forward or the backward pass; only the float32 ``[B, S, T]`` accumulator does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["indexer_scores", "sum_head_chunks"]


def _score_heads(q: Array, w: Array, k: Array, score_dtype=None) -> Array:
    acc = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=acc)
    if score_dtype is None:
        return jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), w.astype(acc))
    # as a bf16 einsum does: each head's logit and weighted logit rounded, the sum in float32
    rounded = jax.nn.relu(logits.astype(score_dtype).astype(acc))
    terms = (rounded * w.astype(score_dtype).astype(acc)[:, :, :, None]).astype(score_dtype)
    return jnp.sum(terms.astype(acc), axis=2)


def sum_head_chunks(fn: Callable[..., Array], head_chunk: int, shape, *per_head: Array) -> Array:
    """``Σ_c fn(*chunk_c)`` over chunks of ``head_chunk`` heads (axis 2 of every ``per_head``
    array), float32, in a ``lax.scan`` with a rematerialised body.

    Heads are sliced in place: a head-major copy of the queries can be as large as the score
    tensor itself at V4 sizes, which would defeat the point of chunking.
    """
    heads = per_head[0].shape[2]
    if heads % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {heads} heads")

    def body(acc, i):
        chunk = (jax.lax.dynamic_slice_in_dim(a, i * head_chunk, head_chunk, 2) for a in per_head)
        return acc + fn(*chunk), None

    init = jnp.zeros(shape, jnp.float32)
    return jax.lax.scan(jax.checkpoint(body), init, jnp.arange(heads // head_chunk))[0]


def indexer_scores(
    q: Float[Array, "batch seq heads dim"],
    weights: Float[Array, "batch seq heads"],
    keys: Float[Array, "batch entries dim"],
    *,
    head_chunk: int = 0,
    score_dtype=None,
) -> Float[Array, "batch seq entries"]:
    """Float32 indexer scores of every query against every key, no masking
    (docs/concepts.md, "The lightning indexer").

    Arguments:
        q: indexer queries ``[B, S, H, d]``.
        weights: per-head weights ``[B, S, H]`` *including* the ``H^-1/2`` factor; the
            ``d^-1/2`` factor is applied here.
        keys: ``[B, T, d]``, one per entry (shared by all heads).
        head_chunk: heads scored at once in a rematerialised scan (0 = all); must divide ``H``.
        score_dtype: ``None`` (float32 throughout), or a dtype such as ``"bfloat16"``: each
            head's logit, its weight ``w·d^-1/2`` and their product are rounded to it, the head
            sum is taken in float32 and rounded to it (DeepSeek-V4's bf16 scorer).

    Returns:
        float32 ``[B, S, T]``: ``d^-1/2 Σ_h w[t,h] ReLU(q[t,h] · k[s])``.
    """
    h, d = q.shape[2], q.shape[3]
    if head_chunk and h % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {h} indexer heads")
    w = weights.astype(jnp.float32) * d**-0.5

    def score(q, w):
        return _score_heads(q, w, keys, score_dtype)

    if not head_chunk:
        scores = score(q, w)
    else:
        shape = (q.shape[0], q.shape[1], keys.shape[1])
        scores = sum_head_chunks(score, head_chunk, shape, q, w)
    if score_dtype is None:
        return scores
    return scores.astype(score_dtype).astype(jnp.float32)
