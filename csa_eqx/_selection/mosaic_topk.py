"""The Mosaic (Pallas TPU) fused indexer's kernel: scores and the exact top-k of every query in
one kernel, no ``[B, S, T]`` score ever written to HBM (``MosaicSelection``; docs/kernels.md,
"The Mosaic fused indexer (TPU)").

One grid step per query block of ``Qb`` queries of one batch row. The step visits only the key
tiles its queries may see (``key_block_ranges``: causal and document skipping, the per-block
tile range scalar-prefetched into SMEM) and works in VMEM:

1. **Scores** (``_score``). Per key tile of ``Kt`` entries, the block's queries of ``G`` heads
   at once (the queries head-major, ``[B, H, R, d]``; a group's heads stacked into the MXU's
   rows by a reshape in VMEM: ``[G*Qb, d] x [Kt, d]^T``, bf16 in, float32 out; float32 inputs at
   ``HIGHEST`` precision), then per head ``ReLU(logit) * w`` summed on the VPU, in head chunks
   and with ``score_dtype`` rounding exactly as ``csa_eqx.indexer_scores`` forms them. Each
   score becomes an order-preserving ``int32`` key (``csa_eqx._topk.signed_keys``' order:
   ``-0.0`` ties ``+0.0``; an invisible entry is ``INT32_MIN``), kept for the whole visible
   range in a ``[tiles, Qb, Kt]`` buffer.
2. **Threshold** (``_threshold``). Per query, the largest key ``x`` with at least ``k`` keys
   ``>= x``, by a search over the integer keys whose every step is one counting pass over the
   buffer (compare and add, accumulated vreg-wise a slab of 64 rows at a time, one cross-lane
   sum per pass): ``"bisect"`` (32 halvings), ``"early"`` (halvings from the row's score
   range, stopping when a count is exactly ``k``) or ``"secant"`` (interpolated guesses
   alternating with halvings).
3. **Ties** (``_last_tie``). Where more than ``k`` keys reach the threshold, the lowest-index
   ``room`` of the tied ones: a second search over the entry index (the count of tied entries
   with an index ``<= j``), no prefix sum.
4. **Compaction** (``mosaic_compact.compact``). The picks in increasing index order, into
   the output tiles 128 lanes at a time (that module's docstring says how).

Given the same scores this is ``select_topk`` exactly (ties to the lower index, picks in
increasing index order, ``-1`` past the visible count). It runs where ``run_mosaic`` says:
Pallas' TPU interpreter on the CPU (where the tests prove it), Mosaic on a TPU, a refusal
naming it elsewhere.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from .._blocks import key_block_ranges, padded_keys
from .._layout import EntryLayout
from .._mosaic import LANES, MIN_QUERY_BLOCK, dot_nt, precision, round_up, run_mosaic
from .._ops import pad_axis
from .._topk import signed_keys
from .mosaic_compact import EMPTY, INDEX_BITS, compact

__all__ = [
    "SEARCHES",
    "NAME",
    "TPU_BLOCKS",
    "TPU_VMEM",
    "mosaic_topk",
    "score_rounding",
    "fits_vmem",
    "vmem_bytes",
]

NAME = "indexer_topk_mosaic"
SEARCHES = ("bisect", "early", "secant")
INVALID = np.iinfo(np.int32).min  # the key of an invisible entry (below every score's key)
_COUNT_ROWS = 64  # the rows of a counting pass's slab (Step.count)
_MAX_STEPS = 64  # "secant": at most 32 halvings, one every other step
_VMEM_CAP = 96 << 20  # a step's estimate (vmem_bytes), of a v5e's 128 MiB
_VMEM_LIMIT = 120 << 20  # the limit asked of Mosaic: the estimate with room for its temporaries
TPU_BLOCKS = (
    f"csa_eqx's Mosaic kernel {NAME!r} needs query_block >= {MIN_QUERY_BLOCK} and "
    f"key_block >= {LANES} on a TPU (Mosaic's (8|16, 128) tiles); smaller blocks run in "
    "interpret mode only."
)
TPU_VMEM = (
    f"csa_eqx's Mosaic kernel {NAME!r} keeps every key of a batch row in VMEM: this problem's "
    "do not fit even with the smallest query block; use StreamingSelection (AutoSelection "
    "does)."
)


def score_rounding(score_dtype) -> int | None:
    """**Arguments:** a problem's ``score_dtype`` (``None``, or a float dtype with float32's
    exponent range: bfloat16).

    **Returns:** the mantissa bits scores are rounded to, or ``None`` (no rounding).
    """
    if score_dtype is None:
        return None
    info = jnp.finfo(score_dtype)
    if info.nexp != 8:
        raise NotImplementedError(
            f"the Mosaic indexer rounds scores to dtypes with float32's exponent range "
            f"(bfloat16); score_dtype={score_dtype!r} is not one"
        )
    return None if info.nmant >= 23 else int(info.nmant)


def _round_mantissa(x: Array, bits: int | None) -> Array:
    """``x`` (float32) rounded to ``bits`` mantissa bits, to nearest even, kept in float32 (as
    ``lax.reduce_precision`` with float32's exponent range, for every finite ``x``): integer
    operations only, so the kernel does not depend on how Mosaic rounds a cast."""
    if bits is None:
        return x
    drop = 23 - bits
    word = jax.lax.bitcast_convert_type(x, jnp.int32)
    half = (1 << (drop - 1)) - 1
    word = (word + half + ((word >> drop) & 1)) & ~((1 << drop) - 1)
    return jax.lax.bitcast_convert_type(word, jnp.float32)


def _count(mask: Array) -> Array:
    """float32 ``[rows, 1]`` number of ``True`` per row (exact below 2^24)."""
    return jnp.sum(jnp.where(mask, 1.0, 0.0), axis=1, keepdims=True)


def _tile_scores(q_ref, w_ref, keys, scoring: Scoring) -> Float[Array, "qb kt"]:
    """Inside the kernel: one query block's scores against one key tile, formed as
    ``csa_eqx.indexer_scores`` forms them (per head ``ReLU(q.k) * w``; the head sum in chunks,
    each chunk's sum added to the running one; with a rounding each head's logit, its weighted
    term and the total rounded to ``score_dtype``).

    **Arguments:** refs ``q [H, Qb, d]`` (head-major) and ``w [H/G, Qb, G]`` (float32,
    ``d^-1/2`` included, already rounded), the tile's ``keys [Kt, d]`` and the ``scoring``.

    **Returns:** float32 ``[Qb, Kt]``.
    """
    heads, chunk, group, bits = scoring
    qb, kt, dim = w_ref.shape[1], keys.shape[0], q_ref.shape[-1]
    exact = precision(keys.dtype)
    zeros = jnp.zeros((qb, kt), jnp.float32)
    per_chunk = chunk // group

    def heads_of(g, acc):
        q = q_ref[pl.ds(g * group, group)].reshape(group * qb, dim)  # G heads stacked
        logits = dot_nt(q, keys, exact)
        w = w_ref[g]
        for h in range(group):
            logit = _round_mantissa(logits[h * qb : (h + 1) * qb], bits)
            acc = acc + _round_mantissa(jnp.maximum(logit, 0.0) * w[:, h : h + 1], bits)
        return acc

    # the head groups unrolled (a few per tile): the scheduler may then run one group's
    # matmul under the previous group's head sum on the VPU
    total = zeros
    for c in range(heads // chunk):
        acc = zeros
        for g in range(c * per_chunk, (c + 1) * per_chunk):
            acc = heads_of(g, acc)
        total = total + acc
    return _round_mantissa(total, bits)


def _ceil_mid(lo: Array, hi: Array) -> Array:
    """``ceil((lo + hi) / 2)`` of int32 arrays without overflow."""
    return (lo | hi) - ((lo ^ hi) >> 1)


class Scoring(NamedTuple):
    """How a tile's scores are formed: the ``heads``, the heads per ``chunk`` of the head sum,
    the heads per matmul ``group`` and the mantissa ``bits`` scores are rounded to (``None``:
    none, ``score_rounding``)."""

    heads: int
    chunk: int
    group: int
    bits: int | None


class Blocks(NamedTuple):
    """A grid step's blocks: the ``query_block`` queries, the key ``tile`` of entries, the
    ``lanes`` of a chunk (128, or the tile when smaller) and the ``out_tiles`` of ``lanes``
    picks each."""

    query_block: int
    tile: int
    lanes: int
    out_tiles: int


class _Step(NamedTuple):
    """What the phases of a grid step share: its visible key tiles ``[t0, t1)``, the key buffer
    ``buf [tiles, Qb, Kt]`` (the scores as keys) and the ``blocks``."""

    t0: Array
    t1: Array
    buf: object
    blocks: Blocks

    def lane(self) -> Array:
        return jax.lax.broadcasted_iota(jnp.int32, (self.blocks.query_block, self.blocks.lanes), 1)

    def count(self, pred, operands, stop=None) -> Array:
        """Per row, how many entries of the visible tiles satisfy ``pred(keys, first index,
        *operands)`` (``operands``: ``[Qb, lanes]`` arrays, sliced to the rows of ``keys``),
        float32 ``[Qb, 1]``: accumulated vreg-wise, one cross-lane sum. A slab of rows at a
        time, its operands carried through the loop: the whole block's running counts and
        operands (64 vregs at 256 rows) filled the register file and spilled, and operands
        left to the loop were broadcast again in every iteration."""
        qb, kt, lanes = self.blocks.query_block, self.blocks.tile, self.blocks.lanes
        slab = _COUNT_ROWS if qb % _COUNT_ROWS == 0 else qb
        end = self.t1 if stop is None else jnp.minimum(self.t1, stop)

        def rows_count(rows: slice) -> Array:
            def body(j, carry):
                acc, ops = carry
                ones = []
                for c in range(kt // lanes):
                    keys = self.buf[j, rows, pl.ds(c * lanes, lanes)]
                    ones.append(jnp.where(pred(keys, j * kt + c * lanes, *ops), 1.0, 0.0))
                while len(ones) > 1:  # summed as a tree: a shorter chain of adds
                    ones = [a + b for a, b in zip(ones[::2], ones[1::2], strict=True)]
                return acc + ones[0], ops

            init = jnp.zeros((slab, lanes), jnp.float32), tuple(x[rows] for x in operands)
            acc = jax.lax.fori_loop(self.t0, end, body, init)[0]
            return jnp.sum(acc, axis=1, keepdims=True)

        sums = [rows_count(slice(r, r + slab)) for r in range(0, qb, slab)]
        return jnp.concatenate(sums, axis=0)


def _any_row(mask: Array) -> Array:
    return jnp.max(jnp.where(mask, 1.0, 0.0)) > 0.0


def _score(step: _Step, refs, scoring: Scoring):
    """Phase 1: the scores of the visible tiles, kept as keys in ``buf``; per row its visible
    count, lowest and highest score (float32 ``[Qb, 1]`` each)."""
    rows_ref, q_ref, w_ref, ends_ref, keys_ref = refs
    kt = step.blocks.tile
    q_index, q_segment = rows_ref[:, 0:1], rows_ref[:, 1:2]

    def score(j, stats):
        count, low, high = stats
        tile = keys_ref[pl.ds(pl.multiple_of(j * kt, kt), kt), :]
        scores = _tile_scores(q_ref, w_ref, tile, scoring)
        ends = ends_ref[j]
        end, segment = ends[0:1, :], ends[1:2, :]
        visible = (end >= 0) & (end <= q_index) & (segment == q_segment)
        step.buf[j] = jnp.where(visible, signed_keys(scores), INVALID)
        low = jnp.minimum(low, jnp.min(jnp.where(visible, scores, jnp.inf), 1, keepdims=True))
        high = jnp.maximum(high, jnp.max(jnp.where(visible, scores, -jnp.inf), 1, keepdims=True))
        return count + _count(visible), low, high

    column = jnp.zeros((step.blocks.query_block, 1), jnp.float32)
    init = (column, column + jnp.inf, column - jnp.inf)
    return jax.lax.fori_loop(step.t0, step.t1, score, init)


def _threshold(step: _Step, k: int, search: str, valid, low, high):
    """Phase 2: per row the threshold ``lo``, the largest key x with count(keys >= x) >= k (or
    a key with a count of exactly k), and ``(c_lo, c_hi)``: count(>= lo) >= k > count(>= hi +
    1). A row with at most k visible entries takes them all (``lo`` above no valid key)."""
    qb, lanes = step.blocks.query_block, step.blocks.lanes
    kf = float(k)
    few = valid <= kf
    lo = jnp.where(few, INVALID + 1, signed_keys(low))
    hi = jnp.where(few, INVALID + 1, signed_keys(high))
    state = (lo, hi, valid, jnp.zeros_like(valid))

    def active(state):
        lo, hi, c_lo, _ = state
        return (lo < hi) & (c_lo != kf)

    def step_to(guess, state):
        lo, hi, c_lo, c_hi = state
        x = jnp.where(active(state), guess, lo)
        x_b = jnp.broadcast_to(x, (qb, lanes))
        c = step.count(lambda keys, _, x: keys >= x, (x_b,))
        up = c >= kf
        lo, c_lo = jnp.where(up, x, lo), jnp.where(up, c, c_lo)
        return lo, jnp.where(up, hi, x - 1), c_lo, jnp.where(up, c_hi, c)

    def midpoint(state):
        return _ceil_mid(state[0], state[1])

    def interpolated(state):
        """Where count(>= x) would reach k if it fell linearly between lo and hi + 1."""
        lo, hi, c_lo, c_hi = state
        frac = (c_lo - kf) / jnp.maximum(c_lo - c_hi, 1.0)
        lo_f = lo.astype(jnp.float32)
        guess = lo_f + frac * (hi.astype(jnp.float32) - lo_f + 1.0)
        guess = jnp.clip(guess, -(2.0**31), 2.0**31 - 256).astype(jnp.int32)
        return jnp.clip(guess, lo + 1, hi)

    if search == "bisect":
        state = jax.lax.fori_loop(0, 32, lambda _, s: step_to(midpoint(s), s), state)
    else:

        def more(carry):
            n, state = carry
            return (n < _MAX_STEPS) & _any_row(active(state))

        def next_step(carry):
            n, state = carry
            guess = midpoint(state)
            if search == "secant":  # interpolate on even steps, halve on odd ones
                guess = jnp.where((n & 1) == 0, interpolated(state), guess)
            return n + 1, step_to(guess, state)

        state = jax.lax.while_loop(more, next_step, (0, state))[1]
    lo, _, c_lo, c_hi = state
    return lo, c_lo, c_hi


def _last_tie(step: _Step, k: int, lo, c_lo, c_hi):
    """Phase 3: per row the last index of the ties at ``lo`` it takes: where they exceed the
    room, the lowest-index ones, by a search over the index (at most 25 halvings of an index
    below 2^24: the cap only guards a misread value)."""
    qb, lanes, kt = step.blocks.query_block, step.blocks.lanes, step.blocks.tile
    tile_bits, lane = kt.bit_length() - 1, step.lane()
    room = float(k) - c_hi
    lo_b = jnp.broadcast_to(lo, (qb, lanes))
    none = jnp.full((qb, 1), step.buf.shape[0] * kt, jnp.int32)  # above every index

    def tied(keys, first, lo, bound):  # bound: the index tried, less the lane
        return (keys == lo) & (first <= bound)

    def tie_step(carry):
        n, (j_lo, j_hi) = carry
        mid = (j_lo + j_hi) >> 1
        mid_b = jnp.broadcast_to(mid, (qb, lanes))
        stop = (jnp.max(jnp.where(j_lo < j_hi, mid, 0)) >> tile_bits) + 1
        c = step.count(tied, (lo_b, mid_b - lane), stop)
        enough = (c >= room) | (j_lo >= j_hi)
        return n + 1, (jnp.where(enough, j_lo, mid + 1), jnp.where(enough, mid, j_hi))

    def ties_left(carry):
        n, (j_lo, j_hi) = carry
        return (n < INDEX_BITS + 2) & _any_row(j_lo < j_hi)

    tied_rows = c_lo > float(k)
    bounds = (jnp.where(tied_rows, 0, none), jnp.where(tied_rows, none - 1, none))
    return jax.lax.while_loop(ties_left, tie_step, (0, bounds))[1][0]


def _make_kernel(k: int, search: str, scoring: Scoring, blocks: Blocks):
    """The kernel of one grid step: its four phases in order."""

    def kernel(lo_ref, hi_ref, rows_ref, q_ref, w_ref, ends_ref, keys_ref, out_ref, buf, pend):
        i = pl.program_id(1)
        step = _Step(lo_ref[i], hi_ref[i], buf, blocks)
        valid, low, high = _score(step, (rows_ref, q_ref, w_ref, ends_ref, keys_ref), scoring)
        lo, c_lo, c_hi = _threshold(step, k, search, valid, low, high)
        last = _last_tie(step, k, lo, c_lo, c_hi)
        compact(step, lo, last, pend, out_ref)

    return kernel


def vmem_bytes(
    qb: int, kt: int, t_pad: int, heads: int, dim: int, group: int, k_out: int, itemsize
) -> int:
    """An upper estimate of one grid step's VMEM: the key buffer, the double-buffered blocks
    (resident keys, queries, weights, layout, output), the pending output tiles and the
    scoring's float32 temporaries."""
    buffers = 4 * t_pad * qb + 4 * k_out * qb
    blocks = t_pad * dim * itemsize + heads * qb * dim * itemsize
    blocks += 4 * (heads // group) * qb * round_up(group, LANES) + 4 * qb * LANES + 4 * t_pad * 8
    blocks += 4 * qb * k_out
    scratch = 4 * qb * kt * (group + 8)
    return buffers + 2 * blocks + scratch


def fits_vmem(
    entries: int, heads: int, dim: int, itemsize: int, key_block: int, head_group: int
) -> bool:
    """**Arguments:** a problem's ``entries``, indexer ``heads`` and ``dim``, the scoring
    dtype's ``itemsize``, the ``key_block`` and the ``head_group``.

    **Returns:** whether the kernel's smallest TPU query block, its picks aside (a few hundred
    KiB, within the room ``_VMEM_LIMIT`` leaves), fits the VMEM budget: the keys of a batch
    row stay resident, so past a few hundred thousand entries it does not."""
    t_pad = round_up(entries, key_block)
    group = math.gcd(heads, head_group)
    need = vmem_bytes(MIN_QUERY_BLOCK, key_block, t_pad, heads, dim, group, 0, itemsize)
    return need <= _VMEM_CAP


def _block_inputs(q, weights, keys, query_index, query_segment, layout, blocks, group, bits):
    """The kernel's inputs in its blocks' layouts.

    **Arguments:** ``mosaic_topk``'s arrays, the keys and layout already padded to whole key
    tiles (``padded_keys``) and in the scoring dtype, the ``blocks`` ``(Qb, Kt)``, the heads
    per matmul ``group`` and the ``score_rounding`` bits.

    **Returns:** ``(lo, hi, rows, q, w, ends, keys)``: per query block its key-tile range
    ``[lo, hi)`` (int32 ``[R / Qb]``), the query rows' index and segment ``[B, R, 2]`` (``R``:
    the sequence padded to whole blocks with rows that see nothing), the queries head-major
    ``[B, H, R, d]`` (a step's block ``[H, Qb, d]``; on a TPU XLA lays the projection out so,
    and nothing is copied before the kernel), their weights ``[B, R / Qb, H / G, Qb, G]``
    (float32, ``d^-1/2`` included, rounded), the entries' end and segment per tile
    ``[B, tiles, 2, Kt]`` and the keys ``[B, T, d]``.
    """
    b, s, heads, dim = q.shape
    qb, kt = blocks
    r = round_up(s, qb)
    w = _round_mantissa(weights.astype(jnp.float32) * dim**-0.5, bits)
    q, w = pad_axis(q.astype(keys.dtype), 1, r), pad_axis(w, 1, r)
    query_index = pad_axis(query_index.astype(jnp.int32), 1, r, -1)
    query_segment = pad_axis(query_segment.astype(jnp.int32), 1, r, -1)
    lo, hi = key_block_ranges(query_index, query_segment, layout, qb, kt)
    n_blocks, n_tiles = r // qb, keys.shape[1] // kt
    q = q.transpose(0, 2, 1, 3)
    w = w.reshape(b, n_blocks, qb, heads // group, group).transpose(0, 1, 3, 2, 4)
    rows = jnp.stack([query_index, query_segment], axis=-1)
    ends = jnp.stack([layout.end, layout.segment], axis=1).astype(jnp.int32)
    ends = ends.reshape(b, 2, n_tiles, kt).transpose(0, 2, 1, 3)
    return lo, hi, rows, q, w, ends, keys


def mosaic_topk(
    q: Float[Array, "batch seq heads dim"],
    weights: Float[Array, "batch seq heads"],
    keys: Float[Array, "batch entries dim"],
    query_index: Int[Array, "batch seq"],
    query_segment: Int[Array, "batch seq"],
    layout: EntryLayout,
    k: int,
    *,
    query_block: int = 256,
    key_block: int = 512,
    head_group: int = 16,
    head_chunk: int = 0,
    score_dtype=None,
    search: str = "early",
    interpret=None,
) -> Int[Array, "batch seq {k}"]:
    """The exact indexer top-k of every query by the Mosaic kernel (see the module docstring).

    **Arguments:**

    - ``q``: projected indexer queries ``[B, S, H, d]``; ``weights``: ``[B, S, H]`` including
        ``H^-1/2`` (``d^-1/2`` is applied here); ``keys``: ``[B, T, d]``. Scored in
        ``promote_types(q, keys)`` (bf16 on the MXU, float32 at ``HIGHEST`` precision).
    - ``query_index``, ``query_segment``, ``layout``: the visibility (``csa_eqx.Visibility``'s
        fields).
    - ``k``: picks per query (``> 0``).
    - ``query_block``: queries per grid step (a shorter sequence takes whole multiples of 16,
        padded with queries that see nothing; halved, not below 16, until the step's VMEM
        estimate fits 96 MiB); ``key_block``: entries per key tile (a power of two, a multiple
        of 128 on a TPU; smaller ones run in interpret mode only, with chunks of
        ``key_block`` lanes).
    - ``head_group``: heads stacked into one matmul (a divisor of the head chunk is used).
    - ``head_chunk`` (0 = all heads) and ``score_dtype``: as ``csa_eqx.indexer_scores``.
    - ``search``: the threshold search, one of ``SEARCHES``.
    - ``interpret``: the strategy's field (``csa_eqx._backend.kernel_interpret``: ``None``
        compiles on a TPU and interprets on the CPU).

    **Returns:** int32 ``[B, S, k]``: picks in increasing index order, ``-1`` past the visible
    count.
    """
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES} (got {search!r})")
    b, s, heads, dim = q.shape
    if s == 0 or keys.shape[1] == 0:
        return jnp.full((b, s, k), -1, jnp.int32)
    chunk = head_chunk or heads
    if heads % chunk:
        raise ValueError(f"head_chunk={chunk} must divide the {heads} indexer heads")
    bits = score_rounding(score_dtype)
    group = math.gcd(head_group, chunk)
    dtype = jnp.promote_types(q.dtype, keys.dtype)
    kt = key_block
    if kt < 1 or kt & (kt - 1) or query_block < 1:
        raise ValueError(f"key_block must be a power of two (got {kt})")
    keys, layout = padded_keys(keys.astype(dtype), layout, kt)
    t_pad = keys.shape[1]
    if t_pad >= EMPTY:
        raise ValueError(f"the Mosaic indexer takes fewer than {EMPTY} entries (got {t_pad})")
    lanes = min(LANES, kt)
    n_out = -(-k // lanes)
    itemsize = jnp.dtype(dtype).itemsize
    sizes = (t_pad, heads, dim, group, n_out * lanes, itemsize)  # vmem_bytes' after (Qb, Kt)
    qb = min(query_block, round_up(s, MIN_QUERY_BLOCK))
    while qb > MIN_QUERY_BLOCK and vmem_bytes(qb, kt, *sizes) > _VMEM_CAP:
        qb //= 2  # the largest query block whose step fits VMEM
    visibility = (query_index, query_segment, layout)
    args = _block_inputs(q, weights, keys, *visibility, (qb, kt), group, bits)
    scoring, blocks = Scoring(heads, chunk, group, bits), Blocks(qb, kt, lanes, n_out)
    call = _call(_make_kernel(k, search, scoring, blocks), blocks, args, vmem_bytes(qb, kt, *sizes))
    refusal = None
    if qb < MIN_QUERY_BLOCK or kt < LANES:
        refusal = TPU_BLOCKS
    elif not fits_vmem(t_pad, heads, dim, itemsize, kt, group):
        refusal = TPU_VMEM
    out = run_mosaic(NAME, *call, *args, interpret=interpret, tpu_refusal=refusal)
    return out[:, :s, :k]


def _call(kernel, blocks: Blocks, args: tuple, vmem: int):
    """``(build, out_shape)`` of the kernel's ``pallas_call`` over the grid ``(batch, query
    blocks)`` on ``_block_inputs``' ``args`` (``run_mosaic``'s), its VMEM limit from the step's
    estimate ``vmem``."""
    qb, kt, lanes, n_out = blocks
    b, heads, _, dim = args[3].shape
    n_blocks, n_tiles, t_pad = args[0].shape[0], args[5].shape[1], args[6].shape[1]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, n_blocks),
        in_specs=[
            pl.BlockSpec((None, qb, 2), lambda bi, i, *_: (bi, i, 0)),
            pl.BlockSpec((None, heads, qb, dim), lambda bi, i, *_: (bi, 0, i, 0)),
            pl.BlockSpec((None, None, *args[4].shape[2:]), lambda bi, i, *_: (bi, i, 0, 0, 0)),
            pl.BlockSpec((None, n_tiles, 2, kt), lambda bi, i, *_: (bi, 0, 0, 0)),
            pl.BlockSpec((None, t_pad, dim), lambda bi, i, *_: (bi, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, qb, n_out * lanes), lambda bi, i, *_: (bi, i, 0)),
        scratch_shapes=[
            pltpu.VMEM((n_tiles, qb, kt), jnp.int32),
            pltpu.VMEM((n_out, qb, lanes), jnp.int32),
        ],
    )

    def build(interpret, out_shape):
        if interpret is not False:
            params = dict(interpret=interpret)
        else:
            limit = min(int(vmem * 1.5) + (16 << 20), _VMEM_LIMIT)
            compiler = pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=limit
            )
            params = dict(compiler_params=compiler)
        return pl.pallas_call(kernel, out_shape=out_shape, grid_spec=grid_spec, name=NAME, **params)

    return build, jax.ShapeDtypeStruct((b, n_blocks * qb, n_out * lanes), jnp.int32)
