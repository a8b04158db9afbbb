"""What ``MosaicAttention``'s forward and backward kernels share (``mosaic_forward.py``,
``mosaic_backward.py``; docs/kernels.md, "The Mosaic attention kernel (TPU)"): the
``pallas_call`` over the grid ``(batch, n_q, n_h)``, the blocks and scratch of each kind of read
set, each read set's refs as one record (``ReadRefs``: no ref is taken by position), and the
in-kernel pieces: unpacking rows of words, the query-side rows, the per-row scalars and how
each kind of read set is read (its pipeline and its weights).

A rows / tiles / dense table lives in HBM (``pl.ANY``: rows and tiles fetched by DMA) or is
``resident`` (the whole table one single-buffered VMEM block per batch row: rows copied by
vector loads, tiles read in place). A grid step reads its sets in order: gathered rows (a
query's heads against a chunk of its rows; double-buffered DMAs), tiles and dense entries (all
the step's rows against a tile; double-buffered DMAs), then the band (one slab, fetched at the
step's start).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from .._mosaic import LANES, dot, run_mosaic
from .mosaic_layout import BandRead, Config, DenseRead, Read, RowsRead, Table, TilesRead

__all__ = [
    "run_kernel",
    "query_spec",
    "scalar_spec",
    "meta_spec",
    "read_specs",
    "read_scratch",
    "scratch_of",
    "narrow_scratch",
    "ReadRefs",
    "read_refs",
    "Step",
    "keys_values",
    "per_row",
    "column",
    "put_scalars",
    "narrow_in",
    "narrow_out",
    "rows_pipeline",
    "tiles_pipeline",
    "band_words",
    "band_weights",
    "start",
    "tile_weights",
    "vmem",
]


def run_kernel(kernel, name: str, config: Config, args: tuple, specs, out_shape, scratch,
               semantics: tuple[str, ...], aliases=None):  # fmt: skip
    """Run ``kernel(config, interpreted, *refs)`` over the grid ``(batch, n_q, n_h)`` by
    ``run_mosaic``: its refs arrive as ``args`` (a tuple of pytrees, the tile counts first: the
    scalar prefetch), its outputs and its ``scratch`` (a tuple of pytrees) are laid out.

    **Arguments:** the ``kernel`` and its ``name``; the ``config``; the ``args``; ``specs``,
    the BlockSpecs ``(inputs, outputs)`` (pytrees of ``args[1:]``'s and ``out_shape``'s
    structure); ``out_shape``; ``scratch``; the grid's ``semantics`` on a TPU; ``aliases``
    (flat input -> output index, the scalar prefetch counted).

    **Returns:** the outputs, as ``out_shape`` lays them out.
    """
    flat, tree = jax.tree.flatten(args)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(config.batch, config.n_q, config.n_h),
        in_specs=specs[0],
        out_specs=specs[1],
        scratch_shapes=scratch,
    )

    def build(interpret, out_shape):
        params = None
        if interpret is False:
            params = pltpu.CompilerParams(
                dimension_semantics=semantics, vmem_limit_bytes=config.vmem_limit
            )
        call = pl.pallas_call(
            functools.partial(kernel, config, interpret is not False),
            grid_spec=grid_spec,
            out_shape=out_shape,
            interpret=interpret,
            compiler_params=params,
            input_output_aliases=aliases or {},
            name=name,
        )
        return lambda *flat: call(*jax.tree.unflatten(tree, flat))

    return run_mosaic(name, build, out_shape, *flat, interpret=config.interpret)


def query_spec(config: Config, values: bool):
    """The blocks of a query-side array: ``[R, width]`` of ``query_rows``, or ``[Qb, heads *
    width]`` of a ``narrow`` one (every head: its head block index is always 0)."""
    lanes = config.query_lanes(values)
    if config.narrow:
        return pl.BlockSpec((None, config.query_block, lanes), lambda b, i, j, *_: (b, i, 0))
    return pl.BlockSpec((None, None, config.rows, lanes), lambda b, i, j, *_: (b, j, i, 0))


def scalar_spec(config: Config):
    """``[scalar_rows, 128]`` blocks of a ``row_scalars`` array."""
    shape = (None, None, None, config.scalar_rows, LANES)
    return pl.BlockSpec(shape, lambda b, i, j, *_: (b, j, i, 0, 0))


def meta_spec(config: Config):
    """``[8, Qb]`` blocks of the per-query metadata (``query_meta``)."""
    shape = (None, None, 8, config.query_block)
    return pl.BlockSpec(shape, lambda b, i, j, *_: (b, i, 0, 0))


def _int_specs(config: Config, read: Read) -> tuple:
    """The BlockSpecs of a read set's int arrays: rows, its indices ``[B, seq, width]`` in
    SMEM, then the same in VMEM as ``[B, seq * width / chunk, chunk]``; tiles, the indices in
    VMEM (and, ``visible``, the entries' end and segment per tile as a dense set's); dense, the
    entries' end and segment per tile ``[B, rows / tile, 8, tile]``; band, the slab rows'
    segments ``[B, n_q, 1, slab]``."""
    qb = config.query_block
    if isinstance(read, BandRead):
        return (pl.BlockSpec((None, None, 1, config.slab(read)), lambda b, i, j, *_: (b, i, 0, 0)),)
    entries = (None, config.tables[read.table].rows // config.tile, 8, config.tile)
    entries = pl.BlockSpec(entries, lambda b, i, j, *_: (b, 0, 0, 0))
    if isinstance(read, DenseRead):
        return (entries,)
    space = pltpu.SMEM if isinstance(read, RowsRead) else None
    index = pl.BlockSpec((None, qb, read.width), lambda b, i, j, *_: (b, i, 0), memory_space=space)
    if isinstance(read, RowsRead):  # the same indices in VMEM, a chunk a row: the chunks' masks
        chunks = (None, qb * (read.width // config.chunk), config.chunk)
        return index, pl.BlockSpec(chunks, lambda b, i, j, *_: (b, i, 0))
    return (index, entries) if read.visible else (index,)


def read_specs(config: Config) -> tuple[tuple, tuple]:
    """The BlockSpecs of each read set's int arrays (``_int_specs``), then of each table (HBM,
    or a single-buffered VMEM block per batch row, its batch dimension kept: a DMA from a block
    whose batch dimension is squeezed is lowered with too few indices, which Mosaic's verifier
    rejects)."""
    tables = []
    for table in config.tables:
        if table.resident:
            shape = (1, table.rows * table.words, LANES)
            tables.append(
                pl.BlockSpec(shape, lambda b, i, j, *_: (b, 0, 0), pipeline_mode=pl.Buffered(1))
            )
        else:
            tables.append(pl.BlockSpec(memory_space=pl.ANY))
    return tuple(_int_specs(config, read) for read in config.sources), tuple(tables)


def read_scratch(config: Config, backward: bool) -> list[tuple[dict, int]]:
    """Per read set, its named scratch buffers and the number of DMA semaphores it uses: rows:
    ``rows`` (two chunks of row words), ``masks`` (theirs) and in the backward ``contributions``
    (a chunk's gradient rows); tiles: ``counts`` (the block's pick counts); tiles and dense:
    ``tiles`` (two tiles of words, unless the table is resident; 2 semaphores) and in the
    backward of an ``hbm_grads`` table ``grads`` (two tiles of gradient words; 4 semaphores:
    fetches, write-backs); band: ``slab`` (1 semaphore)."""
    out = []
    for read in config.sources:
        table = config.tables[read.table]
        word = jnp.int32 if table.packed else jnp.float32
        g, gg = table.words, config.grad_words(table)
        bufs, sems = {}, 0
        if isinstance(read, RowsRead):
            bufs["rows"] = pltpu.VMEM((2, config.chunk * g, LANES), word)
            if backward:
                bufs["contributions"] = pltpu.VMEM((config.chunk * gg, LANES), jnp.float32)
            sems = 2
        elif isinstance(read, BandRead):
            bufs["slab"] = pltpu.VMEM((config.slab(read) * g, LANES), word)
            sems = 1
        else:
            if isinstance(read, TilesRead):
                counts = (table.rows // LANES * config.query_block, LANES)
                bufs["counts"] = pltpu.VMEM(counts, jnp.float32)
            if not table.resident:
                bufs["tiles"] = pltpu.VMEM((2, config.tile * g, LANES), word)
                sems += 2
            if backward and table.hbm_grads:
                bufs["grads"] = pltpu.VMEM((2, config.tile * gg, LANES), jnp.float32)
                sems += 4
        out.append((bufs, sems))
    return out


def scratch_of(config: Config, backward: bool) -> tuple[tuple[dict, ...], tuple]:
    """Each read set's scratch buffers (``read_scratch``) and its DMA semaphores (an array of
    its own; ``None`` where it uses none)."""
    per_read = read_scratch(config, backward)
    sems = tuple(pltpu.SemaphoreType.DMA((n,)) if n else None for _, n in per_read)
    return tuple(bufs for bufs, _ in per_read), sems


def narrow_scratch(config: Config, dtype, backward: bool) -> tuple:
    """A ``narrow`` kernel's VMEM for its query-side rows: the float32 staging rows, then q's
    rows (and in the backward do's) in the compute dtype (``narrow_in``)."""
    if not config.narrow:
        return ()
    dk, dv = config.key_blocks * LANES, config.value_blocks * LANES
    shapes = [pltpu.VMEM((config.rows, max(dk, dv)), jnp.float32)]
    shapes.append(pltpu.VMEM((config.rows, dk), dtype))
    if backward:
        shapes.append(pltpu.VMEM((config.rows, dv), dtype))
    return tuple(shapes)


class ReadRefs(NamedTuple):
    """A read set's refs in a kernel: its ``ints``, its table ``tab``, its named scratch
    ``bufs``, its DMA semaphores ``sems`` (a band's one semaphore; ``None`` if it uses none)
    and, in the backward of an ``hbm_grads`` table, the table's gradient words in HBM
    ``grads``."""

    read: Read
    table: Table
    ints: tuple
    tab: object
    bufs: dict
    sems: object
    grads: object = None


def read_refs(config: Config, ints, tables, bufs, sems, grads=None) -> list[ReadRefs]:
    """Each read set's ``ReadRefs`` from the kernel's refs: its int refs (``ints``), its
    table's (``tables``), its scratch (``bufs`` and ``sems``: ``scratch_of``'s) and ``grads``
    (table -> its gradient words in HBM; the backward's)."""
    out = []
    for read, own, buffers, sem in zip(config.sources, ints, bufs, sems, strict=True):
        if isinstance(read, BandRead):
            sem = sem.at[0]
        hbm = None if grads is None else grads.get(read.table)
        table = config.tables[read.table]
        out.append(ReadRefs(read, table, own, tables[read.table], buffers, sem, hbm))
    return out


def _features(words, offset, n: int, table: Table, first: int, blocks: int, dtype):
    """``[n, blocks * 128]`` features of ``n`` consecutive table rows from word-row ``offset`` of
    the ref ``words`` (``first``: the features' first word-row within a row)."""
    parts = []
    for f in range(blocks):
        start = offset + first + (f // 2 if table.packed else f)
        w = words[pl.ds(start, n, stride=table.words), :]
        if table.packed:
            bits = jnp.left_shift(w, 16) if f % 2 == 0 else jnp.bitwise_and(w, -65536)
            w = jax.lax.bitcast_convert_type(bits, jnp.float32)
        parts.append(w.astype(dtype))
    return parts[0] if blocks == 1 else jnp.concatenate(parts, axis=1)


def keys_values(words, offset, n: int, table: Table, config: Config):
    """The keys ``[n, dk]`` and values ``[n, dv]`` of ``n`` consecutive rows."""
    dtype = jnp.dtype(config.dtype)
    keys = _features(words, offset, n, table, 0, config.key_blocks, dtype)
    if table.value_words:
        values = _features(words, offset, n, table, table.key_words, config.value_blocks, dtype)
    else:
        values = keys[:, : config.value_blocks * LANES]
    return keys, values


def per_row(w, config: Config):
    """Weights ``[Qb, n]`` per query as ``[R, n]`` per softmax row."""
    qb, hb = config.query_block, config.head_block
    return jnp.broadcast_to(w[:, None, :], (qb, hb, w.shape[1])).reshape(qb * hb, w.shape[1])


def column(ref, n: int):
    """A step's ``n`` per-row scalars (a ``[scalar_rows, 128]`` ref) as a lane-broadcast column
    ``[n, 128]``."""
    rows = [ref[pl.ds(k, 1), :] for k in range(ref.shape[0])]
    row = (rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1))[:, :n]
    return jnp.broadcast_to(row, (LANES, n)).T


def put_scalars(ref, column):
    """Write a lane-broadcast column ``[n, 128]`` into a ``[scalar_rows, 128]`` ref (the
    inverse of ``column``; the padding's lanes are left as they are)."""
    row = column.T[0:1, :]
    for k in range(ref.shape[0]):
        lanes = min(LANES, row.shape[1] - k * LANES)
        ref[pl.ds(k, 1), pl.ds(0, lanes)] = row[:, k * LANES : k * LANES + lanes]


def narrow_in(config: Config, block, stage, rows, values: bool):
    """Fill ``rows [R, blocks * 128]`` (the compute dtype) from a ``narrow`` block ``[Qb,
    heads * width]`` (``values``: of the values' width): query ``q``'s head ``h`` to row
    ``q * Hb + h``, zeros elsewhere; through the float32 ``stage`` (Mosaic stores strided rows
    of 32-bit words only)."""
    heads, width = config.narrow[0], config.narrow[2 if values else 1]
    qb, hb, lanes = config.query_block, config.head_block, rows.shape[1]
    stage[:, pl.ds(0, lanes)] = jnp.zeros((config.rows, lanes), jnp.float32)
    for h in range(heads):
        x = block[:, pl.ds(h * width, width)].astype(jnp.float32)
        stage[pl.ds(h, qb, stride=hb), pl.ds(0, width)] = x
    rows[...] = stage[:, pl.ds(0, lanes)].astype(rows.dtype)


def narrow_out(config: Config, rows, block, values: bool):
    """Write each head's first features of float32 ``rows [R, >= width]`` into a ``narrow``
    block (``narrow_in``'s placement)."""
    heads, width = config.narrow[0], config.narrow[2 if values else 1]
    qb, hb = config.query_block, config.head_block
    for h in range(heads):
        x = rows[pl.ds(h, qb, stride=hb), pl.ds(0, width)]
        block[:, pl.ds(h * width, width)] = x.astype(block.dtype)


def _table_ref(ref, table: Table, b, offset, n: int):
    """Word-rows ``offset .. offset + n`` of batch row ``b`` of a table (resident: of its block,
    whose batch dimension is kept: see ``read_specs``)."""
    return ref.at[0 if table.resident else b, pl.ds(offset, n), :]


def _wait(buf, sem):
    """Wait for every DMA into ``buf`` signalled on ``sem`` (their sizes add up to its size)."""
    pltpu.make_async_copy(buf, buf, sem).wait()


class Step(NamedTuple):
    """What one grid step's sources share."""

    config: Config
    interpret: bool
    b: Array
    i: Array
    ntiles: object  # the prefetched tile counts (SMEM ref)
    qmeta: object  # the block's per-query metadata [8, Qb] (ref)

    def unroll(self, n: int) -> int:
        return 1 if self.interpret else min(n, 8)

    def meta(self, k: int):
        """``[Qb, 1]``: row ``k`` of the block's per-query metadata as a column (its lanes
        padded to 128 for the transpose)."""
        rows = self.qmeta[...]
        pad = -rows.shape[1] % LANES
        if pad:
            rows = jnp.concatenate([rows, jnp.zeros((8, pad), rows.dtype)], axis=1)
        return rows.T[: self.config.query_block, k : k + 1]

    def count(self, read: TilesRead | DenseRead):
        """The number of tiles the block reads from a tiles / dense set."""
        c = self.config
        return self.ntiles[(read.slot * c.batch + self.b) * c.n_q + self.i]


def rows_pipeline(step: Step, s: ReadRefs, consume):
    """Gathered rows, per query (the block's queries, not its padding) in chunks of ``chunk``
    rows (DMAs, double-buffered, or from a resident table vector copies): ``consume(query,
    chunk, words_ref, mask [1, chunk])`` for each chunk, the mask read from the indices' VMEM
    copy (a chunk a row) in one load."""
    c = step.config
    size, g = c.chunk, s.table.words
    idx, chunks = s.ints
    buf = s.bufs["rows"]
    per_query = s.read.width // size
    total = jnp.minimum(c.query_block, c.queries - step.i * c.query_block) * per_query

    def issue(n, slot):
        qq = jax.lax.div(n, per_query)
        base = (n - qq * per_query) * size

        def one(jj, carry):
            r = idx[qq, base + jj]
            row = _table_ref(s.tab, s.table, step.b, jnp.maximum(r, 0) * g, g)
            if s.table.resident:  # a vector copy within VMEM (a local DMA costs ~3x more)
                buf[slot, pl.ds(jj * g, g), :] = row[...]
            else:
                dst = buf.at[slot, pl.ds(jj * g, g)]
                pltpu.make_async_copy(row, dst, s.sems.at[slot]).start()
            return carry

        jax.lax.fori_loop(0, size, one, 0, unroll=step.unroll(size))

    issue(0, 0)

    def body(n, carry):
        slot = jax.lax.rem(n, 2)

        @pl.when(n + 1 < total)
        def _():
            issue(n + 1, 1 - slot)

        if not s.table.resident:
            _wait(buf.at[slot], s.sems.at[slot])
        qq = jax.lax.div(n, per_query)
        mask = jnp.where(chunks[pl.ds(n, 1), :] >= 0, 1.0, 0.0)
        consume(qq, n - qq * per_query, buf.at[slot], mask)
        return carry

    jax.lax.fori_loop(0, total, body, 0)


def tiles_pipeline(step: Step, s: ReadRefs, consume):
    """The table's first ``count`` tiles (double-buffered DMAs, or read in place from a
    resident table): ``consume(t, words_ref, word_offset, grads_ref)`` for each, where
    ``grads_ref`` is ``None``, or (the backward of an ``hbm_grads`` table) tile ``t``'s gradient
    words fetched from HBM, to add to: they are written back after ``consume``. A buffer is
    refilled only once its write-back is done, and the pass ends when every write-back is."""
    c = step.config
    n = step.count(s.read)
    span = c.tile * s.table.words
    keys = s.bufs.get("tiles")
    grads = s.bufs.get("grads")
    first = 0 if keys is None else 2  # the gradients' semaphores: fetches, then write-backs
    grad_span = c.tile * c.grad_words(s.table)

    def grad_hbm(t):
        return s.grads.at[step.b, pl.ds(pl.multiple_of(t * grad_span, 8), grad_span), :]

    def write_back(t, slot):
        return pltpu.make_async_copy(grads.at[slot], grad_hbm(t), s.sems.at[first + 2 + slot])

    def fetch(t, slot):
        if keys is not None:
            tile = _table_ref(s.tab, s.table, step.b, pl.multiple_of(t * span, 8), span)
            pltpu.make_async_copy(tile, keys.at[slot], s.sems.at[slot]).start()
        if grads is not None:
            pltpu.make_async_copy(grad_hbm(t), grads.at[slot], s.sems.at[first + slot]).start()

    @pl.when(n > 0)
    def _():
        fetch(0, 0)

    def body(t, carry):
        slot = jax.lax.rem(t, 2)

        @pl.when(t + 1 < n)
        def _():
            if grads is not None:

                @pl.when(t > 0)
                def _():
                    write_back(t - 1, 1 - slot).wait()

            fetch(t + 1, 1 - slot)

        if keys is None:
            words, offset = s.tab.at[0], pl.multiple_of(t * span, 8)
        else:
            _wait(keys.at[slot], s.sems.at[slot])
            words, offset = keys.at[slot], 0
        if grads is None:
            consume(t, words, offset, None)
        else:
            _wait(grads.at[slot], s.sems.at[first + slot])
            consume(t, words, offset, grads.at[slot])
            write_back(t, slot).start()
        return carry

    jax.lax.fori_loop(0, n, body, 0)
    if grads is not None:  # the write-backs not yet waited for: tiles n - 2 and n - 1
        for back in (2, 1):

            @pl.when(n >= back)
            def _(back=back):
                write_back(n - back, jax.lax.rem(n - back, 2)).wait()


def _band_start(step: Step, s: ReadRefs):
    """Start the DMA of the block's band slab (token rows ``i * Qb ..``)."""
    span = step.config.slab(s.read) * s.table.words
    offset = pl.multiple_of(step.i * step.config.query_block * s.table.words, 8)
    slab = _table_ref(s.tab, s.table, step.b, offset, span)
    pltpu.make_async_copy(slab, s.bufs["slab"], s.sems).start()


def band_words(s: ReadRefs):
    """The block's slab words, once they have arrived."""
    _wait(s.bufs["slab"], s.sems)
    return s.bufs["slab"]


def band_weights(step: Step, s: ReadRefs):
    """``[Qb, slab]``: slab row ``l`` is in query ``q``'s window (``0 <= q - l + front <
    window``) and holds the query's segment (rows padded before the first key row and after the
    last hold a segment no query has)."""
    c = step.config
    slab = c.slab(s.read)
    q = jax.lax.broadcasted_iota(jnp.int32, (c.query_block, slab), 0)
    row = jax.lax.broadcasted_iota(jnp.int32, (c.query_block, slab), 1)
    lag = q - row + s.read.front
    same = step.meta(0) == s.ints[0][0:1, :]
    return jnp.where((lag >= 0) & (lag < s.read.window) & same, 1.0, 0.0)


def _count_picks(step: Step, s: ReadRefs):
    """Fill the counts scratch ``[rows / 128 * Qb, 128]``: row ``h * Qb + q``, lane ``l`` is
    how often query ``q`` of the block picked table row ``128 h + l``."""
    c = step.config
    idx = s.ints[0]
    counts = s.bufs["counts"]
    high = s.table.rows // LANES
    width = s.read.width
    picks = idx[...]
    # [width, >= 128]: lane q holds query q's picks (the block padded with -1 rows to whole
    # 128-row tiles before its transpose; the padding's lanes are never read).
    pad = -c.query_block % LANES
    if pad:
        picks = jnp.concatenate([picks, jnp.full((pad, width), -1, jnp.int32)], axis=0)
    picks_t = picks.T
    hi_rows = jax.lax.broadcasted_iota(jnp.int32, (high, width), 0)
    lo_lanes = jax.lax.broadcasted_iota(jnp.int32, (width, LANES), 1)
    for qq in range(c.query_block):
        hi = jnp.right_shift(picks[qq : qq + 1, :], 7)  # -1 -> -1: matches no row
        lo = jnp.bitwise_and(picks_t[:, qq : qq + 1], LANES - 1)
        hi_hot = jnp.where(hi_rows == hi, 1.0, 0.0).astype(jnp.bfloat16)
        lo_hot = jnp.where(lo_lanes == lo, 1.0, 0.0).astype(jnp.bfloat16)
        exact = jax.lax.Precision.DEFAULT  # 0 / 1 operands: bf16 passes are exact
        counts[pl.ds(qq, high, stride=c.query_block), :] = dot(hi_hot, lo_hot, exact)


def start(step: Step, sources) -> None:
    """A step's start: the band slabs' DMAs issued, the tiles sources' pick counts formed."""
    for s in sources:
        if isinstance(s.read, BandRead):
            _band_start(step, s)
        if isinstance(s.read, TilesRead):
            _count_picks(step, s)


def _tile_counts(step: Step, s: ReadRefs, t):
    """``[Qb, tile]``: the counts of tile ``t``."""
    c = step.config
    per = c.tile // LANES
    parts = []
    for p in range(per):
        start = pl.multiple_of((t * per + p) * c.query_block, 8)
        parts.append(s.bufs["counts"][pl.ds(start, c.query_block), :])
    return parts[0] if per == 1 else jnp.concatenate(parts, axis=1)


def _tile_visibility(step: Step, s: ReadRefs, t):
    """``[Qb, tile]``: which entries of tile ``t`` each query sees (its window closed at or
    before the query, in the query's segment)."""
    meta = s.ints[-1].at[t]
    end, segment = meta[0:1, :], meta[1:2, :]
    index, query_segment = step.meta(1), step.meta(2)
    return jnp.where((end >= 0) & (end <= index) & (segment == query_segment), 1.0, 0.0)


def tile_weights(step: Step, s: ReadRefs, t):
    """``[R, tile]`` weights of tile ``t`` of a tiles / dense source."""
    if isinstance(s.read, DenseRead):
        return per_row(_tile_visibility(step, s, t), step.config)
    counts = _tile_counts(step, s, t)
    if s.read.visible:
        counts = counts * _tile_visibility(step, s, t)
    return per_row(counts, step.config)


def vmem(shape: tuple[int, ...], itemsize: int = 4) -> int:
    """Bytes of a VMEM array: its last dimension padded to 128 lanes, the one before to the
    sublanes of its dtype's tiles (8 of 32 bits, 16 of 16 bits)."""
    *lead, rows, lanes = (1, *shape) if len(shape) == 1 else shape
    sublanes = 8 * 4 // itemsize
    n = -(-rows // sublanes) * sublanes * -(-lanes // LANES) * LANES * itemsize
    for d in lead:
        n *= d
    return n
