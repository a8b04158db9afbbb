"""``TritonScorer``: the indexer scores by a Pallas kernel, one ``[query_block, key_block]``
tile per program, the ReLU, head weights and head sum fused in the tile (docs/kernels.md)."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._ops import pad_axis
from .._triton import MIN_DOT, feature_parts, next_pow2, run_kernel, tile_scores
from .base import AbstractScorer, XlaScorer, indexer_scores

__all__ = ["TritonScorer"]


class TritonScorer(AbstractScorer):
    """Scores by a Pallas kernel (Triton on a GPU, interpret mode on the CPU): each program
    scores a ``[query_block, key_block]`` tile, per head one dot of the queries against the
    key tile, its ReLU times the head weight summed over the heads in registers, so neither the
    ``[B, S, H, T]`` logits nor any per-head tile leave the chip. The sum runs over
    ``head_chunk`` heads at a time as ``csa_eqx.indexer_scores`` sums them, each term rounded
    to ``score_dtype`` when that is set, so the scores equal ``XlaScorer``'s up to float32
    rounding of the contraction order (exact where products and sums are: tests/test_scorer.py
    checks both, bf16 rounding included). The gradient is the reference's
    (``indexer_scores``' VJP), and ``gathered_scores`` (each query against its own keys) is
    ``XlaScorer``'s: a tile per query would be a one-row dot.

    The fused selection (``csa_eqx.TritonSelection``) scores its tiles with the same in-kernel
    code; this scorer serves every other path (the dense and streaming selections, the loss).

    **Arguments:**

    - ``query_block``, ``key_block``: the tile (powers of two; at least 16 on a GPU; a shorter
        sequence or fewer keys take the least power of two, at least 16, that holds them).
    - ``interpret``: ``None`` (compiled on a GPU, interpreted on the CPU), ``True`` or
        ``False`` (``csa_eqx._backend.kernel_interpret``).
    """

    query_block: int = eqx.field(default=64, static=True)
    key_block: int = eqx.field(default=64, static=True)
    interpret: bool | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        for name in ("query_block", "key_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"TritonScorer.{name} must be a power of two (got {v!r})")

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        if head_chunk and q.shape[2] % head_chunk:
            raise ValueError(f"head_chunk={head_chunk} must divide the {q.shape[2]} indexer heads")
        blocks = (self.query_block, self.key_block, self.interpret)
        return _kernel_scores(blocks, head_chunk, score_dtype, q, weights, keys)

    def gathered_scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
        return XlaScorer().gathered_scores(q, weights, keys, **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _kernel_scores(blocks, head_chunk, score_dtype, q, weights, keys):
    return _forward(blocks, head_chunk, score_dtype, q, weights, keys)


def _fwd(blocks, head_chunk, score_dtype, q, weights, keys):
    return _forward(blocks, head_chunk, score_dtype, q, weights, keys), (q, weights, keys)


def _bwd(blocks, head_chunk, score_dtype, residuals, g):
    kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
    _, vjp = jax.vjp(lambda q, w, k: indexer_scores(q, w, k, **kw), *residuals)
    return vjp(g)


_kernel_scores.defvjp(_fwd, _bwd)


def _forward(blocks, head_chunk, score_dtype, q, weights, keys):
    """``[B, S, T]`` float32 scores by the tile kernel (rows and entries padded to whole
    tiles, the padding sliced off; ``blocks``: the tile and the ``interpret`` field)."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    if s == 0 or t == 0:
        return jnp.zeros((b, s, t), jnp.float32)
    qb = min(blocks[0], next_pow2(s, MIN_DOT))
    kb = min(blocks[1], next_pow2(t, MIN_DOT))
    parts = feature_parts(d)
    width = sum(size for _, size in parts)
    dtype = jnp.promote_types(q.dtype, keys.dtype)
    sp, tp = -(-s // qb) * qb, -(-t // kb) * kb
    q = pad_axis(pad_axis(q.astype(dtype), 3, width), 1, sp)
    w = pad_axis(weights.astype(jnp.float32) * d**-0.5, 1, sp)
    keys = pad_axis(pad_axis(keys.astype(dtype), 2, width), 1, tp)
    chunk = head_chunk or h

    def make_kernel(interpret):
        def kernel(q_ref, w_ref, k_ref, o_ref):
            bi, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
            tile = [k_ref[bi, pl.ds(j * kb, kb), pl.ds(start, size)] for start, size in parts]
            scores = tile_scores(q_ref, w_ref, bi, i * qb, qb, tile, parts, h, chunk, score_dtype)
            o_ref[bi, pl.ds(i * qb, qb), pl.ds(j * kb, kb)] = scores

        return kernel

    out = jax.ShapeDtypeStruct((b, sp, tp), jnp.float32)
    grid = (b, sp // qb, tp // kb)
    scores = run_kernel(make_kernel, out, grid, "indexer_scores", q, w, keys, interpret=blocks[2])
    return scores[:, :s, :t]
