"""What ``MosaicAttention``'s forward and backward kernels share (``mosaic_forward.py``,
``mosaic_backward.py``; docs/kernels.md, "The Mosaic attention kernel (TPU)"): the
``pallas_call`` over the grid ``(batch, n_q, n_h)``, the blocks and scratch of each kind of read
set (how each is read in a kernel: ``mosaic_reads.py``) and what one grid step shares
(``Step``: its indices and per-query metadata, the per-row weights and scalars, a ``narrow``
kernel's query-side rows).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from .._mosaic import LANES, run_mosaic
from .mosaic_layout import Config, visit_lanes
from .mosaic_reads import BandRead, DenseRead, Read, RowsRead, TilesRead

__all__ = [
    "run_kernel",
    "query_spec",
    "scalar_spec",
    "meta_spec",
    "kernel_ints",
    "read_specs",
    "read_scratch",
    "scratch_of",
    "narrow_scratch",
    "Step",
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


def _int_specs(config: Config, read: Read, backward: bool) -> tuple:
    """The BlockSpecs of a read set's int arrays: rows, its indices ``[B, seq, width]`` in
    SMEM (from a resident table, the flat word-rows of ``kernel_ints``: one array, two in the
    ``backward``), then the same in VMEM as ``[B, seq * width / chunk, chunk]``; tiles, the
    indices in VMEM (``skip``: then the block's visit list in SMEM, ``[B, 1, n_q * lanes]``:
    ``mosaic_layout.tiles_ints``; and, ``visible``, the entries' end and segment per tile as a
    dense set's); dense, the entries' end and segment per tile ``[B, rows / tile, 8,
    tile]``; band, the slab rows' segments ``[B, n_q, 1, slab]``."""
    qb = config.query_block
    if isinstance(read, BandRead):
        return (pl.BlockSpec((None, None, 1, config.slab(read)), lambda b, i, j, *_: (b, i, 0, 0)),)
    entries = (None, config.tables[read.table].rows // config.tile, 8, config.tile)
    entries = pl.BlockSpec(entries, lambda b, i, j, *_: (b, 0, 0, 0))
    if isinstance(read, DenseRead):
        return (entries,)
    if isinstance(read, RowsRead):  # the same indices in VMEM, a chunk a row: the chunks' masks
        chunks = (None, qb * (read.width // config.chunk), config.chunk)
        chunks = pl.BlockSpec(chunks, lambda b, i, j, *_: (b, i, 0))
        if config.tables[read.table].resident:  # one row: batch row b's blocks from b * n_q
            n_q = config.n_q
            flat = (None, qb * read.width)
            flat = pl.BlockSpec(flat, lambda b, i, j, *_: (0, b * n_q + i), memory_space=pltpu.SMEM)
            return (flat, flat, chunks) if backward else (flat, chunks)
        index = (None, qb, read.width)
        index = pl.BlockSpec(index, lambda b, i, j, *_: (b, i, 0), memory_space=pltpu.SMEM)
        return index, chunks
    index = pl.BlockSpec((None, qb, read.width), lambda b, i, j, *_: (b, i, 0))
    own = (index,)
    if read.skip:  # the block's visit list: scalars, a step's own block
        lanes = visit_lanes(config.visited_tiles(read))
        visits = (None, 1, lanes)
        own += (pl.BlockSpec(visits, lambda b, i, j, *_: (b, 0, i), memory_space=pltpu.SMEM),)
    return (*own, entries) if read.visible else own


def kernel_ints(config: Config, ints, backward: bool) -> tuple:
    """Each read set's int arrays as its BlockSpecs take them (``_int_specs``). A rows set from
    a resident table takes, instead of its SMEM indices, each pick's first word-row in the
    table (``max(index, 0) * words``) and in the backward its first gradient word-row (a
    ``-1``'s the spare row past the table's), flat ``[1, B * seq * width]``: formed here, they
    cost the kernel's row loops, bound by their scalar slots, one load a row
    (``RowsRead.each_row``). One row for every batch row: a step's block is then 1-D in the
    kernel with its second-minor dimension whole (Pallas' block rule; ``[B, seq * width]``
    blocks broke it for ``B > 1``), where a ``[B, 1, ...]`` array's 2-D blocks would cost the
    row loops a tiled SMEM address a row."""
    out = []
    for read, group in zip(config.sources, ints, strict=True):
        table = config.tables[read.table]
        if isinstance(read, RowsRead) and table.resident:
            idx = group[0].reshape(1, -1)
            words = [jnp.maximum(idx, 0) * table.words]
            if backward:
                words.append(jnp.where(idx >= 0, idx, table.rows) * config.grad_words(table))
            group = (*words, group[-1])
        out.append(tuple(group))
    return tuple(out)


def read_specs(config: Config, backward: bool) -> tuple[tuple, tuple]:
    """The BlockSpecs of each read set's int arrays (``_int_specs``; the ``backward`` kernel's
    or the forward's), then of each table (HBM,
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
    ints = tuple(_int_specs(config, read, backward) for read in config.sources)
    return ints, tuple(tables)


def read_scratch(config: Config, backward: bool) -> list[tuple[dict, int]]:
    """Per read set, its named scratch buffers and the number of DMA semaphores it uses: rows:
    ``rows`` (two chunks of row words, 2 semaphores; from a resident table one chunk, copied
    then consumed, none) and in the backward ``contributions`` (a chunk's gradient rows);
    tiles: ``counts`` (the block's pick counts); tiles and dense: ``tiles`` (two tiles of
    words, unless the table is resident; 2 semaphores) and in the backward of an ``hbm_grads``
    table ``grads`` (two tiles of gradient words; 4 semaphores: fetches, write-backs); band:
    ``slab`` (1 semaphore)."""
    out = []
    for read in config.sources:
        table = config.tables[read.table]
        word = jnp.int32 if table.packed else jnp.float32
        g, gg = table.words, config.grad_words(table)
        bufs, sems = {}, 0
        if isinstance(read, RowsRead):
            shape = (config.chunk * g, LANES)
            bufs["rows"] = pltpu.VMEM(shape if table.resident else (2, *shape), word)
            sems = 0 if table.resident else 2
            if backward:
                bufs["contributions"] = pltpu.VMEM((config.chunk * gg, LANES), jnp.float32)
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
    rows (and in the backward do's) in the compute dtype (``Step.narrow_in``)."""
    if not config.narrow:
        return ()
    dk, dv = config.key_blocks * LANES, config.value_blocks * LANES
    shapes = [pltpu.VMEM((config.rows, max(dk, dv)), jnp.float32)]
    shapes.append(pltpu.VMEM((config.rows, dk), dtype))
    if backward:
        shapes.append(pltpu.VMEM((config.rows, dv), dtype))
    return tuple(shapes)


class Step(NamedTuple):
    """What one grid step's read sets share: its indices, the prefetched tile counts and its
    per-query metadata; the per-row weights and scalars; a ``narrow`` kernel's query-side
    rows."""

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

    def per_row(self, w):
        """Weights ``[Qb, n]`` per query as ``[R, n]`` per softmax row."""
        qb, hb = self.config.query_block, self.config.head_block
        return jnp.broadcast_to(w[:, None, :], (qb, hb, w.shape[1])).reshape(qb * hb, w.shape[1])

    def visible(self, entries):
        """``[Qb, tile]``: which entries of a tile (``entries``: their end and segment, ``[8,
        tile]``) each query sees (its window closed at or before the query, in the query's
        segment)."""
        end, segment = entries[0:1, :], entries[1:2, :]
        index, query_segment = self.meta(1), self.meta(2)
        return jnp.where((end >= 0) & (end <= index) & (segment == query_segment), 1.0, 0.0)

    def column(self, ref):
        """The step's per-row scalars (a ``[scalar_rows, 128]`` ref) as a lane-broadcast column
        ``[R, 128]``."""
        n = self.config.rows
        rows = [ref[pl.ds(k, 1), :] for k in range(ref.shape[0])]
        row = (rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1))[:, :n]
        return jnp.broadcast_to(row, (LANES, n)).T

    def put_scalars(self, ref, column):
        """Write a lane-broadcast column ``[R, 128]`` into a ``[scalar_rows, 128]`` ref (the
        inverse of ``column``; the padding's lanes are left as they are)."""
        row = column.T[0:1, :]
        for k in range(ref.shape[0]):
            lanes = min(LANES, row.shape[1] - k * LANES)
            ref[pl.ds(k, 1), pl.ds(0, lanes)] = row[:, k * LANES : k * LANES + lanes]

    def narrow_in(self, block, stage, rows, values: bool):
        """Fill ``rows [R, blocks * 128]`` (the compute dtype) from a ``narrow`` block ``[Qb,
        heads * width]`` (``values``: of the values' width): query ``q``'s head ``h`` to row
        ``q * Hb + h``, zeros elsewhere; through the float32 ``stage`` (Mosaic stores strided
        rows of 32-bit words only)."""
        c = self.config
        heads, width = c.narrow[0], c.narrow[2 if values else 1]
        qb, hb, lanes = c.query_block, c.head_block, rows.shape[1]
        stage[:, pl.ds(0, lanes)] = jnp.zeros((c.rows, lanes), jnp.float32)
        for h in range(heads):
            x = block[:, pl.ds(h * width, width)].astype(jnp.float32)
            stage[pl.ds(h, qb, stride=hb), pl.ds(0, width)] = x
        rows[...] = stage[:, pl.ds(0, lanes)].astype(rows.dtype)

    def narrow_out(self, rows, block, values: bool):
        """Write each head's first features of float32 ``rows [R, >= width]`` into a ``narrow``
        block (``narrow_in``'s placement)."""
        c = self.config
        heads, width = c.narrow[0], c.narrow[2 if values else 1]
        qb, hb = c.query_block, c.head_block
        for h in range(heads):
            x = rows[pl.ds(h, qb, stride=hb), pl.ds(0, width)]
            block[:, pl.ds(h * width, width)] = x.astype(block.dtype)


def vmem(shape: tuple[int, ...], itemsize: int = 4) -> int:
    """Bytes of a VMEM array: its last dimension padded to 128 lanes, the one before to the
    sublanes of its dtype's tiles (8 of 32 bits, 16 of 16 bits)."""
    *lead, rows, lanes = (1, *shape) if len(shape) == 1 else shape
    sublanes = 8 * 4 // itemsize
    n = -(-rows // sublanes) * sublanes * -(-lanes // LANES) * LANES * itemsize
    for d in lead:
        n *= d
    return n
