"""Phase 4 of the Mosaic fused indexer's kernel (``mosaic_topk.py``; docs/kernels.md, "The
Mosaic fused indexer (TPU)"): the picks, given each row's threshold and last tied index,
compacted into the output tiles in increasing index order, 128 lanes at a time. Ranks by a
matmul with a triangular 0/1 matrix; a pick's displacement and a valid bit as a byte, four row
slabs' bytes to an int32 lane; each pick moves left by its displacement, one bit of it per
``pltpu.roll`` step from the least significant (collision-free: displacements do not decrease
along the picks); the bytes unpacked, rotated to the row's fill level by one lane gather and
the picks' indices recovered (their place plus their displacement) into a pending 128-lane
tile, which is written to the row's next output tile once full.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from .._mosaic import MIN_QUERY_BLOCK, dot, precision

__all__ = ["INDEX_BITS", "EMPTY", "compact"]

INDEX_BITS = 24  # entry indices below 2^24 (exact in float32; EMPTY above them all)
EMPTY = (1 << INDEX_BITS) - 1  # a lane without a pick
_VALID = 128  # a packed pick's byte: this bit, and its displacement (below 128) in bits 0..6
_BYTES = 0x01010101


def _byte_mask(x: Array, bit: int) -> Array:
    """Per byte of ``x``, all ones where the byte's ``bit`` is set (no carry crosses a byte:
    each byte of ``t`` is 0 or 1, and ``255 t`` is ``(t << 8) - t``)."""
    t = (x >> bit) & _BYTES
    return (t << 8) - t


def _pack_rows(x: Array, pack: int) -> Array:
    """``[R, L]`` bytes as ``[R / pack, L]`` int32: row slab ``i`` in byte ``i``."""
    h = x.shape[0] // pack
    out = x[:h]
    for i in range(1, pack):
        out = out | (x[i * h : (i + 1) * h] << (8 * i))
    return out


def _unpack_rows(x: Array, pack: int) -> Array:
    """``_pack_rows`` undone."""
    return jnp.concatenate([(x >> (8 * i)) & 255 for i in range(pack)], axis=0)


def _moved(packed: Array, lanes: int) -> Array:
    """The compaction's moves on packed bytes (``_VALID`` and a pick's displacement; 0 where
    none): each pick left by its displacement, one bit per ``roll`` from the least significant
    (collision-free: displacements do not decrease along the picks). Four rows' bytes share a
    lane, so a ``roll`` (the XLU's, the phase's bottleneck) moves four rows at once."""
    for b in range(lanes.bit_length() - 1):
        moving = packed & _byte_mask(packed, b)  # the bytes moving 2^b lanes left
        packed = pltpu.roll(moving, lanes - (1 << b), 1) | (packed ^ moving)
    return packed


def _small_int(x: Array) -> Array:
    """Exact integers ``0 <= x < 2^23`` (float32) as int32: ``x + 2^23``'s mantissa bits (an add
    and a subtract, where a cast rounds toward zero with four operations)."""
    return jax.lax.bitcast_convert_type(x + 2.0**23, jnp.int32) - 0x4B000000


def _row_pack(qb: int) -> int:
    """The row slabs packed into one int32 lane by ``_compact``: 4 where each slab is whole
    sublane tiles (8 rows; a TPU's query blocks are multiples of 16), fewer otherwise (small
    blocks, interpreted, pack single rows)."""
    return next(p for p in (4, 2, 1) if qb % (8 * p) == 0 or (qb < MIN_QUERY_BLOCK and qb % p == 0))


def compact(step, lo, last, pend, out_ref) -> None:
    """Phase 4: the picks (keys above ``lo``, and ties at it up to index ``last``) of a grid
    ``step`` (``mosaic_topk``'s: its visible tiles, key buffer and blocks) compacted into the
    output tiles ``out_ref`` in increasing index order, through the pending tiles ``pend``."""
    qb, kt, lanes, n_out = step.blocks
    lane, pack = step.lane(), _row_pack(qb)
    lo_b, last_b = (jnp.broadcast_to(x, (qb, lanes)) for x in (lo, last))
    for t in range(n_out):
        pend[t] = jnp.full((qb, lanes), EMPTY, jnp.int32)
    row, col = (jax.lax.broadcasted_iota(jnp.int32, (lanes, lanes), a) for a in (0, 1))
    # ranks (an upper triangle) and each row's pick count on every lane (all ones): the
    # per-row values stay lane-replicated, no lane broadcast per chunk
    upper = jnp.where(row <= col, 1.0, 0.0).astype(jnp.bfloat16)
    both = jnp.concatenate([upper, jnp.ones_like(upper)], axis=1)

    def flush(tile, full, slot):
        """Write ``tile``'s rows where ``full`` to their output tile ``slot`` (visiting only
        the tiles some row writes)."""

        def put(u, _):
            pend[u] = jnp.where(full & (slot == u), tile, pend[u])
            return 0

        first = jnp.maximum(jnp.min(jnp.where(full, slot, n_out)[:, :1]), 0)
        stop = jnp.minimum(jnp.max(jnp.where(full, slot + 1, 0)[:, :1]), n_out)
        jax.lax.fori_loop(first, stop, put, 0)

    def chunk_of(keys, first, carry):
        held, fill, slot = carry
        index = first + lane
        pick = (keys > lo_b) | ((keys == lo_b) & (index <= last_b))
        ones = jnp.where(pick, 1.0, 0.0).astype(jnp.bfloat16)
        counts = _small_int(dot(ones, both, precision(ones.dtype)))
        rank, n = counts[:, :lanes], counts[:, lanes:]
        byte = jnp.where(pick, _VALID | (lane + 1 - rank), 0)  # its displacement
        byte = _unpack_rows(_moved(_pack_rows(byte, pack), lanes), pack)
        # right by the row's fill: one lane gather (seven rolls of the packed bytes before)
        place = (lane - fill) & (lanes - 1)
        byte = jnp.take_along_axis(byte, place, axis=1, mode="promise_in_bounds")
        # a pick's lane before the moves: its place among the chunk's picks (the lane less the
        # fill) plus its displacement
        at = first + place + (byte & (_VALID - 1))
        v = jnp.where(byte >= _VALID, at, EMPTY)
        merged = jnp.where(lane >= fill, v, held)
        full = fill + n >= lanes
        held = jnp.where(full, jnp.where(lane < fill, v, EMPTY), merged)
        carry = held, fill + n - jnp.where(full, lanes, 0), slot + jnp.where(full, 1, 0)
        return carry, (merged, full, slot)

    def compact(j, carry):
        flushes = []
        for c in range(kt // lanes):
            first = j * kt + c * lanes
            carry, flushed = chunk_of(step.buf[j, :, pl.ds(c * lanes, lanes)], first, carry)
            flushes.append(flushed)
        # the tile's flushes (loops, which the scheduler does not cross) after all its chunks,
        # whose moves may then overlap: a row fills at most one tile a chunk
        for flushed in flushes:
            flush(*flushed)
        return carry

    zero = jnp.zeros((qb, lanes), jnp.int32)
    carry = (jnp.full((qb, lanes), EMPTY, jnp.int32), zero, zero)
    held, fill, slot = jax.lax.fori_loop(step.t0, step.t1, compact, carry)
    flush(held, fill > 0, slot)
    for t in range(n_out):
        tile = pend[t]
        out_ref[:, t * lanes : (t + 1) * lanes] = jnp.where(tile == EMPTY, -1, tile)
