"""Indexer KL distillation (SPEC §4): teach the indexer where the main attention looks.

For query ``t`` and candidate ``j`` (V4: a compressed-entry slot; V3.2: a token), head ``h`` of
the main attention gives ``P_h[t, j] = exp(l_h[t, j] - lse_h[t])``, its softmax over the layer's
*whole* key set (window, candidates and the sink). The target sums these over heads, keeps the
candidates and L1-normalises: ``p_t = Σ_h P_h[t] / Σ_j Σ_h P_h[t, j]``. The loss is
``mean_t KL(p_t ‖ softmax_j(I[t, j]))`` over queries with at least one candidate, ``I`` the
indexer scores over the same candidates.

The target is computed under ``stop_gradient``, so gradient flows into the indexer scores only.
With ``head_chunk > 0`` the per-head probabilities are summed ``head_chunk`` heads at a time in a
rematerialised ``lax.scan``, so the ``[B, H, S, T]`` tensor never exists; only float32
``[B, S, T]`` accumulators do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .indexer import sum_head_chunks

__all__ = ["indexer_kl_loss", "attention_target", "selection_mask"]


def selection_mask(selection: Int[Array, "batch seq k"], n: int) -> Bool[Array, "batch seq {n}"]:
    """``[B, S, n]`` mask of each query's selected candidates (``-1`` picks are ignored).

    Turns the sparse stage's top-k indices into the ``candidates`` of ``indexer_kl_loss``.
    """
    b, s, _ = selection.shape
    idx = jnp.where(selection >= 0, selection, n)
    rows, cols = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    return jnp.zeros((b, s, n), bool).at[rows, cols, idx].set(True, mode="drop")


def _head_mass(q: Array, lse: Array, keys: Array, candidates: Array, scale: float) -> Array:
    """``Σ_h exp(l_h − lse_h)`` on the candidates (0 elsewhere) for a block of heads, float32."""
    logits = jnp.einsum("bshd,btd->bsht", q, keys, preferred_element_type=jnp.float32) * scale
    log_p = jnp.where(candidates[:, :, None, :], logits - lse[..., None], -jnp.inf)
    return jnp.sum(jnp.exp(log_p), axis=2)


def attention_target(
    q: Float[Array, "batch seq heads dim"],
    keys: Float[Array, "batch cands dim"],
    log_normalizer: Float[Array, "batch seq heads"],
    candidates: Bool[Array, "batch seq cands"],
    scale: float,
    *,
    head_chunk: int = 0,
) -> Float[Array, "batch seq cands"]:
    """The distillation target ``p_t`` (no gradient): the main attention's probability mass on
    each candidate, summed over heads and L1-normalised over the candidates (rows without
    candidates, or without mass, are all zero).

    ``log_normalizer`` is each head's log softmax denominator over the *full* key set (as
    returned by ``sparse_attention(..., return_lse=True)``), so the probabilities are those of
    the main attention, not a softmax over the candidates alone.
    """
    q, keys, lse = jax.lax.stop_gradient((q, keys, log_normalizer.astype(jnp.float32)))
    h = q.shape[2]
    if head_chunk and h % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {h} attention heads")
    if not head_chunk:
        mass = _head_mass(q, lse, keys, candidates, scale)
    else:
        mass = sum_head_chunks(
            lambda q, lse: _head_mass(q, lse, keys, candidates, scale),
            head_chunk, candidates.shape, q, lse,
        )
    total = jnp.sum(mass, axis=-1, keepdims=True)
    return mass / jnp.where(total > 0, total, 1.0)


def indexer_kl_loss(
    q: Float[Array, "batch seq heads dim"],
    keys: Float[Array, "batch cands dim"],
    log_normalizer: Float[Array, "batch seq heads"],
    scores: Float[Array, "batch seq cands"],
    candidates: Bool[Array, "batch seq cands"],
    scale: float,
    *,
    head_chunk: int = 0,
) -> Float[Array, ""]:
    """``mean_t KL(p_t ‖ softmax(I_t))`` over the queries that have at least one candidate.

    Arguments:
        q: the main attention's queries (detached here).
        keys: the candidates' keys, shared by all heads (detached here). V4: the compressed
            entries. V3.2: the per-token MLA keys in absorbed form (``c_kv ⊕ k_rope``, with
            ``q`` the absorbed queries), i.e. exactly what its ``sparse_attention`` gets.
        log_normalizer: each head's log softmax denominator over the main attention's full key
            set, sink included (``sparse_attention(..., return_lse=True)``).
        scores: indexer scores ``I`` over the same candidate axis; the only input that carries
            gradient. Compute them from detached hidden states so that only indexer parameters
            train.
        candidates: which candidates count for each query. Dense warm-up: every visible one
            (``entry_visibility``; V3.2 the causal mask). Sparse stage: the selected ones
            (``selection_mask(selection, n)``).
        scale: the main attention's softmax scale.
        head_chunk: heads per chunk for the target (0 = all at once); must divide ``heads``.

    Returns:
        A float32 scalar; 0 when no query has a candidate (never NaN).
    """
    p = attention_target(q, keys, log_normalizer, candidates, scale, head_chunk=head_chunk)
    has = jnp.any(candidates, axis=-1)
    s = scores.astype(jnp.float32)
    peak = jax.lax.stop_gradient(jnp.max(jnp.where(candidates, s, -jnp.inf), axis=-1))
    shifted = jnp.where(candidates, s - jnp.where(has, peak, 0.0)[..., None], 0.0)
    z = jnp.sum(jnp.where(candidates, jnp.exp(shifted), 0.0), axis=-1)
    log_q = shifted - jnp.log(jnp.where(has, z, 1.0))[..., None]
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    kl = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
    return jnp.sum(jnp.where(has, kl, 0.0)) / jnp.maximum(jnp.sum(has), 1)
