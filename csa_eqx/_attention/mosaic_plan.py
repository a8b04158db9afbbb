"""How ``MosaicAttention`` (``mosaic.py``) plans a call, one job a function (docs/kernels.md,
"The Mosaic attention kernel (TPU)"):

- ``block_sizes``: every automatic size, resolved once (the query block from the heads:
  ``auto_query_block``; the head block; the rows chunk: ``auto_key_block``; how gathered rows
  are read, as ``gather`` says or as a cost model measured on a TPU v5e chooses:
  ``mosaic_cost.gather_seconds``);
- one builder per kind of read set (``_Builder``): each distinct key / value table, each read
  set's record (``mosaic_reads``' ``RowsRead``, ``TilesRead``, ``DenseRead``, ``BandRead``)
  and int arrays, the per-query metadata;
- the non-finite masks (``picks_poison``, ``_band_poison``): which queries a non-finite row
  poisons (and a non-finite query), by the reference's rule (``XlaAttention``), formed only
  where there is a non-finite row (``lax.cond``; the picks' check in blocks of
  ``POISON_ELEMENTS``);
- the VMEM search (``_configs``): what lives in VMEM (``resident`` tables, the backward's
  gradient tables, a band's included) from an estimate of each kernel's VMEM (``vmem_bytes``),
  and a ``ValueError`` for what cannot fit (``check_vmem``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._layout import entry_visibility
from .._mosaic import LANES, round_up
from .._ops import pad_axis, varying_like
from .mosaic_cost import gather_seconds
from .mosaic_layout import (
    KEY_PAD,
    QUERY_PAD,
    Config,
    entry_meta,
    query_columns,
    query_meta,
    tiles_ints,
)
from .mosaic_reads import BandRead, DenseRead, RowsRead, Table, TilesRead
from .mosaic_steps import read_scratch, vmem
from .reads import BandRows, DenseKeys, GatheredRows, Reads, gather_keys, nonfinite_rows, zero_rows

__all__ = [
    "BlockSizes",
    "block_sizes",
    "Static",
    "Ints",
    "Plan",
    "plan",
    "value_width",
    "picks_poison",
    "auto_query_block",
    "auto_key_block",
    "as_tiles",
    "skips",
    "check_vmem",
    "vmem_bytes",
]

STEP_ROWS = 1024  # softmax rows per grid step of the automatic tiles blocks (chip-compiled)
QUERY_BLOCKS = (16, 64)  # the automatic query block's range (see ``auto_query_block``)
MAX_CHUNK = 512  # the automatic rows chunk's largest (see ``auto_key_block``)
POISON_ELEMENTS = 2**20  # picks per block of the non-finite check (``picks_poison``)
# the most tiles a tiles set skips over (``skips``): its visit list is 4 bytes a tile in SMEM
# per step (double-buffered), and XLA forms it in one pass over the picks per 32 tiles (256:
# V3.2's 128k tokens in tiles of 512)
MAX_SKIP_TILES = 256
AUTO_SHARE = 0.8  # of the VMEM limit, for the automatic choices (the estimate is not exact)
VMEM_LIMIT = 100 * 2**20  # the scoped VMEM limit of ``vmem_limit_bytes=None`` (the v5e has 128)
# ... raised for rows copied from a resident table whose backward keeps its gradient table in
# VMEM only under it: that backward beats the tiles one (V3.2 at 16k on the chip: the layer's
# fwd+bwd 931 -> 710 ms; Mosaic compiles it for a v5e under this limit, not under 100 MiB)
RAISED_VMEM_LIMIT = 124 * 2**20


class Static(NamedTuple):
    """What the ``custom_vjp`` needs besides the arrays: the forward's and the backward's kernel
    ``config``, the natural sizes (queries, heads, key and value widths) and, per table, its
    natural rows and the zero rows before them in its words (a band's ``pad``)."""

    config: Config
    backward: Config
    seq: int
    heads: int
    key_width: int
    value_width: int
    natural_rows: tuple[int, ...]
    front: tuple[int, ...]


class Ints(NamedTuple):
    """The int arrays of a call: tile counts, per-query metadata (its row 3 ``live``), each
    read set's arrays, ``live [B, S]``: the queries no non-finite row poisons (the others'
    outputs are NaN, their cotangents read as zeros) and ``finite_q [B, S]``: the queries
    whose own values are finite (the others read as zeros)."""

    ntiles: Array
    qmeta: Array
    sources: tuple
    live: Array
    finite_q: Array


class Plan(NamedTuple):
    """A call's plan: its ``static`` side, its tables' ``(keys, values)`` and its ``ints``."""

    static: Static
    floats: tuple
    ints: Ints


class BlockSizes(NamedTuple):
    """Every automatic size of a call, resolved once (``block_sizes``): the ``query_block``, the
    ``head_block``, the rows ``chunk``, the ``tile``, how gathered rows (and masked picks) are
    read, ``gather``: ``"rows"`` or ``"tiles"``, whether the cost model took rows for their
    copies from ``resident`` tables (the VMEM search then holds them resident, or the call is
    planned again without that choice: ``plan``) and whether tiles sets may ``skip`` the tiles
    no query of a block picked (``MosaicAttention.skip_tiles``; per set: ``skips``)."""

    query_block: int
    head_block: int
    chunk: int
    tile: int
    gather: str
    resident: bool = False
    skip: bool = True


def _sublanes(dtype) -> int:
    """Mosaic's sublane tile of ``dtype``'s arrays: 16 rows of bfloat16, 8 of float32."""
    return 16 if dtype == jnp.bfloat16 else 8


def block_sizes(kernel, q, reads: Reads, resident_rows: bool = True) -> BlockSizes:
    """The ``MosaicAttention`` ``kernel``'s fields where set, else the automatic sizes (see
    the module docstring; ``resident_rows=False``: the cost model leaves out rows copied from
    resident tables); a ``ValueError`` for a head block off the queries' sublane tile."""
    _, s, h, d = q.shape
    sublanes = _sublanes(q.dtype)
    qb, tile = kernel.query_block_for(q.shape[0], h, reads, None), kernel.tile_block
    heads = round_up(h, sublanes)
    picked = reads.dense if reads.dense is not None and reads.dense.picks is not None else None
    sets = [(g.keys.shape[1], g.indices.shape[-1]) for g in reads.gathered]
    if picked is not None:
        sets.append((picked.keys.shape[1], picked.picks.shape[-1]))
    gather, resident = kernel.gather, False
    if gather == "auto":
        blocks = -(-d // LANES) + -(-value_width(reads, d) // LANES)
        # copies from a resident table for gathered sets only (masked picks as rows take XLA
        # gathers of their entries' ends first) and where the table may be resident
        ways = ["rows", "tiles"]
        if resident_rows and picked is None and kernel.resident is not False:
            ways.append("resident")
        costs = {w: gather_seconds(w, s, sets, heads, blocks * LANES, tile, qb) for w in ways}
        best = min(costs, key=costs.get) if sets else "tiles"
        gather, resident = ("tiles", False) if best == "tiles" else ("rows", best == "resident")
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
    widths = [g.indices.shape[-1] for g in reads.gathered]
    if picked is not None and gather == "rows":  # the visible picks, read as gathered rows
        widths.append(picked.picks.shape[-1])
    chunk = kernel.key_block or auto_key_block(max((max(w, 1) for w in widths), default=1))
    return BlockSizes(qb, hb, chunk, tile, gather, resident, kernel.skip_tiles)


def skips(skip: bool, rows: int, tile: int) -> bool:
    """Whether a tiles set of a table of ``rows`` skips the tiles no query of a block picked
    (``TilesRead.skip``): where ``skip`` allows and the table has at most ``MAX_SKIP_TILES``
    tiles (beyond that every tile up to the block's largest pick is visited)."""
    return skip and -(-rows // tile) <= MAX_SKIP_TILES


class _Table(NamedTuple):
    """A key / value table as planned: its natural ``keys`` and ``values``, its non-finite rows
    ``bad``, its ``rows`` in the kernels' words and the zero rows before them (``front``: a
    band's), and whether a tiles or dense set reads it (``tiled``: its rows padded to whole
    tiles) or it is a band's."""

    keys: Array
    values: Array | None
    bad: Array
    rows: int
    front: int = 0
    tiled: bool = False
    band: bool = False


class _Builder:
    """The read sets of a call as the kernels take them, one method per kind (``rows``,
    ``tiles``, ``picks``, ``dense``, ``band``): each adds its table (``table``: one per
    distinct key / value pair), its record, its int arrays, its tile counts, its per-query
    metadata rows and the queries it poisons."""

    def __init__(self, q: Array, sizes: BlockSizes):
        b, s = q.shape[:2]
        self.sizes, self.batch, self.queries = sizes, b, s
        self.seq = round_up(s, sizes.query_block)
        self.tables: list[_Table] = []
        self.reads, self.ints, self.counts, self.meta = [], [], [], {}
        self.q_bad = ~jnp.all(jnp.isfinite(q), axis=(2, 3))
        self.poison = self.q_bad
        self._pairs: dict = {}

    def table(self, keys, values, value_width, **kind) -> int:
        """The index of the table of ``(keys, values, value_width)``, added on first sight
        (``kind``: ``tiled=True`` marks it read by tiles)."""
        key = (id(keys), id(values), value_width)
        if key not in self._pairs:
            bad = nonfinite_rows(keys, values)
            self.tables.append(_Table(keys, values, bad, keys.shape[1]))
            self._pairs[key] = len(self.tables) - 1
        t = self._pairs[key]
        self.tables[t] = self.tables[t]._replace(**kind)
        return t

    def poisons(self, t: int, flags) -> None:
        """Add the queries ``flags()`` flags, formed only where table ``t`` has a non-finite
        row (``lax.cond``)."""
        bad = self.tables[t].bad
        clean = lambda: varying_like(jnp.zeros((self.batch, self.queries), bool), bad)  # noqa: E731
        self.poison = self.poison | jax.lax.cond(jnp.any(bad), flags, clean)

    def _tiled_indices(self, t: int, idx: Array, width: int, *extra, visible: bool = False):
        """A tiles set of indices ``idx`` (padded to ``width`` columns and the padded queries)
        and its tile counts."""
        idx = pad_axis(pad_axis(idx, 2, width, -1), 1, self.seq, -1)
        qb, tile, rows = self.sizes.query_block, self.sizes.tile, self.tables[t].rows
        skip = skips(self.sizes.skip, rows, tile)
        tiles = -(-rows // tile) if skip else 0
        own, counts = tiles_ints(idx, self.seq // qb, qb, tile, tiles)
        self.counts.append(counts)
        self.ints.append((*own, *extra))
        slot = len(self.counts) - 1
        self.reads.append(TilesRead(t, width, slot=slot, visible=visible, skip=skip))

    def rows(self, g: GatheredRows) -> None:
        t = self.table(g.keys, g.values, g.value_width)
        idx = g.indices.astype(jnp.int32)
        self.poisons(t, functools.partial(picks_poison, self.tables[t].bad, idx))
        chunk = self.sizes.chunk
        width = round_up(max(idx.shape[-1], 1), chunk)
        idx = pad_axis(pad_axis(idx, 2, width, -1), 1, self.seq, -1)
        self.ints.append((idx, idx.reshape(self.batch, -1, chunk)))
        self.reads.append(RowsRead(t, width))

    def tiles(self, g: GatheredRows) -> None:
        t = self.table(g.keys, g.values, g.value_width, tiled=True)
        idx = g.indices.astype(jnp.int32)
        self.poisons(t, functools.partial(picks_poison, self.tables[t].bad, idx))
        self._tiled_indices(t, idx, round_up(max(idx.shape[-1], 1), 8))

    def picks(self, picked: DenseKeys) -> None:
        """A ``DenseKeys``' picks as tiles: the picks counted, each masked by the entries'
        visibility."""
        t = self.table(picked.keys, picked.values, picked.value_width, tiled=True)
        idx = picked.picks.astype(jnp.int32)
        width = round_up(max(idx.shape[-1], 1), 8)
        self._tiled_indices(t, idx, width, entry_meta(picked, self.sizes.tile), visible=True)
        self.meta.update(query_columns(picked, self.seq))
        self.poisons(t, functools.partial(picks_poison, self.tables[t].bad, picked.picks, picked))

    def dense(self, dense: DenseKeys) -> None:
        t = self.table(dense.keys, dense.values, dense.value_width, tiled=True)
        b, qb, tile = self.batch, self.sizes.query_block, self.sizes.tile
        entries, columns = entry_meta(dense, tile), query_columns(dense, self.seq)
        end = entries[:, :, 0].reshape(b, -1)  # the padded entries' ends, tile by tile
        top = jnp.max(columns[1].reshape(b, -1, qb), axis=-1)  # each block's last index
        closed = (end[:, None, :] >= 0) & (end[:, None, :] <= top[:, :, None])
        last = jnp.max(jnp.where(closed, jnp.arange(end.shape[1], dtype=jnp.int32), -1), axis=-1)
        self.counts.append((last + tile) // tile)
        self.ints.append((entries,))
        self.reads.append(DenseRead(t, slot=len(self.counts) - 1))
        self.meta.update(columns)

        def sees_bad(bad=self.tables[t].bad):
            seen = entry_visibility(dense.query_index, dense.query_segment, dense.layout)
            return jnp.any(seen & bad[:, None, :], axis=-1)

        self.poisons(t, sees_bad)

    def band(self, band: BandRows) -> None:
        window, s, qb = band.window, self.queries, self.sizes.query_block
        before = 0 if band.history is None else window - 1
        front = round_up(window - 1, qb)
        keys = band.keys[:, : before + s]
        values = None if band.values is None else band.values[:, : before + s]
        bad = nonfinite_rows(keys, values)
        self.tables.append(_Table(keys, values, bad, self.seq + front, front - before, band=True))
        key_segment = band.segment
        if before:
            key_segment = jnp.concatenate([band.history, band.segment], axis=1)
        key_segment = key_segment.astype(jnp.int32)
        padded = pad_axis(key_segment, 1, self.seq + front, KEY_PAD, front=front - before)
        starts = (jnp.arange(self.seq // qb) * qb)[:, None] + jnp.arange(front + qb)
        self.ints.append((padded[:, starts][:, :, None, :],))
        self.reads.append(BandRead(len(self.tables) - 1, window, front))
        self.meta[0] = pad_axis(band.segment.astype(jnp.int32), 1, self.seq, QUERY_PAD)

        def window_bad(bad=bad, key_segment=key_segment):
            return _band_poison(bad, key_segment, band.segment, window, before)

        self.poisons(len(self.tables) - 1, window_bad)


def plan(kernel, q, reads: Reads, has_sinks: bool, scale: float) -> Plan:
    """The ``MosaicAttention`` ``kernel``'s read sets, tables, int arrays and configurations
    for ``reads`` (see the module docstring); planned again without rows from resident tables
    where the cost model took them but they do not fit VMEM."""
    args = (kernel, q, reads, has_sinks, scale)
    return _plan_with(*args, resident_rows=True) or _plan_with(*args, resident_rows=False)


def _plan_with(kernel, q, reads: Reads, has_sinks: bool, scale: float, resident_rows: bool):
    """``plan``, the cost model offered rows from resident tables or not (``resident_rows``);
    ``None`` where it took them and they do not fit."""
    b, s, h, d = q.shape
    sizes = block_sizes(kernel, q, reads, resident_rows)
    built = _Builder(q, sizes)
    dense = reads.dense
    picked = dense if dense is not None and dense.picks is not None else None
    gathered = list(reads.gathered)
    if picked is not None and sizes.gather == "rows":  # the visible picks as gathered rows
        gathered.append(picked.picked_rows())
    for g in gathered:
        (built.rows if sizes.gather == "rows" else built.tiles)(g)
    if picked is not None and sizes.gather == "tiles":
        built.picks(picked)
    if dense is not None and picked is None:
        built.dense(dense)
    if reads.band is not None:
        built.band(reads.band)
    sp, i32 = built.seq, jnp.int32
    built.meta[3] = pad_axis((~built.poison).astype(i32), 1, sp)
    rows = [built.meta.get(k, jnp.zeros((b, sp), i32)) for k in range(4)]
    qmeta = query_meta(jnp.stack(rows, axis=1), sizes.query_block)
    counts = built.counts
    ntiles = jnp.stack(counts).reshape(-1).astype(i32) if counts else jnp.zeros((1,), i32)
    floats = tuple(
        (
            zero_rows(t.keys, t.bad).astype(q.dtype),
            None if t.values is None else zero_rows(t.values, t.bad).astype(q.dtype),
        )
        for t in built.tables
    )
    width = value_width(reads, d)
    tabled = bool(gathered) or (dense is not None and picked is None)
    config_of = _config_of(kernel, q, sizes, built, width, has_sinks, scale)
    config = _configs(kernel, config_of, sizes, tabled, reads.band is not None)
    if config is None:
        return None
    check_vmem(config[0], False)
    static = Static(
        *config,
        seq=s,
        heads=h,
        key_width=d,
        value_width=width,
        natural_rows=tuple(k.shape[1] for k, _ in floats),
        front=tuple(t.front for t in built.tables),
    )
    ints = Ints(ntiles, qmeta, tuple(built.ints), ~built.poison, ~built.q_bad)
    return Plan(static, floats, ints)


def _config_of(kernel, q, sizes: BlockSizes, built: _Builder, width: int, has_sinks: bool,
               scale: float):  # fmt: skip
    """``config(resident, hbm, slabs, limit)``: the kernels' ``Config`` with tables resident
    (not a band's), HBM gradient tables for tiles, a band's gradients as slabs, as asked, under
    the scoped VMEM ``limit``."""
    _, s, h, d = q.shape
    packed = q.dtype == jnp.bfloat16
    per = 2 if packed else 1
    key_blocks, value_blocks = -(-d // LANES), -(-width // LANES)
    heads = round_up(h, _sublanes(q.dtype))
    # one head block takes every head, and its padded rows (heads to whole sublane tiles,
    # features to whole 128-lane blocks) are twice the heads' features or more (few heads,
    # narrow heads): the query-side arrays stay [B, seq, h * width] in HBM
    padded = heads * LANES * (key_blocks + value_blocks) >= 2 * h * (d + width)
    narrow = (h, d, width) if sizes.head_block >= heads and padded else ()

    def config(resident: bool, hbm: bool, slabs: bool, limit: int) -> Config:
        tables = []
        for t in built.tables:
            rows = round_up(t.rows, sizes.tile) if t.tiled and not t.band else t.rows
            words = 0 if t.values is None else -(-value_blocks // per)
            grads = (t.tiled and hbm) or (t.band and slabs)
            tables.append(
                Table(rows, -(-key_blocks // per), words, packed, resident and not t.band, grads)
            )
        return Config(
            tables=tuple(tables), sources=tuple(built.reads), batch=built.batch, queries=s,
            seq=built.seq, heads=round_up(h, sizes.head_block), head_block=sizes.head_block,
            query_block=sizes.query_block, key_blocks=key_blocks, value_blocks=value_blocks,
            chunk=sizes.chunk, tile=sizes.tile, scale=scale, has_sinks=has_sinks,
            dtype=jnp.dtype(q.dtype).name, vmem_limit=limit, narrow=narrow,
            interpret=kernel.interpret,
        )  # fmt: skip

    return config


def value_width(reads: Reads, width: int) -> int:
    """The output width: the first read set's values give it (of their own, or the keys' first
    ``value_width`` features), else the keys' ``width``."""
    for r in (*reads.gathered, reads.dense):
        if r is not None and r.value_width is not None:
            return r.value_width
    for r in (*reads.gathered, reads.band, reads.dense):
        if r is not None and r.values is not None:
            return r.values.shape[-1]
    return width


def picks_poison(bad, idx, dense: DenseKeys | None = None) -> Array:
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
    costs per row (the chip's figures: docs/kernels.md)."""
    n = -(-width // MAX_CHUNK)
    return round_up(-(-width // n), LANES)


def as_tiles(config: Config, skip: bool = True) -> Config:
    """``config`` with its rows sources read as tiles (their tables tiled, in HBM, with HBM
    gradient tables; skipping the tiles no query of a block picked where ``skip`` allows:
    ``skips``): the backward of rows sources whose VMEM gradient table does not fit."""
    tables, sources = list(config.tables), []
    slots = sum(isinstance(src, TilesRead | DenseRead) for src in config.sources)
    for src in config.sources:
        if isinstance(src, RowsRead):
            rows = round_up(tables[src.table].rows, config.tile)
            tables[src.table] = tables[src.table]._replace(
                rows=rows, resident=False, hbm_grads=True
            )
            src = TilesRead(src.table, src.width, slots, skip=skips(skip, rows, config.tile))
            slots += 1
        sources.append(src)
    return config._replace(tables=tuple(tables), sources=tuple(sources))


def _configs(kernel, config, sizes: BlockSizes, tabled: bool, banded: bool):
    """The forward's and the backward's kernel configurations: the first of the candidate
    (``resident``, HBM gradients, band slabs) whose kernels fit ``AUTO_SHARE`` of the VMEM
    limit (VMEM gradient tables first, the measured path, unless ``kernel.gradients`` says;
    within each, a band's gradient table in VMEM before slabs in HBM (only slabs for
    ``"hbm"``), and resident tables before fetched ones, for tiles and where
    ``kernel.resident`` allows), else the leanest; the backward's rows sources read as tiles
    when their gradients go to HBM. Rows the cost model took for their copies from resident
    tables (``sizes.resident``) keep the table resident, their gradients in VMEM where they
    fit beside it (V4-Flash; V3.2 at 16k only under ``RAISED_VMEM_LIMIT``, taken where
    ``kernel.vmem_limit_bytes`` is ``None``), else in HBM with the backward read as tiles
    (V3.2 at 32k): ``None`` where even that does not fit."""
    if sizes.resident:
        residents = [True]
    elif kernel.resident is not None:
        residents = [kernel.resident]
    else:
        residents = [True, False] if tabled and sizes.gather == "tiles" else [False]
    grads = {"vmem": [False], "hbm": [True], "auto": [False, True]}[kernel.gradients]
    slabs = [True] if kernel.gradients == "hbm" or not banded else [False, True]
    limit = kernel.vmem_limit_bytes or VMEM_LIMIT
    candidates = [(res, hbm, slab, limit) for hbm in grads for slab in slabs for res in residents]
    if sizes.resident and kernel.vmem_limit_bytes is None and False in grads:
        at = len(slabs) * len(residents)  # after the VMEM gradients under the default limit
        candidates[at:at] = [(True, False, slab, RAISED_VMEM_LIMIT) for slab in slabs]
    for res, hbm, slab, lim in candidates:
        forward = config(res, hbm, slab, lim)
        backward = as_tiles(forward, sizes.skip) if hbm else forward
        budget = AUTO_SHARE * lim
        if vmem_bytes(forward, False) <= budget and vmem_bytes(backward, True) <= budget:
            return forward, backward
    if sizes.resident:
        return None
    forward = config(*candidates[-1])
    return forward, as_tiles(forward, sizes.skip) if candidates[-1][1] else forward


def check_vmem(config: Config, backward: bool) -> None:
    """A ``ValueError`` when a kernel's estimated VMEM exceeds the limit (rather than Mosaic's
    compile error on the chip)."""
    need = vmem_bytes(config, backward)
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


def vmem_bytes(config: Config, backward: bool) -> int:
    """An upper estimate of the VMEM a kernel holds (docs/kernels.md, "The Mosaic attention
    kernel (TPU)"): its pipelined blocks (two buffers each), resident tables (one), scratch
    (the online softmax state or the backward's accumulators, VMEM gradient tables, each
    source's buffers) and the largest working set of one source's step (logits,
    probabilities and their products ``[R, tile]``, the unpacked keys and values, the pick
    counts' one-hot operands and the block's picks padded and transposed), all in Mosaic's
    (8, 128) tiles.

    **Arguments:** the ``config``; ``backward``: the backward kernel's, else the forward's.

    **Returns:** bytes.
    """
    c = config
    item = 2 if c.dtype == "bfloat16" else 4
    r, qb, dk, dv = c.rows, c.query_block, c.key_blocks * LANES, c.value_blocks * LANES
    rows = qb if c.narrow else r
    q, o = vmem((rows, c.query_lanes(False)), item), vmem((rows, c.query_lanes(True)), item)
    scalars = vmem((c.scalar_rows, LANES))
    blocks = [q, o, scalars]  # q, out / do, lse
    if backward:
        blocks += [scalars, q]  # the coefficient, dq
    elif c.has_sinks:
        blocks.append(vmem((r, LANES)))
    blocks.append(vmem((8, qb)))  # the per-query metadata
    scratch = [vmem((r, LANES)), vmem((r, LANES)), vmem((r, dk if backward else dv))]
    if c.narrow:  # the float32 staging rows, q's rows (and do's) in the compute dtype
        scratch += [vmem((r, max(dk, dv))), vmem((r, dk), item)]
        scratch += [vmem((r, dv), item)] if backward else []
    work = 0
    for src, (bufs, _) in zip(c.sources, read_scratch(c, backward), strict=True):
        table = c.tables[src.table]
        gg = c.grad_words(table)
        scratch += [vmem(b.shape, jnp.dtype(b.dtype).itemsize) for b in bufs.values()]
        lanes = c.tile
        if isinstance(src, RowsRead | BandRead):
            lanes = c.chunk if isinstance(src, RowsRead) else c.slab(src)
        rows = c.head_block if isinstance(src, RowsRead) else r
        live = 7 if backward else 3  # [rows, lanes] float32 values at once
        step = live * vmem((rows, lanes)) + vmem((lanes, dk + dv), 4 + item)
        if backward:
            step += vmem((lanes, gg * LANES)) + vmem((rows, dk))
        if isinstance(src, RowsRead):
            blocks.append(vmem((qb * (src.width // c.chunk), c.chunk)))
        elif isinstance(src, TilesRead):
            blocks.append(vmem((qb, src.width)))
            if src.visible:
                blocks.append(vmem((table.rows // c.tile * 8, c.tile)))
            high, padded = table.rows // LANES, qb + -qb % LANES
            picks = vmem((padded, src.width)) + vmem((src.width, padded))  # and transposed
            step = max(step, vmem((high, src.width), 6) + vmem((src.width, LANES), 6) + picks)
        elif isinstance(src, DenseRead):
            blocks.append(vmem((table.rows // c.tile * 8, c.tile)))
        elif isinstance(src, BandRead):
            blocks.append(vmem((1, c.slab(src))))
            if backward and table.hbm_grads:
                blocks.append(vmem((c.slab(src) * gg, LANES)))
        work = max(work, step)
    tables = [t.rows * t.words * LANES * 4 for t in c.tables if t.resident]
    if backward:
        tables += [(c.tables[t].rows + 1) * c.grad_words(c.tables[t]) * LANES * 4
                   for t in c.vmem_grad_tables()]  # fmt: skip
    return 2 * sum(blocks) + sum(tables) + sum(scratch) + work
