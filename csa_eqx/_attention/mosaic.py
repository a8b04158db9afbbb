"""``MosaicAttention``: the sparse attention over ``csa_eqx.Reads`` as Pallas TPU (Mosaic)
kernels, forward and backward (docs/kernels.md, "The Mosaic attention kernel (TPU)"; the kernels
and their layouts: ``mosaic_kernels.py``).

This module turns the reads into the kernels' sources (plain XLA, once per call): each distinct
key / value table (zeroed where a row is non-finite, cast to the queries' dtype) into granule
words; ``GatheredRows`` into ``"rows"`` (per-row DMAs) or ``"tiles"`` sources (a masked pass over
the table's tiles), as ``gather`` says or a cost model measured on a TPU v5e chooses;
``DenseKeys`` into a ``"dense"`` source (with ``picks``, each query's visible picks: a
``"tiles"`` source whose counts the kernel masks by the dense source's visibility rule, or, read
as rows, the picks that rule keeps, gathered like ``GatheredRows``); ``BandRows`` into a
``"band"`` source (its token rows padded so that every query block's slab starts at an aligned
row). It sizes the blocks (the query block from the heads: ``auto_query_block``), keeps the
query-side arrays unpadded where padding them would double them (``Config.narrow``) and decides
what lives in VMEM (``resident`` tables, the backward's gradient tables, a band's included) from
an estimate of each kernel's VMEM (``mosaic_kernels.vmem_bytes``), and refuses with a
``ValueError`` what cannot fit. Which queries a non-finite row poisons (and a non-finite query)
is decided here too, by the reference's rule (``XlaAttention``), only when there is a non-finite
row (``lax.cond``; the picks' check in blocks of ``POISON_ELEMENTS``). The forward kernel is
told which queries live (the metadata's row 3) and writes NaN for the others; the
non-finite queries (and in the backward the poisoned queries' cotangents) are zeroed inside
the ``custom_vjp``, where XLA fuses the masks into the copies to the kernels' layout. No pass
of its own masks the queries, the output or ``dq`` (each was one of 2 GiB over V4-Flash's
``[32k, 64, 512]`` rows: its fwd+bwd at 32k, compiled for a TPU, accessed 108.1 GiB with
them, 100.3 without; the same temporaries).

The kernels' ``custom_vjp`` takes the natural arrays (queries, tables, sinks); its backward
repacks them, runs the backward kernel (with a configuration of its own: gradient tables in
VMEM or HBM; rows sources whose gradient table does not fit VMEM read as tiles), overlap-adds
the slab gradients of a band whose gradient table is not in VMEM and forms the sinks' gradient
from ``lse``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._backend import Interpret
from .._layout import entry_visibility
from .._mosaic import LANES, round_up
from .._ops import pad_axis, summed_like, varying_like
from . import mosaic_kernels as K
from .base import AbstractAttentionKernel, require_exact_softmax, require_keys
from .reads import DenseKeys, Reads, gather_keys, nonfinite_rows, zero_rows

__all__ = ["MosaicAttention"]

GATHERS = ("auto", "rows", "tiles")
GRADIENTS = ("auto", "vmem", "hbm")
QUERY_PAD = -(2**31)  # the segment of padded query rows: no key row holds it
KEY_PAD = -(2**31) + 1  # the segment of padded band rows: no query holds it
# The cost model of the automatic gather (TPU v5e, JAX 0.10.2; docs/kernels.md): a row DMA
# costs ~20.5 ns whatever its size (V4-Flash CSA at 8k: 4.2M rows in 84 ms; V3.2 at 8k: 16.8M
# in 361 ms), the tiles pass runs at ~136 TFLOP/s of its own (masked, dense) work (V4-Flash CSA
# at 32k: 19.3 TFLOP in 141.6 ms).
ROW_SECONDS = 20.5e-9
TILE_FLOPS = 136e12
STEP_ROWS = 1024  # softmax rows per grid step of the automatic tiles blocks (chip-compiled)
QUERY_BLOCKS = (16, 64)  # the automatic query block's range (see ``auto_query_block``)
MAX_CHUNK = 512  # the automatic rows chunk's largest (see ``auto_key_block``)
POISON_ELEMENTS = 2**20  # picks per block of the non-finite check (``_picks_poison``)
AUTO_SHARE = 0.8  # of the VMEM limit, for the automatic choices (the estimate is not exact)


class MosaicAttention(AbstractAttentionKernel):
    """The sparse attention kernel for a TPU (Pallas' Mosaic backend; interpreted on the CPU,
    where it is proven against ``XlaAttention``, not fast; refused at lowering for a GPU).
    Every kind of ``Reads`` is taken: gathered rows, a band (with ``extend``'s history), dense
    entries (with or without picks), values of their own or the keys' first features (MLA),
    sinks. One grid step runs ``query_block`` queries x ``head_block`` heads through one online
    softmax over everything they read. Its softmax is the exact one: numerics that round the
    attention (``DeepSeekInference``) are refused with a ``ValueError``. The ``query_block``
    that ``Execution`` passes (sized for XLA's buffers) is ignored.

    The defaults are ``AutoAttention``'s choice on a TPU: gathered rows as tiles unless the
    measured cost model says row DMAs are cheaper (decoding, very long sequences), tables
    resident in VMEM and the backward's gradient tables in VMEM where they fit (docs/kernels.md,
    "The Mosaic attention kernel (TPU)").

    **Arguments:**

    - ``query_block``: queries per grid step (a multiple of 8; 0: automatic,
        ``auto_query_block``: 16 for 64 heads or more, up to 64 for 16 heads or fewer).
    - ``head_block``: heads per grid step (0: automatic, ``1024 / query_block`` heads for tiles,
        all for rows; else a multiple of 8 for float32 and of 16 for bfloat16 queries).
    - ``key_block``: gathered rows per chunk (``gather="rows"``; 0: automatic,
        ``auto_key_block``; else a multiple of 8, 128 or more on a TPU).
    - ``tile_block``: table rows per tile (tiles and dense entries; a multiple of 128).
    - ``gather``: how ``GatheredRows`` are read: ``"rows"`` (each query's rows by DMA, in
        chunks of ``key_block``), ``"tiles"`` (the table's tiles up to the query block's
        largest index, masked to each query's picks) or ``"auto"``.
    - ``resident``: hold each gathered / dense table in VMEM for a whole batch row (rows copied
        by vector loads, tiles read in place) instead of fetching from HBM (``None``: where it fits,
        for tiles).
    - ``gradients``: where the backward accumulates the tables' float32 gradients: ``"vmem"``,
        ``"hbm"`` (tile by tile; a rows source's backward then reads its rows as tiles; a
        band's as one slab per query block) or ``"auto"`` (VMEM where it fits; a band's
        gradient table in VMEM where it fits but for ``"hbm"``).
    - ``vmem_limit_bytes``: Mosaic's scoped VMEM limit (the v5e has 128 MiB).
    - ``interpret``: ``None`` (compiled on a TPU, interpreted on the CPU: decided when the
        program is traced), ``True``, ``False`` or a ``pltpu.InterpretParams`` (Pallas' TPU
        interpreter: simulated memories, out-of-bounds reads raising; it carries IO effects,
        so only for the kernel alone: no ``jax.checkpoint`` or ``vmap`` around it).
    """

    query_block: int = eqx.field(static=True, default=0)
    head_block: int = eqx.field(static=True, default=0)
    key_block: int = eqx.field(static=True, default=0)
    tile_block: int = eqx.field(static=True, default=512)
    gather: str = eqx.field(static=True, default="auto")
    resident: bool | None = eqx.field(static=True, default=None)
    gradients: str = eqx.field(static=True, default="auto")
    vmem_limit_bytes: int = eqx.field(static=True, default=100 * 2**20)
    interpret: Interpret = eqx.field(static=True, default=None)

    is_kernel = True

    def __check_init__(self):
        for name, least in (("key_block", 0), ("tile_block", 1), ("vmem_limit_bytes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"MosaicAttention.{name} must be an int >= {least} (got {v!r})")
        for name, multiple in (("key_block", 8), ("tile_block", LANES)):
            if getattr(self, name) % multiple:
                raise ValueError(
                    f"MosaicAttention.{name} must be a multiple of {multiple} "
                    f"(got {getattr(self, name)})"
                )
        qb = self.query_block
        if not isinstance(qb, int) or isinstance(qb, bool) or qb < 0 or qb % 8:
            raise ValueError(
                f"MosaicAttention.query_block must be 0 or a multiple of 8 (got {qb!r})"
            )
        h = self.head_block
        if not isinstance(h, int) or isinstance(h, bool) or h < 0 or h % 8:
            raise ValueError(f"MosaicAttention.head_block must be 0 or a multiple of 8 (got {h!r})")
        for name, allowed in (("gather", GATHERS), ("gradients", GRADIENTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"MosaicAttention.{name} must be one of {allowed} (got {getattr(self, name)!r})"
                )
        if self.resident is not None and not isinstance(self.resident, bool):
            raise ValueError(
                f"MosaicAttention.resident must be None or a bool (got {self.resident!r})"
            )

    def query_block_for(self, batch, heads, reads, tiles) -> int:
        """**Returns:** the queries the kernel's grid steps take (``query_block``, or
        ``auto_query_block(heads)``)."""
        return self.query_block or auto_query_block(heads)

    def attend(
        self, q, reads: Reads, sinks, scale, *, return_lse=False, query_block, numerics=None
    ):
        del query_block  # the grid steps take query_block_for's queries
        require_exact_softmax(self, numerics)
        require_keys(reads)
        if q.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"MosaicAttention takes float32 or bfloat16 queries (got {q.dtype})")
        b, s, h, d = q.shape
        if s == 0:
            out = jnp.zeros((b, s, h, _value_width(reads, d)), q.dtype)
            return (out, jnp.zeros((b, s, h), jnp.float32)) if return_lse else out
        plan = _plan(self, q, reads, sinks is not None, float(scale))
        sink = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
        out, lse = _attention(plan.static, q, sink, plan.floats, plan.ints)
        lse = jnp.where(plan.ints.live[:, :, None], lse, jnp.nan)
        return (out, lse) if return_lse else out

    def replay(self, q, reads: Reads, sinks, scale, out, lse, *, query_block=0, numerics=None):
        """The attention whose forward already ran: ``(out, lse)`` as given (``attend``'s with
        ``return_lse``, on these very arguments), differentiable as ``attend``: its backward
        runs the backward kernel on them and no forward kernel (V3.2's head groups keep
        ``out`` and ``lse`` for their backward, ``csa_eqx._layers.v32.in_head_groups``). The
        plain XLA preparation of the reads runs again (the backward needs its tables).

        **Arguments:** as ``attend``'s, and its outputs ``out [B, S, H, vdim]`` and ``lse
        [B, S, H]`` (``NaN`` for a poisoned query, as ``attend`` returns them).

        **Returns:** ``(out, lse)``, equal to the given ones."""
        del query_block
        require_exact_softmax(self, numerics)
        require_keys(reads)
        if q.shape[1] == 0:
            return out, lse
        plan = _plan(self, q, reads, sinks is not None, float(scale))
        sink = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks.astype(jnp.float32)
        live = plan.ints.live[:, :, None]
        # a poisoned query's lse is NaN, its cotangents zero: +inf gives its weights exactly
        # the zeros the kernel's own finite lse gives them (no NaN * 0 in the backward kernel)
        kernel_lse = jnp.where(live, lse, jnp.inf)
        out, kernel_lse = _replayed(plan.static, q, sink, plan.floats, plan.ints, out, kernel_lse)
        return out, jnp.where(live, kernel_lse, jnp.nan)


class _Static(NamedTuple):
    """What the ``custom_vjp`` needs besides the arrays: the forward's and the backward's kernel
    ``config``, the natural sizes (queries, heads, key and value widths) and, per table, its
    natural rows and the zero rows before them in its words (a band's ``pad``)."""

    config: K.Config
    backward: K.Config
    seq: int
    heads: int
    key_width: int
    value_width: int
    natural_rows: tuple[int, ...]
    front: tuple[int, ...]


class _Ints(NamedTuple):
    """The int arrays of a call: tile counts, per-query metadata (its row 3 ``live``), each
    source's array, ``live [B, S]``: the queries no non-finite row poisons (the others'
    outputs are NaN, their cotangents read as zeros) and ``finite_q [B, S]``: the queries
    whose own values are finite (the others read as zeros)."""

    ntiles: Array
    qmeta: Array
    sources: tuple
    live: Array
    finite_q: Array


class _Plan(NamedTuple):
    static: _Static
    floats: tuple
    ints: _Ints


def _value_width(reads: Reads, width: int) -> int:
    """The output width: the first read set's values give it (of their own, or the keys' first
    ``value_width`` features), else the keys' ``width``."""
    for r in (*reads.gathered, reads.dense):
        if r is not None and r.value_width is not None:
            return r.value_width
    for r in (*reads.gathered, reads.band, reads.dense):
        if r is not None and r.values is not None:
            return r.values.shape[-1]
    return width


def _if_bad(bad: Array, flags, shape) -> Array:
    """``flags()`` where some row in ``bad`` is non-finite, else ``False`` (formed only then)."""
    return jax.lax.cond(jnp.any(bad), flags, lambda: varying_like(jnp.zeros(shape, bool), bad))


def _picks_poison(bad, idx, dense: DenseKeys | None = None) -> Array:
    """bool ``[B, S]``: query ``t`` picked (``idx [B, S, k]``, ``-1``: nothing) a flagged row,
    ``POISON_ELEMENTS`` picks at a time (the gather's index arrays are a block's, not the
    whole ``[B, S, k]``'s); the last block ends at ``S`` (overlapping the one before). With a
    ``DenseKeys``, only the picks its queries see (``DenseKeys.picked_rows``' rule)."""
    b, s, k = idx.shape
    n = min(s, max(1, POISON_ELEMENTS // max(b * k, 1)))

    def block(i, acc):
        start = jnp.minimum(i * n, s - n)
        rows = jax.lax.dynamic_slice_in_dim(idx, start, n, 1)
        if dense is not None:
            query = (dense.query_index, dense.query_segment)
            part = (jax.lax.dynamic_slice_in_dim(a, start, n, 1) for a in query)
            rows = dense._replace(query_index=next(part), query_segment=next(part), picks=rows)
            rows = rows.picked_rows().indices
        hit = jnp.any((rows >= 0) & gather_keys(bad[..., None], rows)[..., 0], axis=-1)
        return jax.lax.dynamic_update_slice_in_dim(acc, hit, start, 1)

    acc = varying_like(jnp.zeros((b, s), bool), idx, bad, dense)
    return jax.lax.fori_loop(0, -(-s // n), block, acc)


def _band_poison(bad, key_segment, segment, window: int, before: int) -> Array:
    """bool ``[B, S]``: query ``t`` reads a flagged key row of its window (rows
    ``before + t - w``, ``0 <= w < window``, that exist and hold its segment)."""
    b, s = segment.shape
    bad = jnp.pad(bad, [(0, 0), (window, 0)])
    key_segment = jnp.pad(key_segment, [(0, 0), (window, 0)], constant_values=KEY_PAD)

    def lag(w, acc):
        start = window + before - w
        rows_bad = jax.lax.dynamic_slice_in_dim(bad, start, s, 1)
        rows_segment = jax.lax.dynamic_slice_in_dim(key_segment, start, s, 1)
        return acc | (rows_bad & (rows_segment == segment))

    acc = varying_like(jnp.zeros((b, s), bool), bad, key_segment, segment)
    return jax.lax.fori_loop(0, window, lag, acc)


def gather_seconds(gather: str, seq: int, sets, heads: int, width: int, tile: int, qb: int):
    """The cost model of a call's gathered sets (module constants; docs/kernels.md): row DMAs
    cost ``ROW_SECONDS`` each (one per query and index column); the tiles pass computes every
    row of the tiles a query block visits for all its queries and heads at ``TILE_FLOPS``, a
    block visiting the rows up to its largest pick: ``T - min(S, T) / 2`` rows on average (half
    the table when the queries span it, as in a prefill; all of it for a few queries at its
    end, as in decoding).

    **Arguments:** ``gather`` (``"rows"`` or ``"tiles"``), the queries ``seq``, the ``sets``
    (``(table rows T, index columns k)`` each), the (padded) ``heads``, the keys' and values'
    (padded) ``width`` summed, the ``tile`` and the query block ``qb``.

    **Returns:** the modelled seconds of the forward.
    """
    if gather == "rows":
        return sum(ROW_SECONDS * seq * k for _, k in sets)
    blocks = -(-seq // qb)
    total = 0.0
    for rows, _ in sets:
        visited = (rows - min(seq, rows) / 2) / tile + 0.5  # tiles, the last one partly
        total += blocks * visited * qb * heads * tile * width * 2 / TILE_FLOPS
    return total


def auto_query_block(heads: int) -> int:
    """The automatic query block: the power of two of queries whose heads (padded to 16) make
    at most ``STEP_ROWS`` softmax rows a step, within ``QUERY_BLOCKS`` (64 queries for 16
    heads or fewer, 16 for 64 heads or more). Few-head layers take the larger block: a band's
    slab is ``window + Qb`` rows per ``Qb`` queries, so its reads and the backward's slab
    gradients shrink with it (window 128: 9x the block's own rows at 16 queries, 3x at 64)."""
    low, high = QUERY_BLOCKS
    fit = STEP_ROWS // round_up(heads, 16)
    return min(high, max(low, 1 << (fit.bit_length() - 1) if fit else 0))


def auto_key_block(width: int) -> int:
    """The automatic rows chunk for a query's ``width`` index columns: the fewest chunks of at
    most ``MAX_CHUNK`` rows, each a whole number of 128 (V4-Flash's 512 picks: one chunk of
    512; V3.2's 2048: four). Fewer, larger chunks pay fewer online-softmax updates and fixed
    costs per row: V4-Flash CSA's rows forward at 32k on the chip took 186 / 162 / 141 ms at
    chunks of 128 / 256 / 512 (docs/kernels.md)."""
    n = -(-width // MAX_CHUNK)
    return round_up(-(-width // n), LANES)


def _tiles_ints(idx: Array, nq: int, qb: int, tile: int):
    """A tiles source's int arrays (its indices ``[B, seq, width]``; the kernel transposes
    each block itself) and its tile counts ``[B, n_q]`` (up to the block's largest index)."""
    b, _, width = idx.shape
    counts = (jnp.max(idx.reshape(b, nq, qb * width), axis=-1) + tile) // tile
    return (idx,), counts


def _entry_meta(dense: DenseKeys, tile: int) -> Array:
    """int32 ``[B, rows / tile, 8, tile]``: the entries' end (row 0) and segment (row 1) per
    tile (padded entries: end ``-1``, seen by no query), the kernel's visibility rule's."""
    b, t = dense.layout.end.shape
    rows = round_up(t, tile)
    end = pad_axis(dense.layout.end.astype(jnp.int32), 1, rows, -1)
    segment = pad_axis(dense.layout.segment.astype(jnp.int32), 1, rows)
    emeta = jnp.zeros((b, 8, rows), jnp.int32).at[:, 0].set(end).at[:, 1].set(segment)
    return emeta.reshape(b, 8, rows // tile, tile).transpose(0, 2, 1, 3)


def _query_meta(dense: DenseKeys, sp: int) -> dict[int, Array]:
    """The per-query metadata columns the visibility rule reads: 1, each query's index; 2, its
    segment (padded queries: index ``-1``, see nothing)."""
    return {
        1: pad_axis(dense.query_index.astype(jnp.int32), 1, sp, -1),
        2: pad_axis(dense.query_segment.astype(jnp.int32), 1, sp, QUERY_PAD),
    }


def _plan(kernel: MosaicAttention, q, reads: Reads, has_sinks: bool, scale: float) -> _Plan:
    """The kernels' sources, tables, int arrays and configurations for ``reads`` (see the
    module docstring)."""
    b, s, h, d = q.shape
    packed = q.dtype == jnp.bfloat16
    per, sublanes = (2, 16) if packed else (1, 8)
    qb, tile = kernel.query_block_for(b, h, reads, None), kernel.tile_block
    sp = round_up(s, qb)
    nq = sp // qb
    value_width = _value_width(reads, d)
    key_blocks, value_blocks = -(-d // LANES), -(-value_width // LANES)
    heads = round_up(h, sublanes)
    gathered, dense, picked = list(reads.gathered), reads.dense, None
    if dense is not None and dense.picks is not None:  # each query's visible picks
        dense, picked = None, dense
    gather = kernel.gather
    if gather == "auto":
        sets = [(g.keys.shape[1], g.indices.shape[-1]) for g in gathered]
        if picked is not None:
            sets.append((picked.keys.shape[1], picked.picks.shape[-1]))
        width = LANES * (key_blocks + value_blocks)
        rows, tiles = (gather_seconds(way, s, sets, heads, width, tile, qb) for way in GATHERS[1:])
        gather = "rows" if sets and rows < tiles else "tiles"
    if picked is not None and gather == "rows":  # the visible picks as gathered rows
        gathered.append(picked.picked_rows())
        picked = None
    hb = kernel.head_block
    if not hb:  # rows: every head reads a fetched row; tiles: STEP_ROWS softmax rows a step
        hb = (
            heads
            if gather == "rows"
            else min(heads, max(STEP_ROWS // qb // sublanes, 1) * sublanes)
        )
    if hb % sublanes:
        raise ValueError(
            f"MosaicAttention.head_block must be a multiple of {sublanes} for {q.dtype} queries "
            f"(got {hb})"
        )
    i32 = jnp.int32
    q_bad = ~jnp.all(jnp.isfinite(q), axis=(2, 3))
    poison = q_bad
    tables: list[dict] = []
    pairs: dict = {}

    def table(keys, values, value_width) -> int:
        key = (id(keys), id(values), value_width)
        if key not in pairs:
            bad = nonfinite_rows(keys, values)
            tables.append(
                dict(keys=keys, values=values, bad=bad, rows=keys.shape[1], front=0, kind="rows")
            )
            pairs[key] = len(tables) - 1
        return pairs[key]

    widest = max((max(g.indices.shape[-1], 1) for g in gathered), default=1)
    chunk = kernel.key_block or auto_key_block(widest)
    sources, ints, counts, meta = [], [], [], {}
    for g in gathered:
        t = table(g.keys, g.values, g.value_width)
        idx = g.indices.astype(i32)

        reads_bad = functools.partial(_picks_poison, tables[t]["bad"], idx)
        poison = poison | _if_bad(tables[t]["bad"], reads_bad, (b, s))
        width = round_up(max(idx.shape[-1], 1), chunk if gather == "rows" else 8)
        idx = pad_axis(pad_axis(idx, 2, width, -1), 1, sp, -1)
        if gather == "rows":
            ints.append((idx, idx.reshape(b, -1, chunk)))
            sources.append(K.Source("rows", t, width))
        else:
            tables[t]["kind"] = "tiles"
            src_ints, src_counts = _tiles_ints(idx, nq, qb, tile)
            counts.append(src_counts)
            ints.append(src_ints)
            sources.append(K.Source("tiles", t, width, slot=len(counts) - 1))
    if picked is not None:  # tiles: the picks counted, each masked by the entries' visibility
        t = table(picked.keys, picked.values, picked.value_width)
        tables[t]["kind"] = "tiles"
        idx = picked.picks.astype(i32)
        idx = pad_axis(pad_axis(idx, 2, round_up(max(idx.shape[-1], 1), 8), -1), 1, sp, -1)
        src_ints, src_counts = _tiles_ints(idx, nq, qb, tile)
        counts.append(src_counts)
        ints.append((*src_ints, _entry_meta(picked, tile)))
        sources.append(K.Source("tiles", t, idx.shape[-1], slot=len(counts) - 1, visible=True))
        meta.update(_query_meta(picked, sp))

        picks_bad = functools.partial(_picks_poison, tables[t]["bad"], picked.picks, picked)
        poison = poison | _if_bad(tables[t]["bad"], picks_bad, (b, s))
    if dense is not None:
        t = table(dense.keys, dense.values, dense.value_width)
        tables[t]["kind"] = "tiles"
        entry_meta, query_meta = _entry_meta(dense, tile), _query_meta(dense, sp)
        end = entry_meta[:, :, 0].reshape(b, -1)  # the padded entries' ends, tile by tile
        top = jnp.max(query_meta[1].reshape(b, nq, qb), axis=-1)  # each block's last index
        closed = (end[:, None, :] >= 0) & (end[:, None, :] <= top[:, :, None])
        last = jnp.max(jnp.where(closed, jnp.arange(end.shape[1], dtype=i32), -1), axis=-1)
        counts.append((last + tile) // tile)
        ints.append((entry_meta,))
        sources.append(K.Source("dense", t, slot=len(counts) - 1))
        meta.update(query_meta)

        def sees_bad(bad=tables[t]["bad"], dense=dense):
            seen = entry_visibility(dense.query_index, dense.query_segment, dense.layout)
            return jnp.any(seen & bad[:, None, :], axis=-1)

        poison = poison | _if_bad(tables[t]["bad"], sees_bad, (b, s))
    band = reads.band
    if band is not None:
        window = band.window
        before = 0 if band.history is None else window - 1
        front = round_up(window - 1, qb)
        pad = front - before
        keys = band.keys[:, : before + s]
        values = None if band.values is None else band.values[:, : before + s]
        bad = nonfinite_rows(keys, values)
        tables.append(
            dict(keys=keys, values=values, bad=bad, rows=sp + front, front=pad, kind="band")
        )
        key_segment = band.segment
        if before:
            key_segment = jnp.concatenate([band.history, band.segment], axis=1)
        key_segment = key_segment.astype(i32)
        padded = pad_axis(key_segment, 1, sp + front, KEY_PAD, front=pad)
        starts = (jnp.arange(nq) * qb)[:, None] + jnp.arange(front + qb)
        ints.append((padded[:, starts][:, :, None, :],))
        sources.append(K.Source("band", len(tables) - 1, window, front))
        meta[0] = pad_axis(band.segment.astype(i32), 1, sp, QUERY_PAD)

        def window_bad(bad=bad, key_segment=key_segment):
            return _band_poison(bad, key_segment, band.segment, window, before)

        poison = poison | _if_bad(bad, window_bad, (b, s))
    meta[3] = pad_axis((~poison).astype(i32), 1, sp)
    rows = [meta.get(k, jnp.zeros((b, sp), i32)) for k in range(4)]
    qmeta = K.query_meta(jnp.stack(rows, axis=1), qb)
    ntiles = jnp.stack(counts).reshape(-1).astype(i32) if counts else jnp.zeros((1,), i32)
    floats = []
    for t in tables:
        keys = zero_rows(t["keys"], t["bad"]).astype(q.dtype)
        values = t["values"]
        values = None if values is None else zero_rows(values, t["bad"]).astype(q.dtype)
        floats.append((keys, values))

    # one head block takes every head, and its padded rows (heads to whole sublane tiles,
    # features to whole 128-lane blocks) are twice the heads' features or more (few heads,
    # narrow heads): the query-side arrays stay [B, seq, h * width] in HBM
    padded = heads * LANES * (key_blocks + value_blocks) >= 2 * h * (d + value_width)
    narrow = (h, d, value_width) if hb >= heads and padded else ()

    def config(resident: bool, hbm: bool, slabs: bool) -> K.Config:
        specs = []
        for t, (_, values) in zip(tables, floats, strict=True):
            rows = round_up(t["rows"], tile) if t["kind"] == "tiles" else t["rows"]
            words = 0 if values is None else -(-value_blocks // per)
            in_vmem = resident and t["kind"] != "band"
            grads = {"tiles": hbm, "band": slabs}.get(t["kind"], False)
            specs.append(K.Table(rows, -(-key_blocks // per), words, packed, in_vmem, grads))
        return K.Config(
            tables=tuple(specs), sources=tuple(sources), batch=b, queries=s, seq=sp,
            heads=round_up(h, hb), head_block=hb, query_block=qb, key_blocks=key_blocks,
            value_blocks=value_blocks, chunk=chunk, tile=tile, scale=scale,
            has_sinks=has_sinks, dtype=jnp.dtype(q.dtype).name,
            vmem_limit=kernel.vmem_limit_bytes, narrow=narrow, interpret=kernel.interpret,
        )  # fmt: skip

    tabled = bool(gathered or dense is not None)
    forward, backward = _configs(kernel, config, gather, tabled, band is not None)
    _check_vmem(forward, False)
    static = _Static(
        forward,
        backward,
        seq=s,
        heads=h,
        key_width=d,
        value_width=value_width,
        natural_rows=tuple(k.shape[1] for k, _ in floats),
        front=tuple(t["front"] for t in tables),
    )
    return _Plan(static, tuple(floats), _Ints(ntiles, qmeta, tuple(ints), ~poison, ~q_bad))


def _as_tiles(config: K.Config) -> K.Config:
    """``config`` with its rows sources read as tiles (their tables tiled, in HBM, with HBM
    gradient tables): the backward of rows sources whose VMEM gradient table does not fit."""
    tables, sources = list(config.tables), []
    slots = sum(src.kind in ("tiles", "dense") for src in config.sources)
    for src in config.sources:
        if src.kind == "rows":
            rows = round_up(tables[src.table].rows, config.tile)
            tables[src.table] = tables[src.table]._replace(
                rows=rows, resident=False, hbm_grads=True
            )
            src = src._replace(kind="tiles", slot=slots)
            slots += 1
        sources.append(src)
    return config._replace(tables=tuple(tables), sources=tuple(sources))


def _configs(kernel: MosaicAttention, config, gather: str, tabled: bool, banded: bool):
    """The forward's and the backward's kernel configurations: the first of the candidate
    (``resident``, HBM gradients, band slabs) whose kernels fit ``AUTO_SHARE`` of the VMEM
    limit (VMEM gradient tables first, the measured path, unless ``kernel.gradients`` says;
    within each, a band's gradient table in VMEM before slabs in HBM (only slabs for
    ``"hbm"``), and resident tables before fetched ones, for tiles and where
    ``kernel.resident`` allows), else the leanest; the backward's rows sources read as tiles
    when their gradients go to HBM."""
    if kernel.resident is not None:
        residents = [kernel.resident]
    else:
        residents = [True, False] if tabled and gather == "tiles" else [False]
    grads = {"vmem": [False], "hbm": [True], "auto": [False, True]}[kernel.gradients]
    slabs = [True] if kernel.gradients == "hbm" or not banded else [False, True]
    budget = AUTO_SHARE * kernel.vmem_limit_bytes
    candidates = [(res, hbm, slab) for hbm in grads for slab in slabs for res in residents]
    for res, hbm, slab in candidates:
        forward = config(res, hbm, slab)
        backward = _as_tiles(forward) if hbm else forward
        if K.vmem_bytes(forward, False) <= budget and K.vmem_bytes(backward, True) <= budget:
            return forward, backward
    forward = config(*candidates[-1])
    return forward, _as_tiles(forward) if candidates[-1][1] else forward


def _check_vmem(config: K.Config, backward: bool) -> None:
    """A ``ValueError`` when a kernel's estimated VMEM exceeds the limit (rather than Mosaic's
    compile error on the chip)."""
    need = K.vmem_bytes(config, backward)
    if need > config.vmem_limit:
        mib = 2**20
        raise ValueError(
            f"MosaicAttention's {'backward' if backward else 'forward'} kernel needs about "
            f"{need / mib:.0f} MiB of VMEM for {config.rows} softmax rows per step "
            f"({config.query_block} queries x {config.head_block} heads), "
            f"{len(config.tables)} tables ({sum(t.resident for t in config.tables)} resident) "
            f"and tiles of {config.tile} rows, above vmem_limit_bytes = "
            f"{config.vmem_limit / mib:.0f} MiB: use smaller blocks (query_block, head_block, "
            "tile_block), resident=False, gradients='hbm', or XlaAttention"
        )


# --- the custom_vjp over the kernels ---------------------------------------------------------


def _query_words(x: Array, static: _Static, blocks: int) -> Array:
    """``x [B, S, H, w]`` as the kernels take it: its queries padded, in ``narrow_rows``
    layout, or padded (heads, ``blocks`` features too) in ``query_rows`` layout."""
    c = static.config
    x = pad_axis(x, 1, c.seq)
    if c.narrow:
        return K.narrow_rows(x, c)
    return K.query_rows(pad_axis(pad_axis(x, 2, c.heads), 3, blocks * LANES), c)


def _unquery_words(x: Array, static: _Static, width: int) -> Array:
    """The inverse of ``_query_words``: ``[B, S, H, width]``."""
    c = static.config
    x = K.unnarrow_rows(x, c) if c.narrow else K.unquery_rows(x, c)
    return x[:, : static.seq, : static.heads, :width]


def _scalars(x: Array, static: _Static) -> Array:
    """Per-row scalars ``[B, S, H]`` padded, in ``row_scalars`` layout."""
    c = static.config
    return K.row_scalars(pad_axis(pad_axis(x, 1, c.seq), 2, c.heads), c)


def _table_words(config: K.Config, static: _Static, floats) -> tuple:
    words = []
    for table, front, (keys, values) in zip(config.tables, static.front, floats, strict=True):
        keys = pad_axis(keys, 1, table.rows, front=front)
        values = None if values is None else pad_axis(values, 1, table.rows, front=front)
        blocks = config.key_blocks, config.value_blocks
        words.append(K.pack_rows(keys, values, *blocks, table.packed))
    return tuple(words)


def _sink_rows(sink: Array, static: _Static) -> Array:
    """The sink logit of every softmax row of a grid step, ``[n_h, R, 128]``."""
    c = static.config
    per_head = pad_axis(sink, 0, c.heads).reshape(c.n_h, 1, c.head_block)
    rows = jnp.broadcast_to(per_head, (c.n_h, c.query_block, c.head_block))
    return jnp.broadcast_to(rows.reshape(c.n_h, c.rows, 1), (c.n_h, c.rows, LANES))


def _forward(static: _Static, qk, sink, floats, ints: _Ints):
    """The forward kernel on the queries in its layout ``qk`` (``_query_words``)."""
    c = static.config
    sinks = _sink_rows(sink, static) if c.has_sinks else None
    words = _table_words(c, static, floats)
    out, lse = K.forward(c, ints.ntiles, qk, sinks, ints.qmeta, ints.sources, words)
    s, h = static.seq, static.heads
    out = _unquery_words(out, static, static.value_width)
    return out, K.unrow_scalars(lse, c)[:, :s, :h]


def _backward_ints(static: _Static, ints: _Ints) -> _Ints:
    """The backward's int arrays: the forward's, with rows sources the backward reads as tiles
    turned into tiles sources (their counts after the forward's)."""
    c, bc = static.config, static.backward
    counts, sources = [ints.ntiles], []
    for src, back, group in zip(c.sources, bc.sources, ints.sources, strict=True):
        if src.kind == "rows" and back.kind == "tiles":
            group, block_counts = _tiles_ints(group[0], c.n_q, c.query_block, c.tile)
            counts.append(block_counts.reshape(-1).astype(jnp.int32))
        sources.append(group)
    if len(counts) > 1 and not any(s.kind in ("tiles", "dense") for s in c.sources):
        counts = counts[1:]  # the forward's placeholder count
    return ints._replace(ntiles=jnp.concatenate(counts), sources=tuple(sources))


def _overlap_add(slabs: Array, static: _Static, src: K.Source) -> Array:
    """A band's per-block slab gradients ``[B, n_q, slab * words, 128]`` summed into its
    padded rows ``[B, seq + front, words * 128]`` (slab ``i`` starts at row ``i * Qb``)."""
    c = static.config
    b, qb = slabs.shape[0], c.query_block
    pieces = c.slab(src) // qb
    x = slabs.reshape(b, c.n_q, pieces, qb, -1)
    total = sum(pad_axis(x[:, :, p], 1, c.n_q + pieces - 1, front=p) for p in range(pieces))
    return total.reshape(b, (c.n_q + pieces - 1) * qb, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: _Static, q, sink, floats, ints: _Ints):
    return _forward(static, _finite_queries(q, static, ints), sink, floats, ints)


def _finite_queries(q, static: _Static, ints: _Ints):
    """The queries in the kernels' layout, a non-finite query's as zeros (its output is NaN
    whatever they are; read as they are, the backward would spread them into the keys'
    gradients): zeroed here, inside the ``custom_vjp``, no mask is differentiated into a pass
    over ``dq``, and XLA fuses this one into the layout's copy."""
    finite = ints.finite_q[:, :, None, None]
    return _query_words(jnp.where(finite, q, 0), static, static.config.key_blocks)


def _attention_fwd(static, q, sink, floats, ints):
    qk = _finite_queries(q, static, ints)
    out, lse = _forward(static, qk, sink, floats, ints)
    return (out, lse), (qk, sink, floats, ints, out, lse)


def _attention_bwd(static: _Static, residuals, cotangents):
    qk, sink, floats, ints, out, lse = residuals
    g_out, g_lse = cotangents
    c = static.backward
    _check_vmem(c, True)
    g_out = jnp.where(ints.live[:, :, None, None], g_out, 0)
    coeff = g_lse.astype(jnp.float32) - jnp.sum(
        g_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1
    )
    coeff = jnp.where(ints.live[:, :, None], coeff, 0.0)  # a poisoned query's output is NaN
    back = _backward_ints(static, ints)
    dq, grads, slabs = K.backward(
        c,
        back.ntiles,
        qk,
        _query_words(g_out.astype(qk.dtype), static, c.value_blocks),
        _scalars(lse, static),
        _scalars(coeff, static),
        back.qmeta,
        back.sources,
        _table_words(c, static, floats),
    )
    dq = _unquery_words(dq, static, static.key_width).astype(qk.dtype)
    band_of = {src.table: k for k, src in enumerate(c.sources) if src.kind == "band"}
    d_floats = []
    for t, (table, (keys, values)) in enumerate(zip(c.tables, floats, strict=True)):
        value_blocks = c.value_blocks if table.value_words else 0
        if t in grads:
            d_keys, d_values = K.unpack_rows(grads[t], table.rows, c.key_blocks, value_blocks)
        else:
            rows = _overlap_add(slabs[band_of[t]], static, c.sources[band_of[t]])
            words = rows.reshape(rows.shape[0], -1, LANES)
            d_keys, d_values = K.unpack_rows(words, rows.shape[1], c.key_blocks, value_blocks)
        front, n = static.front[t], static.natural_rows[t]
        d_keys = d_keys[:, front : front + n, : static.key_width].astype(keys.dtype)
        if values is not None:
            d_values = d_values[:, front : front + n, : values.shape[-1]].astype(values.dtype)
        d_floats.append((d_keys, None if values is None else d_values))
    dsink = jnp.zeros_like(sink)
    if c.has_sinks:  # d lse / d sink = exp(sink - lse); d out / d sink = -out exp(sink - lse)
        dsink = jnp.sum(jnp.exp(sink - lse) * coeff, axis=(0, 1))
    dsink, d_floats = summed_like((dsink, tuple(d_floats)), (sink, floats))
    return dq, dsink, d_floats, jax.tree.map(lambda _: None, ints)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _replayed(static: _Static, q, sink, floats, ints: _Ints, out, lse):
    """``(out, lse)``, the forward kernel's outputs on these arguments, given: differentiated
    as ``_attention`` (its backward), with no forward kernel (``MosaicAttention.replay``)."""
    return out, lse


def _replayed_fwd(static, q, sink, floats, ints, out, lse):
    return (out, lse), (_finite_queries(q, static, ints), sink, floats, ints, out, lse)


def _replayed_bwd(static: _Static, residuals, cotangents):
    out, lse = residuals[-2:]
    grads = _attention_bwd(static, residuals, cotangents)
    return (*grads, jnp.zeros_like(out), jnp.zeros_like(lse))


_replayed.defvjp(_replayed_fwd, _replayed_bwd)
