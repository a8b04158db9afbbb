"""Indexer KL distillation: teach the indexer where the main attention looks (docs/concepts.md,
"Training the indexer").

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

How the loss of a layer's ``SelectionProblem`` is computed is a strategy
(``AbstractIndexerLoss``, held in ``Execution.indexer_kl``): ``DenseIndexerLoss`` scores every
candidate at once; ``StreamingIndexerLoss`` removes the ``[B, S, T]`` tensors too at long
context (the dense warm-up stage streams over key blocks with an online log-sum-exp, the sparse
stage gathers each query block's selected keys; memory is linear in ``S``);
``csa_eqx.AutoIndexerLoss`` chooses by size. ``projected_indexer_kl_loss`` runs one.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._layout import gather_keys, scatter_rows, take
from .._ops import varying_like
from .._scorer.base import sum_head_chunks
from .._tiles import block_starts, sparse_query_block
from .base import AttentionTarget

__all__ = [
    "indexer_kl_loss",
    "attention_target",
    "selection_mask",
]


def selection_mask(selection: Int[Array, "batch seq k"], n: int) -> Bool[Array, "batch seq {n}"]:
    """Turns the sparse stage's top-k indices into the ``candidates`` of ``indexer_kl_loss``.

    **Arguments:** int32 ``selection [B, S, k]`` (``-1`` picks are ignored) and the candidate
    count ``n``.

    **Returns:** bool ``[B, S, n]``, true on each query's selected candidates.
    """
    slot = jnp.where(selection >= 0, selection, n)  # out of range: dropped
    return scatter_rows(slot, jnp.ones(selection.shape, bool), n, False)


def _head_mass(q, lse, keys, candidates, scale, spec):
    """``Σ_h exp(l_h − lse_h)`` on the candidates (0 elsewhere) for a block of heads, float32.

    ``spec`` contracts queries with shared keys (``"bshd,btd->bsht"``) or per-query gathered
    keys (``"bshd,bskd->bshk"``)."""
    logits = jnp.einsum(spec, q, keys, preferred_element_type=jnp.float32) * scale
    log_p = jnp.where(candidates[:, :, None, :], logits - lse[..., None], -jnp.inf)
    return jnp.sum(jnp.exp(log_p), axis=2)


def target_mass(q, keys, lse, candidates, scale, head_chunk, spec="bshd,btd->bsht"):
    """Unnormalised target: main-attention mass per candidate summed over heads (no gradient),
    float32 ``[B, S, T]``; ``spec`` as for ``_head_mass`` (shared or per-query keys)."""
    q, keys, lse = jax.lax.stop_gradient((q, keys, lse.astype(jnp.float32)))
    h = q.shape[2]
    if head_chunk and h % head_chunk:
        raise ValueError(f"head_chunk={head_chunk} must divide the {h} attention heads")
    if not head_chunk:
        return _head_mass(q, lse, keys, candidates, scale, spec)
    return sum_head_chunks(
        lambda q, lse: _head_mass(q, lse, keys, candidates, scale, spec),
        head_chunk,
        candidates.shape,
        q,
        lse,
    )


def attention_target(
    target: AttentionTarget, candidates: Bool[Array, "batch seq cands"], *, head_chunk: int = 0
) -> Float[Array, "batch seq cands"]:
    """The distillation target ``p_t`` (no gradient): the main attention's probability mass on
    each candidate, summed over heads and L1-normalised over the candidates (rows without
    candidates, or without mass, are all zero).

    ``target.log_normalizer`` is each head's log softmax denominator over the *full* key set
    (as returned by ``sparse_attention(..., return_lse=True)``), so the probabilities are those
    of the main attention, not a softmax over the candidates alone (docs/concepts.md,
    "Training the indexer").

    **Arguments:** the main attention ``target`` (``AttentionTarget``: ``q [B, S, H, d]``, the
    candidates' ``keys [B, T, d]``, ``log_normalizer [B, S, H]``, ``scale``), bool
    ``candidates [B, S, T]`` and ``head_chunk`` (heads at once, 0 = all).

    **Returns:** float32 ``[B, S, T]``, rows summing to 1 (or all zero).
    """
    q, keys, log_normalizer, scale = target
    mass = target_mass(q, keys, log_normalizer, candidates, scale, head_chunk)
    total = jnp.sum(mass, axis=-1, keepdims=True)
    return mass / jnp.where(total > 0, total, 1.0)


def row_kl(mass: Array, scores: Array, candidates: Array) -> tuple[Array, Array]:
    """Per query (``[B, S]`` each): ``KL(mass/Σmass ‖ softmax(scores))`` over the candidates
    (0 without mass or candidates), and whether it has a candidate."""
    total = jnp.sum(mass, axis=-1, keepdims=True)
    p = mass / jnp.where(total > 0, total, 1.0)
    has = jnp.any(candidates, axis=-1)
    s = scores.astype(jnp.float32)
    peak = jnp.max(jnp.where(candidates, s, -jnp.inf), axis=-1, initial=-jnp.inf)  # T = 0 too
    peak = jax.lax.stop_gradient(peak)
    shifted = jnp.where(candidates, s - jnp.where(has, peak, 0.0)[..., None], 0.0)
    z = jnp.sum(jnp.where(candidates, jnp.exp(shifted), 0.0), axis=-1)
    log_q = shifted - jnp.log(jnp.where(has, z, 1.0))[..., None]
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1), has


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

    **Arguments:**

    - ``q``: the main attention's queries (detached here).
    - ``keys``: the candidates' keys, shared by all heads (detached here). V4: the compressed
        entries. V3.2: the per-token MLA keys in absorbed form (``c_kv ⊕ k_rope``, with
        ``q`` the absorbed queries), i.e. exactly what its ``sparse_attention`` gets.
    - ``log_normalizer``: each head's log softmax denominator over the main attention's full key
        set, sink included (``sparse_attention(..., return_lse=True)``).
    - ``scores``: indexer scores ``I`` over the same candidate axis; the only input that carries
        gradient. Compute them from detached hidden states so that only indexer parameters
        train.
    - ``candidates``: which candidates count for each query. Dense warm-up: every visible one
        (``entry_visibility``; V3.2 the causal mask). Sparse stage: the selected ones
        (``selection_mask(selection, n)``).
    - ``scale``: the main attention's softmax scale.
    - ``head_chunk``: heads per chunk for the target (0 = all at once); must divide ``heads``.

    **Returns:**

    A float32 scalar; 0 when no query has a candidate (never NaN).
    """
    mass = target_mass(q, keys, log_normalizer, candidates, scale, head_chunk)
    kl, has = row_kl(mass, scores, candidates)
    return jnp.sum(kl) / jnp.maximum(jnp.sum(has), 1)


def gathered_kl(
    problem,
    target: AttentionTarget,
    selection: Int[Array, "batch seq k"] | None,
    sizes: tuple[int, int, int, int],
    query_block: int = 0,
) -> Float[Array, ""]:
    """The indexer loss over each query's own entries, gathered per query block
    (``csa_eqx.GatheredIndexerLoss``): ``selection``'s picks (``-1`` = none), or with
    ``selection=None`` each query's visible slots (``problem.visibility.slots()``); their
    indexer keys and main-attention entries are scored and weighed there only, in a
    ``lax.scan`` with a rematerialised body.

    **Arguments:** the ``SelectionProblem`` and ``target`` (as ``AbstractIndexerLoss.loss``),
    the ``selection``, the problem's ``sizes`` (``AbstractIndexerLoss.sizes``) and the
    ``query_block`` (0 = automatic, ``csa_eqx._tiles.sparse_query_block``).

    **Returns:** a float32 scalar, the mean over queries with a candidate (0 without).
    """
    b, s, t, heads = sizes
    if t == 0 or s == 0:
        return jnp.zeros((), jnp.float32)
    visibility = problem.visibility
    if selection is None:
        n = jax.eval_shape(lambda v: v.rows(0, 1).slots(), visibility).shape[-1]
        picks = lambda r0, qb: visibility.rows(r0, qb).slots()  # noqa: E731
    else:
        n, picks = selection.shape[-1], partial(take, selection)
    index_keys = problem.keys
    q, entries, lse = jax.lax.stop_gradient(
        (target.q, target.keys, target.log_normalizer.astype(jnp.float32))
    )
    width = index_keys.shape[-1] + entries.shape[-1]
    qb = max(1, min(query_block or sparse_query_block(b, heads, width, n), s))
    rows = jax.lax.stop_gradient(problem.rows)
    starts = block_starts(s, qb)

    def body(carry, i):
        r0 = starts[i]
        qx, wx = problem.project(*(take(r, r0, qb) for r in rows))
        sel = picks(r0, qb)
        candidates = (sel >= 0) & (r0 + jnp.arange(qb) >= i * qb)[:, None]
        gathered = gather_keys(index_keys, sel)
        scores = problem.scorer.gathered_scores(qx, wx, gathered, head_chunk=problem.head_chunk)
        mass = target_mass(
            take(q, r0, qb),
            gather_keys(entries, sel),
            take(lse, r0, qb),
            candidates,
            target.scale,
            problem.head_chunk,
            "bshd,bskd->bshk",
        )
        kl, has = row_kl(mass, scores, candidates)
        # the sums' dtypes stay the carry's under jax_enable_x64
        return (
            carry[0] + jnp.sum(kl).astype(jnp.float32),
            carry[1] + jnp.sum(has, dtype=jnp.int32),
        ), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    init = varying_like(init, (q, entries, lse))
    (kl, count), _ = jax.lax.scan(jax.checkpoint(body), init, jnp.arange(starts.shape[0]))
    return kl / jnp.maximum(count, 1)
