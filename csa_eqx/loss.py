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

``projected_indexer_kl_loss`` removes those too at long context: the dense warm-up stage
streams over key blocks (online log-sum-exp, invisible blocks skipped, a blockwise custom
backward), the sparse stage gathers each query block's selected keys; memory is linear in ``S``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .auto import AutoSelection
from .blocks import block_starts, key_block_ranges, take
from .compressor import EntryLayout
from .indexer import indexer_scores, sum_head_chunks
from .selection import AbstractSelection, SelectionProblem, entry_visibility
from .sparse import gather_keys, picked_mask, sparse_query_block
from .streaming import StreamingSelection, streaming_block_sizes

__all__ = [
    "indexer_kl_loss",
    "attention_target",
    "selection_mask",
    "projected_indexer_kl_loss",
    "AttentionTarget",
]


def selection_mask(selection: Int[Array, "batch seq k"], n: int) -> Bool[Array, "batch seq {n}"]:
    """Turns the sparse stage's top-k indices into the ``candidates`` of ``indexer_kl_loss``.

    Arguments: int32 ``selection [B, S, k]`` (``-1`` picks are ignored) and the candidate
    count ``n``.

    Returns: bool ``[B, S, n]``, true on each query's selected candidates.
    """
    return picked_mask(selection, n)


def _head_mass(q, lse, keys, candidates, scale, spec):
    """``Σ_h exp(l_h − lse_h)`` on the candidates (0 elsewhere) for a block of heads, float32.

    ``spec`` contracts queries with shared keys (``"bshd,btd->bsht"``) or per-query gathered
    keys (``"bshd,bskd->bshk"``)."""
    logits = jnp.einsum(spec, q, keys, preferred_element_type=jnp.float32) * scale
    log_p = jnp.where(candidates[:, :, None, :], logits - lse[..., None], -jnp.inf)
    return jnp.sum(jnp.exp(log_p), axis=2)


def _target_mass(q, keys, lse, candidates, scale, head_chunk, spec="bshd,btd->bsht"):
    """Unnormalised target: main-attention mass per candidate summed over heads (no gradient)."""
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


