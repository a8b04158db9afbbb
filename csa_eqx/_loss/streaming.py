"""``StreamingIndexerLoss``: the indexer KL loss without ``[B, S, T]`` tensors.

The dense warm-up stage streams key blocks per query block with an online log-sum-exp,
skipping key blocks invisible to a whole query block; its backward (``∂/∂I = (q − p)/n``,
a ``custom_vjp``) is blockwise too. Each tile's visibility is the problem's
(``visibility.tile``). The sparse stage gathers only each query block's selected keys
(``csa_eqx._loss.kl.gathered_kl``). Memory is linear in ``S``; the queries are projected
one query block at a time (``SelectionProblem.project``).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._blocks import block_starts, key_block_ranges, take
from .._dispatch import converted_for_blocks
from .._layout import Visibility
from .._ops import summed_like, varying_like
from .._tiles import streaming_block_sizes
from .base import AbstractIndexerLoss
from .kl import gathered_kl, target_mass

__all__ = ["StreamingIndexerLoss"]


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
    visibility: Visibility  # or any visibility (``Visibility``'s calls)


def _dense_tiles(static, index_keys, fx: _Fixed, init, query_block_body):
    """Drive the block loops: for each query block ``i`` (rows ``r0..r0+qb``, of which
    ``fresh`` are new: the last block is pulled back), ``query_block_body`` gets a per key
    block ``tile(j) -> (scores_fn, mass, visible)`` over the visible key-block range."""
    scale, head_chunk, qb, kb, _ = static
    vis = fx.visibility
    s, t = vis.query_index.shape[1], index_keys.shape[1]
    lo, hi = key_block_ranges(vis.query_index, vis.query_segment, vis.layout, qb, kb)
    q_starts, k_starts = block_starts(s, qb), block_starts(t, kb)

    def body(i, carry):
        r0 = q_starts[i]
        fresh = r0 + jnp.arange(qb) >= i * qb
        seen = vis.rows(r0, qb)
        qm, lm = take(fx.q, r0, qb), take(fx.lse, r0, qb)
        rows = tuple(take(r, r0, qb) for r in fx.rows)

        def tile(j):
            c0 = k_starts[j]
            # a pulled-back last key block re-reads entries already counted: hide them
            visible = seen.tile(c0, kb) & (c0 + jnp.arange(kb) >= j * kb)
            mass = target_mass(qm, take(fx.entries, c0, kb), lm, visible, scale, head_chunk)
            return c0, mass, visible

        return query_block_body(carry, r0, fresh, rows, tile, lo[i], hi[i])

    return jax.lax.fori_loop(0, q_starts.shape[0], body, init)


def _f32_zeros(x: Array) -> Array:
    """Zeros of ``x``'s shape in at least float32, typed as ``x`` varies (a cotangent's)."""
    return varying_like(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), x)


def _block_scores(static):
    """The tile scorer of ``static = (scale, head_chunk, qb, kb, scorer)``: float32 scores."""
    head_chunk, scorer = static[1], static[4]
    return lambda q, w, k: scorer.scores(q, w, k, head_chunk=head_chunk)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _streaming_dense_kl(project, static, consts, index_keys, fx: _Fixed) -> Array:
    return _streaming_dense_fwd(project, static, consts, index_keys, fx)[0]


def _streaming_dense_fwd(project, static, consts, index_keys, fx: _Fixed):
    kb, b = static[3], fx.visibility.query_index.shape[0]
    score = _block_scores(static)

    def query_block_body(stats, r0, fresh, rows, tile, lo, hi):
        qx, wx = project(*rows, *consts)

        def key_block_body(j, st):
            c0, mass, visible = tile(j)
            return _online_update(st, score(qx, wx, take(index_keys, c0, kb)), mass, visible)

        st = varying_like(_online_init((b, fresh.shape[0])), (qx, wx, index_keys, rows, fx))
        st = jax.lax.fori_loop(lo, hi, key_block_body, st)
        kl, has, lse_i = _online_kl(st)
        # rows of a pulled-back last block are recomputed alike: overwriting them is harmless
        new = (kl, has, lse_i, st.mass)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(a, n, r0, axis=1)
            for a, n in zip(stats, new, strict=True)
        )

    s = fx.visibility.query_index.shape[1]
    zeros = jnp.zeros((b, s), jnp.float32)
    init = varying_like((zeros, jnp.zeros((b, s), bool), zeros, zeros), (index_keys, fx))
    kl, has, lse_i, total = _dense_tiles(static, index_keys, fx, init, query_block_body)
    count = jnp.maximum(jnp.sum(has), 1).astype(jnp.float32)
    return jnp.sum(kl) / count, (consts, index_keys, fx, lse_i, total, count)


def _streaming_dense_bwd(project, static, res, g):
    """``∂loss/∂I[t, j] = (q_j − p_j) / n`` per visible tile, pulled back through the tile's
    scores and the query block's projection; nothing larger than a tile is formed.

    Inside a ``shard_map`` with ``check_vma`` every cotangent is typed as its primal (the
    projection's and the scorer's own transposes sum over the devices what a replicated
    input owes, so nothing is summed twice): the block's projections are cast to vary as the
    tiles' targets do (e.g. every head's, under head parallelism), whose transpose sums the
    extra axes."""
    consts, index_keys, fx, lse_i, total, count = res
    kb = static[3]
    coef = g / count
    score = _block_scores(static)
    likes = (index_keys, fx, lse_i, total, g)
    # the keys typed as the tiles vary: each tile's cotangent stays this device's share (a
    # replicated key block's would come back summed by the scorer's transpose, then again)
    keys = varying_like(index_keys, likes)

    def projected(rows, *c):
        return varying_like(project(*rows, *c), (rows, likes))

    def query_block_body(carry, r0, fresh, rows, tile, lo, hi):
        d_consts, d_keys = carry
        (qx, wx), pull = jax.vjp(partial(projected, rows), *consts)
        lse_b, tot_b = take(lse_i, r0, fresh.shape[0]), take(total, r0, fresh.shape[0])
        live = (fresh & (tot_b > 0))[..., None]

        def key_block_body(j, acc):
            d_qx, d_wx, d_keys = acc
            c0, mass, visible = tile(j)
            scores, tile_pull = jax.vjp(score, qx, wx, take(keys, c0, kb))
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
    # the weights' cotangents typed as the weights (each block's pull sums over the devices),
    # the keys' as the tiles vary (this device's blocks' share, summed once at the end)
    init = (jax.tree.map(_f32_zeros, consts), _f32_zeros(keys))
    d_consts, d_keys = _dense_tiles(static, index_keys, fx, init, query_block_body)
    cast = lambda d, x: d.astype(x.dtype)  # noqa: E731
    grads = (jax.tree.map(cast, d_consts, consts), cast(d_keys, index_keys))
    return (*summed_like(grads, (consts, index_keys)), None)


_streaming_dense_kl.defvjp(_streaming_dense_fwd, _streaming_dense_bwd)


class StreamingIndexerLoss(AbstractIndexerLoss):
    """The indexer KL loss by query blocks, never forming ``[B, S, T]`` (module docstring):
    the warm-up over ``query_block x key_block`` tiles with an online log-sum-exp and a
    blockwise backward, the sparse stage over each query block's gathered picks
    (``csa_eqx.GatheredIndexerLoss``'s). Tiles are scored by the problem's scorer; automatic
    sizes come from its ``tiles``.

    **Arguments:**

    - ``key_block``: entries per key tile of the warm-up (0 = automatic, see
        ``csa_eqx._tiles.streaming_block_sizes``).
    - ``query_block``: queries per block (0 = automatic; the sparse stage's automatic block is
        ``csa_eqx._tiles.sparse_query_block``).
    """

    key_block: int = eqx.field(default=0, static=True)
    query_block: int = eqx.field(default=0, static=True)

    def __check_init__(self):
        for name in ("key_block", "query_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StreamingIndexerLoss.{name} must be an int >= 0 (got {value!r})")

    def loss(self, problem, target, selection=None):
        b, s, t, heads = sizes = self.sizes(problem, target)
        if selection is not None:
            return gathered_kl(problem, target, selection, sizes, self.query_block)
        if t == 0 or s == 0:
            return jnp.zeros((), jnp.float32)
        rows = jax.lax.stop_gradient(problem.rows)
        q, entries, lse = jax.lax.stop_gradient(
            (target.q, target.keys, target.log_normalizer.astype(jnp.float32))
        )
        qb, kb = streaming_block_sizes(
            b, s, t, heads, self.key_block, self.query_block, problem.tiles
        )
        project, consts = converted_for_blocks(problem.project, rows, qb)
        fixed = _Fixed(rows, q, entries, lse, problem.visibility)
        static = (target.scale, problem.head_chunk, qb, kb, problem.scorer)
        return _streaming_dense_kl(project, static, tuple(consts), problem.keys, fixed)
