"""What the conformance suites share (issue 43; docs/testing.md, "Conformance suites"): the
independent references, written here in numpy (float64 where it matters) or as plain ``jnp``
formulas for gradients, and the suites' one import of private modules.

Each family's suite (``tests/test_conformance_*.py``) runs every member of the family through
the same checks, by parametrisation over a member table; a member joins by one line there,
and a member that cannot run a check says why in that module's table of exceptions.
"""

import ml_dtypes
import numpy as np
import pytest

# --- every private name the suites use: the one place to retarget when modules move --------
from csa_eqx import _backend as choosers  # the module whose jax.default_backend the choosers ask
from csa_eqx._attention import mosaic_plan
from csa_eqx._attention.base import attention_query_block
from csa_eqx._attention.mosaic_reads import RowsRead
from csa_eqx._numerics.base import V4_FORMATS, V32_FORMATS, V41_FORMATS
from csa_eqx._numerics.fp8_linear import fp8_product
from csa_eqx._selection.auto import candidate_source, filter_bites
from csa_eqx._selection.candidates import block_top

__all__ = [
    "choosers",
    "mosaic_plan",
    "RowsRead",
    "attention_query_block",
    "filter_bites",
    "candidate_source",
    "block_top",
    "fp8_product",
    "V4_FORMATS",
    "V32_FORMATS",
    "V41_FORMATS",
    "member_results",
    "bf16",
    "visible_np",
    "scores_np",
    "brute_topk",
    "candidates_np",
    "in_blocks_np",
    "attention_np",
    "kl_np",
    "target_mass_np",
]


def member_results(exceptions: dict, run):
    """A suite's ``results`` fixture: ``get(name, check)``, member ``name``'s outputs (its
    ``run(name)``, computed once per module), or a skip where ``exceptions`` names the member
    and the ``check`` with its reason."""
    cache = {}

    def get(name: str, check=None) -> dict:
        if (name, check) in exceptions:
            pytest.skip(exceptions[name, check])
        if name not in cache:
            cache[name] = run(name)
        return cache[name]

    return get