class AttentionTarget(NamedTuple):
    """The main attention the indexer learns from (all detached by the loss).

    Arguments:
        q: the attention's queries ``[B, S, H, d]``.
        keys: its keys of the candidates ``[B, T, d]`` (V4: the compressed entries; V3.2: the
            absorbed MLA keys of the tokens).
        log_normalizer: each head's float32 log softmax denominator ``[B, S, H]`` over its whole
            key set, sink included (``sparse_attention(..., return_lse=True)``).
        scale: its softmax scale.
    """

    q: Float[Array, "batch seq heads dim"]
    keys: Float[Array, "batch cands dim"]
    log_normalizer: Float[Array, "batch seq heads"]
    scale: float


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

    Arguments: the main attention ``target`` (``AttentionTarget``: ``q [B, S, H, d]``, the
    candidates' ``keys [B, T, d]``, ``log_normalizer [B, S, H]``, ``scale``), bool
    ``candidates [B, S, T]`` and ``head_chunk`` (heads at once, 0 = all).

    Returns: float32 ``[B, S, T]``, rows summing to 1 (or all zero).
    """
    q, keys, log_normalizer, scale = target
    mass = _target_mass(q, keys, log_normalizer, candidates, scale, head_chunk)
    total = jnp.sum(mass, axis=-1, keepdims=True)
    return mass / jnp.where(total > 0, total, 1.0)


def _row_kl(mass: Array, scores: Array, candidates: Array) -> tuple[Array, Array]:
    """Per query: ``KL(mass/Σmass ‖ softmax(scores))`` over the candidates (0 without mass or
    candidates), and whether it has a candidate."""
    total = jnp.sum(mass, axis=-1, keepdims=True)
    p = mass / jnp.where(total > 0, total, 1.0)
    has = jnp.any(candidates, axis=-1)
    s = scores.astype(jnp.float32)
    peak = jax.lax.stop_gradient(jnp.max(jnp.where(candidates, s, -jnp.inf), axis=-1))
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
    mass = _target_mass(q, keys, log_normalizer, candidates, scale, head_chunk)
    kl, has = _row_kl(mass, scores, candidates)
    return jnp.sum(kl) / jnp.maximum(jnp.sum(has), 1)


class _Online(NamedTuple):
    """Running per-query sums over the candidates seen so far (all float32 ``[B, Qb]``):
    score peak ``m``, ``Σ exp(I − m)``, ``Σ mass``, ``Σ mass·log mass``, ``Σ mass·(I − m)``."""

    peak: Array
    z: Array
    mass: Array
    mass_log_mass: Array
    mass_score: Array


def _online_init(shape) -> _Online:
    zeros = jnp.zeros(shape, jnp.float32)
    return _Online(jnp.full(shape, -jnp.inf), zeros, zeros, zeros, zeros)


def _shift(peak: Array) -> Array:
    return jnp.where(jnp.isfinite(peak), peak, 0.0)


def _online_update(st: _Online, scores: Array, mass: Array, visible: Array) -> _Online:
    """Fold one key block in (flash-attention style rescaling when the peak grows)."""
    peak = jnp.maximum(st.peak, jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1))
    new, old = _shift(peak), _shift(st.peak)
    rel = jnp.where(visible, scores - new[..., None], 0.0)
    z = st.z * jnp.exp(old - new) + jnp.sum(jnp.where(visible, jnp.exp(rel), 0.0), axis=-1)
    mlm = jnp.sum(jnp.where(mass > 0, mass * jnp.log(jnp.where(mass > 0, mass, 1.0)), 0.0), -1)
    return _Online(
        peak,
        z,
        st.mass + jnp.sum(mass, axis=-1),
        st.mass_log_mass + mlm,
        st.mass_score - st.mass * (new - old) + jnp.sum(mass * rel, axis=-1),
    )


def _online_kl(st: _Online) -> tuple[Array, Array, Array]:
    """Per query ``KL = A/M − log M − B/M + log z``, whether it has a candidate, and
    ``lse(I)`` over its candidates (0 without)."""
    has, live = st.z > 0, st.mass > 0
    log_z = jnp.log(jnp.where(has, st.z, 1.0))
    m = jnp.where(live, st.mass, 1.0)
    kl = (st.mass_log_mass - st.mass_score) / m - jnp.log(m) + log_z
    return jnp.where(live & has, kl, 0.0), has, _shift(st.peak) + log_z


class _Fixed(NamedTuple):
    """The non-differentiated inputs of the streaming dense stage."""

    rows: tuple[Array, ...]
    q: Array
    entries: Array
    lse: Array
    query_index: Array
    query_segment: Array
    layout: EntryLayout


def _dense_tiles(static, index_keys, fx: _Fixed, init, query_block_body):
    """Drive the block loops: for each query block ``i`` (rows ``r0..r0+qb``, of which
    ``fresh`` are new: the last block is pulled back), ``query_block_body`` gets a per key
    block ``tile(j) -> (scores_fn, mass, visible)`` over the visible key-block range."""
    scale, head_chunk, qb, kb = static
    s, t = fx.query_index.shape[1], index_keys.shape[1]
    lo, hi = key_block_ranges(fx.query_index, fx.query_segment, fx.layout, qb, kb)
    q_starts, k_starts = block_starts(s, qb), block_starts(t, kb)

    def body(i, carry):
        r0 = q_starts[i]
        fresh = r0 + jnp.arange(qb) >= i * qb
        qi, qs = take(fx.query_index, r0, qb), take(fx.query_segment, r0, qb)
        qm, lm = take(fx.q, r0, qb), take(fx.lse, r0, qb)
        rows = tuple(take(r, r0, qb) for r in fx.rows)

        def tile(j):
            c0 = k_starts[j]
            end = take(fx.layout.end, c0, kb)
            layout = EntryLayout(end, take(fx.layout.segment, c0, kb), end >= 0)
            # a pulled-back last key block re-reads entries already counted: hide them
            visible = entry_visibility(qi, qs, layout) & (c0 + jnp.arange(kb) >= j * kb)
            mass = _target_mass(qm, take(fx.entries, c0, kb), lm, visible, scale, head_chunk)
            return c0, mass, visible

        return query_block_body(carry, r0, fresh, rows, tile, lo[i], hi[i])

    return jax.lax.fori_loop(0, q_starts.shape[0], body, init)


def _f32_zeros(x: Array) -> Array:
    return jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32))


def _block_scores(head_chunk):
    return lambda q, w, k: indexer_scores(q, w, k, head_chunk=head_chunk)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _streaming_dense_kl(project, static, consts, index_keys, fx: _Fixed) -> Array:
    return _streaming_dense_fwd(project, static, consts, index_keys, fx)[0]


def _streaming_dense_fwd(project, static, consts, index_keys, fx: _Fixed):
    kb, b = static[3], fx.query_index.shape[0]
    score = _block_scores(static[1])

    def query_block_body(stats, r0, fresh, rows, tile, lo, hi):
        qx, wx = project(*rows, *consts)

        def key_block_body(j, st):
            c0, mass, visible = tile(j)
            return _online_update(st, score(qx, wx, take(index_keys, c0, kb)), mass, visible)

        st = jax.lax.fori_loop(lo, hi, key_block_body, _online_init((b, fresh.shape[0])))
        kl, has, lse_i = _online_kl(st)
        # rows of a pulled-back last block are recomputed alike: overwriting them is harmless
        new = (kl, has, lse_i, st.mass)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(a, n, r0, axis=1)
            for a, n in zip(stats, new, strict=True)
        )

    s = fx.query_index.shape[1]
    zeros = jnp.zeros((b, s), jnp.float32)
    init = (zeros, jnp.zeros((b, s), bool), zeros, zeros)
    kl, has, lse_i, total = _dense_tiles(static, index_keys, fx, init, query_block_body)
    count = jnp.maximum(jnp.sum(has), 1).astype(jnp.float32)
    return jnp.sum(kl) / count, (consts, index_keys, fx, lse_i, total, count)


def _streaming_dense_bwd(project, static, res, g):
    """``∂loss/∂I[t, j] = (q_j − p_j) / n`` per visible tile, pulled back through the tile's
    scores and the query block's projection; nothing larger than a tile is formed."""
    consts, index_keys, fx, lse_i, total, count = res
    kb = static[3]
    coef = g / count
    score = _block_scores(static[1])

    def query_block_body(carry, r0, fresh, rows, tile, lo, hi):
        d_consts, d_keys = carry
        (qx, wx), pull = jax.vjp(lambda *c: project(*rows, *c), *consts)
        lse_b, tot_b = take(lse_i, r0, fresh.shape[0]), take(total, r0, fresh.shape[0])
        live = (fresh & (tot_b > 0))[..., None]

        def key_block_body(j, acc):
            d_qx, d_wx, d_keys = acc
            c0, mass, visible = tile(j)
            scores, tile_pull = jax.vjp(score, qx, wx, take(index_keys, c0, kb))
            q_prob = jnp.exp(jnp.where(visible, scores - lse_b[..., None], -jnp.inf))
            p = mass / jnp.where(tot_b > 0, tot_b, 1.0)[..., None]
            d_scores = jnp.where(visible & live, q_prob - p, 0.0) * coef
            dq, dw, dk = tile_pull(d_scores.astype(scores.dtype))
            d_keys = jax.lax.dynamic_update_slice_in_dim(
                d_keys, take(d_keys, c0, kb) + dk, c0, axis=1
            )
            return d_qx + dq, d_wx + dw, d_keys

        acc = (_f32_zeros(qx), _f32_zeros(wx), d_keys)
        d_qx, d_wx, d_keys = jax.lax.fori_loop(lo, hi, key_block_body, acc)
        d_c = pull((d_qx.astype(qx.dtype), d_wx.astype(wx.dtype)))
        return jax.tree.map(jnp.add, d_consts, d_c), d_keys

    # float32 accumulators across blocks, cast back to the primal dtypes at the end
    init = (jax.tree.map(_f32_zeros, consts), _f32_zeros(index_keys))
    d_consts, d_keys = _dense_tiles(static, index_keys, fx, init, query_block_body)
    cast = lambda d, x: d.astype(x.dtype)  # noqa: E731
    return jax.tree.map(cast, d_consts, consts), cast(d_keys, index_keys), None


_streaming_dense_kl.defvjp(_streaming_dense_fwd, _streaming_dense_bwd)


def _gathered_scores(q: Array, w: Array, keys: Array, head_chunk: int) -> Array:
    """Indexer scores of each query against its own gathered keys ``[B, Qb, k, d]``."""
    acc = jnp.promote_types(q.dtype, jnp.float32)
    w = w.astype(acc) * q.shape[-1] ** -0.5

    def heads(q, w):
        logits = jnp.einsum("bshd,bskd->bshk", q, keys, preferred_element_type=acc)
        return jnp.einsum("bshk,bsh->bsk", jax.nn.relu(logits), w)

    if not head_chunk:
        return heads(q, w)
    return sum_head_chunks(heads, head_chunk, keys.shape[:3], q, w)


def _streaming_sparse_kl(
    project, rows, index_keys, q, entries, lse, selection, scale, head_chunk, qb
):
    """Sparse stage by query blocks: gather each block's selected indexer keys and entries,
    score and weigh only those (``lax.scan`` with a rematerialised body)."""
    s = selection.shape[1]
    starts = block_starts(s, qb)

    def body(carry, i):
        r0 = starts[i]
        qx, wx = project(*(take(r, r0, qb) for r in rows))
        sel = take(selection, r0, qb)
        candidates = (sel >= 0) & (r0 + jnp.arange(qb) >= i * qb)[:, None]
        scores = _gathered_scores(qx, wx, gather_keys(index_keys, sel), head_chunk)
        mass = _target_mass(
            take(q, r0, qb),
            gather_keys(entries, sel),
            take(lse, r0, qb),
            candidates,
            scale,
            head_chunk,
            "bshd,bskd->bshk",
        )
        kl, has = _row_kl(mass, scores, candidates)
        return (carry[0] + jnp.sum(kl), carry[1] + jnp.sum(has)), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    (kl, count), _ = jax.lax.scan(jax.checkpoint(body), init, jnp.arange(starts.shape[0]))
    return kl / jnp.maximum(count, 1)


_AUTO = AutoSelection()


def projected_indexer_kl_loss(
    problem: SelectionProblem,
    target: AttentionTarget,
    selection: Int[Array, "batch seq k"] | None = None,
    *,
    strategy: AbstractSelection = _AUTO,
) -> Float[Array, ""]:
    """``indexer_kl_loss`` with the indexer scores of a selection problem, streaming when the
    dense ``[B, S, T]`` tensors would be large.

    Arguments:
        problem: the indexer side, exactly what the selection got (``SelectionProblem``):
            ``project`` runs one query block at a time; gradient reaches the arrays it closes
            over and ``problem.keys``; ``problem.rows`` are treated as constants.
            ``problem.head_chunk`` also chunks the attention heads of the target.
        target: the main attention (detached), as in ``indexer_kl_loss``.
        selection: ``None`` for the dense warm-up (candidates = every visible entry), else the
            sparse stage's top-k ``[B, S, k]`` (``-1`` = none).
        strategy: the selection strategy; its ``tiling`` decides dense vs streaming and the
            tile sizes (``StreamingSelection`` forces streaming).

    Returns:
        A float32 scalar; 0 when no query has a candidate.

    The dense warm-up streams key blocks per query block with an online log-sum-exp and skips
    key blocks invisible to a whole query block; its backward (``∂/∂I = (q − p)/n``) is
    blockwise too. The sparse stage gathers only each query block's selected keys.
    """
    project, head_chunk = problem.project, problem.head_chunk
    index_keys, (query_index, query_segment, layout) = problem.keys, problem.visibility
    rows = jax.lax.stop_gradient(problem.rows)
    q, entries, log_normalizer, scale = target
    b, s, h_i, _ = jax.eval_shape(project, *rows)[0].shape
    t, heads = index_keys.shape[1], head_chunk or max(h_i, q.shape[2])
    plan = strategy.tiling(b, s, t, heads)
    if not isinstance(plan, StreamingSelection):
        candidates = (
            entry_visibility(query_index, query_segment, layout)
            if selection is None
            else selection_mask(selection, t)
        )
        scores = indexer_scores(*project(*rows), index_keys, head_chunk=head_chunk)
        return indexer_kl_loss(
            q, entries, log_normalizer, scores, candidates, scale, head_chunk=head_chunk
        )
    key_block, query_block = plan.key_block, plan.query_block
    q, entries, lse = jax.lax.stop_gradient((q, entries, log_normalizer.astype(jnp.float32)))
    if t == 0 or s == 0:
        return jnp.zeros((), jnp.float32)
    if selection is not None:
        k = selection.shape[-1]
        width = index_keys.shape[-1] + entries.shape[-1]
        qb = query_block or sparse_query_block(b, heads, width, k)
        return _streaming_sparse_kl(
            project,
            rows,
            index_keys,
            q,
            entries,
            lse,
            selection,
            scale,
            head_chunk,
            max(1, min(qb, s)),
        )
    qb, kb = streaming_block_sizes(b, s, t, heads, key_block, query_block)
    block = [jax.ShapeDtypeStruct((r.shape[0], qb, *r.shape[2:]), r.dtype) for r in rows]
    project, consts = jax.closure_convert(project, *block)
    consts = tuple(consts)
    fixed = _Fixed(rows, q, entries, lse, query_index, query_segment, layout)
    return _streaming_dense_kl(project, (scale, head_chunk, qb, kb), consts, index_keys, fixed)
