"""``TritonSelection``: the fused indexer kernel, scoring and exact top-k in one Pallas kernel
that never writes a score to memory (docs/kernels.md, "The fused indexer").

One program per ``query_block`` queries of a batch row. It visits only the key tiles one of
its queries can see (``key_block_ranges``, as ``StreamingSelection`` does) and scores each
``[query_block, key_block]`` tile in registers (``csa_eqx._triton.tile_scores``: per head a
dot, its ReLU times the head weight summed over the heads, bf16-rounded as the problem's
``score_dtype`` says). The exact top-k is built from what Triton lowers (compares, sums,
prefix sums, masked scatters; no sort, no ``top_k``):

- a **candidate buffer** per query of ``C = k + key_block`` (rounded up to whole tiles) entry
  slots, in increasing index order, held in a small per-program workspace (two int32 arrays
  of ``[B, blocks, query_block, C + key_block]``: linear in the sequence, like the output; the
  last ``key_block`` columns take the masked lanes' stores);
- a **threshold** per query: once the buffer held ``k`` entries at its last compaction, their
  ``k``-th best order key ``tau``. An entry of a later tile with a key ``<= tau`` can never be
  picked (``k`` entries with a lower index score at least as high), so a tile appends only its
  visible entries above ``tau``, by a prefix sum of the mask and one masked scatter;
- a **compaction** when a tile's candidates would overflow the buffer, and once at the end: a
  radix select over order-preserving ``uint32`` keys of the float32 scores (``_topk.py``'s:
  ``-0.0`` ties ``+0.0``), 32 counting passes over the buffer, finds the ``k``-th best key;
  entries above it and the first ties (the lower indices) stay, moved left in order by a
  second prefix sum. After the last one the buffer's first ``k`` slots are the selection.

Given the same scores this is exactly ``select_topk`` (ties to the lower index, picks in
increasing index order, ``-1`` past the visible count), so the selection equals the XLA paths'
bitwise wherever the scores do (tests/test_triton_selection.py). The queries are projected
``query_chunk`` rows at a time (``SelectionProblem.project``), one kernel call per chunk, so
the ``[B, S, H, d]`` queries never exist at once either.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Int

from .._blocks import key_block_ranges
from .._ops import pad_axis
from .._topk import _order_keys
from .._triton import (
    MIN_DOT,
    barrier,
    count,
    feature_parts,
    next_pow2,
    run_kernel,
    tile_scores,
)
from .base import AbstractSelection, SelectionProblem
from .row_chunks import kernel_row_chunks

__all__ = ["TritonSelection"]

_KEY_MAX = 0xFFFFFFFF


class TritonSelection(AbstractSelection):
    """The fused indexer (score + exact top-k in one Pallas kernel, see the module
    docstring): Triton on a GPU, interpret mode on the CPU (where it is proven, not fast).
    The selection is the other strategies' bitwise wherever the scores are.

    It scores a plain ``Visibility``: a V4.1 consumer's ``CandidateVisibility`` is refused
    (``TypeError``; ``AutoSelection`` gives such a problem to ``GatheredSelection``), and a V4.1
    candidate source's blocks are not fused yet (the candidate source's chooser,
    ``csa_eqx._selection.auto.candidate_source``, streams them).

    **Arguments:**

    - ``query_block``: queries per program (a power of two; at most the sequence's largest
        power of two is used).
    - ``key_block``: entries per key tile (a power of two). On a GPU both must be at least 16.
    - ``query_chunk``: at most this many queries projected and selected per kernel call, the
        calls' chunks balanced (0 = automatic: as many as keep their ``[B, rows, H, d]``
        queries and candidate buffers within ``problem.tiles.elements``).
    - ``interpret``: ``None`` (compiled on a GPU, interpreted on the CPU), ``True`` or
        ``False`` (``csa_eqx._backend.kernel_interpret``).
    """

    query_block: int = 64
    key_block: int = 64
    query_chunk: int = 0
    interpret: bool | None = None

    def __check_init__(self):
        for name in ("query_block", "key_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"TritonSelection.{name} must be a power of two (got {v!r})")
        v = self.query_chunk
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"TritonSelection.query_chunk must be an int >= 0 (got {v!r})")

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        qb, kb = min(self.query_block, next_pow2(problem.sizes()[1], MIN_DOT)), self.key_block
        buffer = (-(-k // kb) + 1) * kb
        sizes = _Sizes(k, qb, kb, buffer, problem.head_chunk, problem.score_dtype, self.interpret)

        def kernel(q, w, keys, layout, query_index, query_segment):
            return _select_rows(q, w, keys, query_index, query_segment, layout, sizes)

        chunks = dict(block=qb, key_block=kb, per_row=2 * (buffer + kb))
        return kernel_row_chunks(
            problem, k, kernel, "TritonSelection", **chunks, query_chunk=self.query_chunk
        )


class _Sizes(NamedTuple):
    """A call's static sizes: ``k``, the query and key blocks ``qb`` / ``kb``, the candidate
    ``buffer``'s slots, the ``head_chunk``, the ``score_dtype`` and the strategy's
    ``interpret`` field."""

    k: int
    qb: int
    kb: int
    buffer: int
    head_chunk: int
    score_dtype: object
    interpret: bool | None


def _select_rows(q, w, keys, qi, qs, layout, sizes: _Sizes):
    """One kernel call: the ``[B, R, k]`` selection of ``R`` projected queries ``q`` / ``w``
    over the (tile-padded) ``keys`` and ``layout``; the rows are padded to whole blocks with
    queries that see nothing."""
    k, qb, kb, buffer = sizes.k, sizes.qb, sizes.kb, sizes.buffer
    b, rows, h, d = q.shape
    chunk = sizes.head_chunk or h
    if h % chunk:
        raise ValueError(f"head_chunk={chunk} must divide the {h} indexer heads")
    parts = feature_parts(d)
    width = sum(size for _, size in parts)
    dtype = jnp.promote_types(q.dtype, keys.dtype)
    r = -(-rows // qb) * qb
    q = pad_axis(pad_axis(q.astype(dtype), 3, width), 1, r)
    w = pad_axis(w.astype(jnp.float32) * d**-0.5, 1, r)
    qi, qs = pad_axis(qi, 1, r, -1), pad_axis(qs, 1, r, -1)
    keys = pad_axis(keys.astype(dtype), 2, width)
    lo, hi = key_block_ranges(qi, qs, layout, qb, kb)
    n_blocks, out_width = r // qb, -(-k // kb) * kb
    wide = buffer + kb  # the last kb columns take the masked lanes' stores

    def make_kernel(interpret):
        return functools.partial(_kernel, sizes, parts, h, chunk, out_width, interpret)

    out_shape = (
        jax.ShapeDtypeStruct((b, r, out_width), jnp.int32),
        jax.ShapeDtypeStruct((b, n_blocks, qb, wide), jnp.uint32),
        jax.ShapeDtypeStruct((b, n_blocks, qb, wide), jnp.int32),
    )
    args = (lo, hi, qi, qs, layout.end, layout.segment, q, w, keys)
    grid = (b, n_blocks)
    out = run_kernel(make_kernel, out_shape, grid, "indexer_topk", *args, interpret=sizes.interpret)
    return out[0][:, :rows, :k]


def _kernel(sizes: _Sizes, parts, h: int, chunk: int, out_width: int, interpret: bool, lo_ref,
            hi_ref, qi_ref, qs_ref, end_ref, seg_ref, q_ref, w_ref, k_ref, *outs):  # fmt: skip
    """One program: the block's visible key tiles scored and their candidates appended to the
    buffer (compacted when it would overflow), then the buffer compacted once more and its
    first ``k`` slots written out."""
    out_ref, key_ref, idx_ref = outs
    qb, kb, buffer, score_dtype = sizes.qb, sizes.kb, sizes.buffer, sizes.score_dtype
    bi, i = pl.program_id(0), pl.program_id(1)
    r0 = i * qb
    q_index = qi_ref[bi, pl.ds(r0, qb)][:, None]
    q_segment = qs_ref[bi, pl.ds(r0, qb)][:, None]
    row = jax.lax.broadcasted_iota(jnp.int32, (qb, kb), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (qb, kb), 1)
    zeros = jnp.zeros((qb,), jnp.int32)
    buf = _Buffer(sizes, interpret, key_ref, idx_ref, bi, i, row, col, zeros)
    compact = buf.compact  # one function for both conds: traced once

    def tile(j, state):
        c0 = j * kb
        tile_keys = [k_ref[bi, pl.ds(c0, kb), pl.ds(start, size)] for start, size in parts]
        scores = tile_scores(q_ref, w_ref, bi, r0, qb, tile_keys, parts, h, chunk, score_dtype)
        end, seg = end_ref[bi, pl.ds(c0, kb)][None, :], seg_ref[bi, pl.ds(c0, kb)][None, :]
        visible = (end >= 0) & (end <= q_index) & (seg == q_segment)
        key = _order_keys(scores)
        cand = visible & ((state[1][:, None] == 0) | (key > state[2][:, None]))
        new = count(cand, 1)
        overflow = jnp.max(state[0] + new) > buffer
        state = jax.lax.cond(overflow, compact, lambda st: st, state)
        slot = state[0][:, None] + jnp.cumsum(cand.astype(jnp.int32), axis=1) - 1
        buf.store(key, c0 + col, jnp.where(cand, slot, buffer + col))
        barrier(interpret)
        return state[0] + new, state[1], state[2]

    state = (zeros, zeros, jnp.zeros((qb,), jnp.uint32))
    state = jax.lax.fori_loop(lo_ref[i], hi_ref[i], tile, state)
    final = jax.lax.cond(jnp.max(state[0]) > sizes.k, compact, lambda st: st, state)[0]
    for c in range(out_width // kb):
        _, idx, valid = buf.held(c, final)
        out_ref[bi, pl.ds(r0, qb), pl.ds(c * kb, kb)] = jnp.where(valid, idx, -1)


class _Buffer(NamedTuple):
    """A program's candidate buffer: its key and index refs (``[B, blocks, qb, buffer +
    kb]``), the program's indices ``bi`` / ``i`` and its ``[qb, kb]`` row and column iotas."""

    sizes: _Sizes
    interpret: bool
    key_ref: object
    idx_ref: object
    bi: object
    i: object
    row: Array
    col: Array
    zeros: Array

    def store(self, keys_, idx, slot):
        plgpu.store(self.key_ref.at[self.bi, self.i, self.row, slot], keys_)
        plgpu.store(self.idx_ref.at[self.bi, self.i, self.row, slot], idx)

    def held(self, c, held_count):
        """Chunk ``c`` of the buffer: keys, entry indices and which slots hold one."""
        kb = self.sizes.kb
        cols = pl.ds(c * kb, kb)
        valid = c * kb + self.col < held_count[:, None]
        return self.key_ref[self.bi, self.i, :, cols], self.idx_ref[self.bi, self.i, :, cols], valid

    def compact(self, state):
        """The buffer reduced to its best ``k`` (ties to the lower slot), kept in order; returns
        ``(held, full, tau)``."""
        k, qb, buffer, zeros, col = (
            self.sizes.k,
            self.sizes.qb,
            self.sizes.buffer,
            self.zeros,
            self.col,
        )
        held_count = state[0]
        n_chunks = buffer // self.sizes.kb

        def chunk_of(c):
            return self.held(c, held_count)

        def at_least(mid):  # per query: buffer keys >= mid (empty slots count as key 0)
            def body(c, acc):
                key, _, valid = chunk_of(c)
                return acc + count(jnp.where(valid, key, 0) >= mid[:, None], 1)

            return jax.lax.fori_loop(0, n_chunks, body, zeros)

        def halve(_, bounds):  # as exact_topk: at least k keys >= lo, none > hi would do
            lo_, hi_ = bounds
            mid = lo_ + (hi_ - lo_) // 2 + (hi_ - lo_) % 2
            enough = at_least(mid) >= k
            return jnp.where(enough, mid, lo_), jnp.where(enough, hi_, mid - 1)

        first = (jnp.zeros((qb,), jnp.uint32), jnp.full((qb,), _KEY_MAX, jnp.uint32))
        kth = jax.lax.fori_loop(0, 32, halve, first)[0][:, None]

        def above(c, acc):
            key, _, valid = chunk_of(c)
            return acc + count(valid & (key > kth), 1)

        room = (k - jax.lax.fori_loop(0, n_chunks, above, zeros))[:, None]

        def move(c, carry):
            kept, ties = carry
            key, idx, valid = chunk_of(c)
            tied = valid & (key == kth)
            rank = ties[:, None] + jnp.cumsum(tied.astype(jnp.int32), axis=1)
            pick = valid & ((key > kth) | (tied & (rank <= room)))
            slot = kept[:, None] + jnp.cumsum(pick.astype(jnp.int32), axis=1) - 1
            barrier(self.interpret)  # every lane has read the chunk before any moves
            self.store(key, idx, jnp.where(pick, slot, buffer + col))
            barrier(self.interpret)
            return kept + count(pick, 1), ties + count(tied, 1)

        kept = jax.lax.fori_loop(0, n_chunks, move, (zeros, zeros))[0]
        return kept, (held_count >= k).astype(jnp.int32), kth[:, 0]