def bf16(x) -> np.ndarray:
    """``x`` rounded to bfloat16 (nearest, ties to even), as float32."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def visible_np(query_index, query_segment, end, segment) -> np.ndarray:
    """bool ``[B, S, T]``: entry ``j`` is visible to query ``t`` iff it is a filled slot
    (``end >= 0``) that closed at or before the query (``end <= query_index``) in the query's
    segment (docs/concepts.md, "Visibility")."""
    end, segment = np.asarray(end)[:, None, :], np.asarray(segment)[:, None, :]
    qi, qs = np.asarray(query_index)[:, :, None], np.asarray(query_segment)[:, :, None]
    return (end >= 0) & (end <= qi) & (segment == qs)


def scores_np(q, w, keys, score_dtype=None, head_chunk=0) -> np.ndarray:
    """The indexer scores ``d^-1/2 Σ_h w_h ReLU(q_h · k)`` (docs/concepts.md, "The lightning
    indexer"): float64 from the definition, or with ``score_dtype="bfloat16"`` as DeepSeek-V4's
    bf16 einsum forms them: each head's logit rounded to bf16, its weight ``w·d^-1/2`` rounded
    to bf16, their product rounded to bf16, the head sum (by chunks of ``head_chunk``) in
    float32, rounded to bf16. The bf16 path needs inputs whose logits are exact in float32."""
    q, w, keys = (np.asarray(a, np.float64) for a in (q, w, keys))
    d = q.shape[-1]
    logits = np.einsum("bshd,btd->bsht", q, keys)
    if score_dtype is None:
        return np.einsum("bsh,bsht->bst", w, np.maximum(logits, 0.0)) * d**-0.5
    assert score_dtype == "bfloat16"
    assert np.array_equal(logits.astype(np.float32), logits), "logits must be exact in float32"
    weight = bf16(np.float32(w) * np.float32(d**-0.5))
    terms = bf16(np.maximum(bf16(logits), 0) * weight[..., None])  # products exact in float32
    h = q.shape[2]
    chunk = head_chunk or h
    total = np.zeros(terms.shape[:2] + terms.shape[3:], np.float32)
    for c in range(0, h, chunk):
        total = total + terms[:, :, c : c + chunk].sum(2, dtype=np.float32)
    assert np.array_equal(total, terms.astype(np.float64).sum(2)), "head sums must be exact"
    return bf16(total)


def brute_topk(scores, allowed, k: int) -> np.ndarray:
    """Per row: the allowed entries sorted by (score descending, index ascending), the first
    ``k`` kept and listed in increasing index order, ``-1`` after (``-0.0`` ties ``+0.0``)."""
    scores, allowed = np.asarray(scores), np.asarray(allowed)
    out = np.full(scores.shape[:-1] + (k,), -1, np.int32)
    for row in np.ndindex(scores.shape[:-1]):
        idx = np.flatnonzero(allowed[row])
        ranked = sorted(idx, key=lambda j: (-float(scores[row][j]), j))
        out[row][: min(k, len(idx))] = sorted(ranked[:k])
    return out


def candidates_np(scores, visible, nb: int, bc: int) -> np.ndarray:
    """V4.1's candidate pre-filter (docs/v41.md, "Candidates") by brute force: block ids
    ``[B, S, nb]``, increasing, ``-1`` past the last. Blocks of ``bc`` slots, each scored by its
    best visible entry; the block of the query's newest visible entry always kept; the best
    ``nb`` in all, ties to the lower block; none without a visible entry."""
    b, s, t = scores.shape
    out = np.full((b, s, nb), -1, np.int32)
    for i, j in np.ndindex(b, s):
        vis = visible[i, j]
        if not vis.any():
            continue
        best = {}
        for blk in range(-(-t // bc)):
            seen = vis[blk * bc : (blk + 1) * bc]
            if seen.any():
                best[blk] = scores[i, j, blk * bc : (blk + 1) * bc][seen].max()
        best[np.flatnonzero(vis).max() // bc] = np.inf
        kept = sorted(sorted(best, key=lambda blk: (-best[blk], blk))[:nb])
        out[i, j, : len(kept)] = kept
    return out


def in_blocks_np(blocks, bc: int, entries: int) -> np.ndarray:
    """bool ``[B, S, T]``: the slots of the kept block ids ``blocks [B, S, Nb]`` (``-1`` =
    none), the last block's slots past ``T`` dropped."""
    slot_block = np.arange(entries) // bc
    return (np.asarray(blocks)[..., None, :] == slot_block[:, None]).any(-1)


def attention_np(xp, q, keys, values, mask, sinks, scale, weights_round=None):
    """Softmax attention of each query over its own key rows, the reference of every attention
    kernel (docs/concepts.md, "Sparse attention without a dense mask"), as one formula for
    numpy (``xp = np``, the forward in float64) and ``jax.numpy`` (``xp = jnp``, whose autodiff
    is the reference gradient).

    **Arguments:** ``q [B, S, H, d]``; ``keys [B, S, n, d]`` and ``values [B, S, n, v]``, each
    query's own rows; bool ``mask [B, S, n]`` (rows read); ``sinks [H]`` or ``None`` (in the
    denominator only); the ``scale``; ``weights_round``: ``None`` (the exact softmax) or a
    function rounding the probabilities as DeepSeek's ``sparse_attn`` does (relative to the
    logits' maximum without the sink, the division after ``P·V``).

    **Returns:** ``(out [B, S, H, v], lse [B, S, H])``: zeros and ``-inf`` where a query reads
    nothing and has no sink.
    """
    logits = xp.einsum("bshd,bsnd->bshn", q, keys) * scale
    logits = xp.where(mask[:, :, None, :], logits, -xp.inf)
    peak = xp.max(logits, axis=-1)
    sink = None if sinks is None else xp.broadcast_to(sinks, peak.shape)
    if sink is not None and weights_round is None:
        peak = xp.maximum(peak, sink)
    peak = xp.where(xp.isfinite(peak), peak, 0.0)
    p = xp.exp(logits - peak[..., None])
    denom = xp.sum(p, axis=-1)
    if sink is not None:
        denom = denom + xp.exp(sink - peak)
    safe = xp.where(denom > 0, denom, 1.0)
    if weights_round is None:
        out = xp.einsum("bshn,bsnv->bshv", p / safe[..., None], values)
    else:
        out = xp.einsum("bshn,bsnv->bshv", weights_round(p), values) / safe[..., None]
    lse = xp.where(denom > 0, peak + xp.log(safe), -xp.inf)
    return out, lse


def kl_np(xp, scores, target_mass, candidates):
    """The indexer KL loss (docs/concepts.md, "Training the indexer") as one formula for numpy
    (the forward) and ``jax.numpy`` (the reference gradient): per query with a candidate,
    ``KL(p ‖ softmax(I))`` over its candidates, ``p`` the target mass L1-normalised there; the
    mean over those queries (0 without any).

    **Arguments:** the indexer ``scores [B, S, T]``, the main attention's mass on each entry
    ``target_mass [B, S, T]`` (a constant) and the bool ``candidates [B, S, T]``.
    """
    has = candidates.any(-1)
    mass = xp.where(candidates, target_mass, 0.0)
    total = mass.sum(-1, keepdims=True)
    p = mass / xp.where(total > 0, total, 1.0)
    masked = xp.where(candidates, scores, -1e30)
    peak = xp.max(masked, axis=-1, keepdims=True)
    z = xp.sum(xp.where(candidates, xp.exp(masked - peak), 0.0), -1, keepdims=True)
    log_q = masked - peak - xp.log(xp.where(has[..., None], z, 1.0))
    log_p = xp.log(xp.where(p > 0, p, 1.0))
    row = xp.sum(xp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
    return xp.sum(xp.where(has, row, 0.0)) / max(int(np.asarray(has).sum()), 1)


def target_mass_np(q, entries, lse, scale) -> np.ndarray:
    """float64 ``Σ_h exp(scale·q_h·e_j − lse_h)``: the main attention's probability of each
    entry summed over its heads (``lse``: each head's log-normaliser over its whole key set)."""
    q, entries, lse = (np.asarray(a, np.float64) for a in (q, entries, lse))
    logits = np.einsum("bshd,btd->bsht", q, entries) * scale
    return np.exp(logits - lse[..., None]).sum(2)
