"""The Pallas TPU (Mosaic) kernels of ``MosaicAttention`` (``mosaic.py``): the forward and the
backward of one online softmax over a query block's read sets, the array layouts they read and
write, and what they hold in VMEM (``vmem_bytes``; docs/kernels.md, "The Mosaic attention
kernel (TPU)").

**Rows as granules.** A TPU DMA moves whole 512-byte granules (one row of 128 32-bit lanes), and
Mosaic slices a 128-lane array at any row but a wider one only at whole (8, 128) tiles. Every
key / value table is therefore held as 32-bit words, 128 lanes wide: a table row is ``words``
consecutive word-rows (its keys, then its values when they are neither the keys nor their first
features), two bfloat16 features per word (feature block ``2c`` in the low halves of word-row
``c``, ``2c + 1`` in the high halves) or one float32 feature. One row is one contiguous DMA at
any row offset, and so is a run of rows (a window slab, a tile of entries); a feature block of
``n`` consecutive rows is one strided load (``stride = words``), unpacked by a shift or a mask
and a bit cast (exact). Values that are the keys' first features (``value_words = 0``: V4's
keys, V3.2's latent) are read with the keys, and their gradient adds to the keys'.

**One grid step** takes ``query_block`` queries x ``head_block`` heads: the ``R = Qb * Hb`` rows
of its online softmax, query-major (one query's heads are one aligned window of the state). It
reads, in this order:

- ``"rows"`` sources (gathered rows): per query, its indices in chunks of ``chunk``; a chunk is
  ``chunk`` row DMAs (indices from SMEM: an index block per grid step; ``-1`` fetches row 0 and
  is masked), double-buffered (chunk ``n + 1`` is in flight while ``n`` is computed), or from a
  resident table ``chunk`` vector copies; a chunk's mask is one load of the same indices held
  in VMEM a chunk a row (not built row by row from the scalars: that serial chain cost ~10 %
  of V4-Flash's rows forward at 32k); logits ``[Hb, chunk]`` per query.
- ``"tiles"`` sources (gathered rows as a masked dense pass): the table's tiles of ``tile`` rows
  up to the block's largest index, each row weighted per query by how often the query picked it
  (duplicates repeat the logit, as the reference's gather does). The counts of the whole table
  are formed once per step on the MXU: with ``hi = index >> 7`` and ``lo = index & 127``, a
  query's counts ``[rows / 128, 128]`` are ``onehot(hi)^T @ onehot(lo)``; logits ``[R, tile]``.
- ``"dense"`` sources (``DenseKeys``): the entries' tiles up to the block's last visible one,
  masked by the visibility rule; logits ``[R, tile]``.
- ``"band"`` sources (``BandRows``): one slab of ``front + Qb`` token rows starting at the
  aligned row ``i * Qb`` (the caller pads the rows), fetched by one DMA at the step's start and
  masked to each query's window and segment; logits ``[R, front + Qb]``.

A rows / tiles / dense table lives in HBM (``pl.ANY``: rows and tiles fetched by DMA) or is
``resident`` (the whole table one single-buffered VMEM block per batch row: rows copied by
vector loads, tiles read in place).

**Poisoned queries.** The per-query metadata says which queries live; the forward writes NaN
for the others (whose queries the caller passes as zeros, and in the backward their output
cotangents and coefficients too: their ``dq`` is then zero and nothing of theirs reaches a
key), so no pass over the output masks it.

**The backward** recomputes each chunk's probabilities from the saved ``lse`` (no online state)
and accumulates ``dq`` per step. Each read row's key / value gradients add into a float32
gradient table: in VMEM (``"vmem"``: ``[(rows + 1) * grad_words, 128]``, the spare row taking
the clamped ``-1`` reads of rows sources; written out once per batch row) or, for tiles and
dense sources, in HBM (``"hbm"``: each tile's gradient rows fetched, added to and written back,
double-buffered, so that no VMEM grows with the table; steps run in order, and every write-back
is waited for before its buffer is refilled and at the end of the pass). A band's gradients go
into a VMEM table too (each block's slab added at its first row, ``i * Qb``) or, in HBM, into
one slab per query block (summed over the head blocks), overlap-added by the caller. The sinks'
gradient needs only ``lse`` and the cotangents: the caller forms it.

Per-row scalars (``lse``, the backward's coefficient) travel as ``[ceil(R / 128), 128]`` blocks
(row ``r`` at ``[r // 128, r % 128]``: whole (8, 128) tiles in HBM for ``R = 1024``), turned
into ``[R, 128]`` lane-broadcast columns by one transpose; the online softmax state is ``[R,
128]`` lane-broadcast (``m``, ``l``) and ``[R, dv]``.

``csa_eqx._mosaic.run_mosaic`` runs a kernel: Pallas' TPU interpreter when lowered for the
CPU, Mosaic on a TPU, a ``NotImplementedError`` naming the kernel for any other platform.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from .._mosaic import LANES, dot, dot_nt, precision, run_mosaic
from .base import fold_sink

__all__ = [
    "Table",
    "Source",
    "Config",
    "pack_rows",
    "unpack_rows",
    "query_rows",
    "unquery_rows",
    "narrow_rows",
    "unnarrow_rows",
    "query_meta",
    "row_scalars",
    "unrow_scalars",
    "forward",
    "backward",
    "vmem_bytes",
]


class Table(NamedTuple):
    """A key / value table as the kernels read it (see the module docstring).

    **Arguments:** its ``rows``; ``key_words`` and ``value_words`` per row (``value_words = 0``:
    the values are the keys' first value features); ``packed`` (two bfloat16 features per
    32-bit word, else one float32); ``resident`` (one VMEM block per batch row, else HBM; never
    a band's); ``hbm_grads`` (the backward adds its gradients tile by tile into HBM, a band's
    into one slab per query block, overlap-added by the caller; else into a VMEM table).
    """

    rows: int
    key_words: int
    value_words: int
    packed: bool
    resident: bool
    hbm_grads: bool = False

    @property
    def words(self) -> int:
        """Word-rows per table row."""
        return self.key_words + self.value_words


class Source(NamedTuple):
    """One read set: its ``kind`` (``"rows"``, ``"tiles"``, ``"dense"`` or ``"band"``), its
    ``table`` (index into ``Config.tables``), ``width`` (rows / tiles: index columns per query;
    band: the window), ``front`` (band: slab rows before the block's own, a multiple of the
    query block), ``slot`` (tiles / dense: its row of the tile counts) and ``visible`` (tiles:
    each pick read only where the query sees its entry, by the dense source's rule; its second
    int array the entries' end and segment per tile, as a dense source's)."""

    kind: str
    table: int
    width: int = 0
    front: int = 0
    slot: int = 0
    visible: bool = False


class Config(NamedTuple):
    """The static side of a call.

    **Arguments:** ``tables`` and ``sources``; ``batch``; ``queries`` (query rows) and ``seq``
    (padded to the query block); ``heads`` (padded) and ``head_block``; ``query_block``;
    ``key_blocks`` and ``value_blocks`` (128-feature blocks of the keys and of the output);
    ``chunk`` (rows per gathered chunk); ``tile`` (rows per tile, a multiple of 128);
    ``scale``; ``has_sinks``;
    ``dtype`` (the compute dtype's name: ``"bfloat16"`` or ``"float32"``); ``vmem_limit``
    (bytes); ``narrow``: ``(heads, key width, value width)`` when the query-side arrays (the
    queries, the output, its cotangent, ``dq``) travel unpadded as ``[B, seq, heads * width]``
    (one head block takes every head; padded to the step's rows only in VMEM), else ``()``
    (``query_rows`` layout); ``interpret``: the strategy's field
    (``csa_eqx._backend.kernel_interpret``).
    """

    tables: tuple[Table, ...]
    sources: tuple[Source, ...]
    batch: int
    queries: int
    seq: int
    heads: int
    head_block: int
    query_block: int
    key_blocks: int
    value_blocks: int
    chunk: int
    tile: int
    scale: float
    has_sinks: bool
    dtype: str
    vmem_limit: int
    narrow: tuple[int, ...] = ()
    interpret: object = None

    @property
    def n_q(self) -> int:
        return self.seq // self.query_block

    @property
    def n_h(self) -> int:
        return self.heads // self.head_block

    @property
    def rows(self) -> int:
        """Softmax rows per grid step: ``query_block * head_block``."""
        return self.query_block * self.head_block

    @property
    def scalar_rows(self) -> int:
        """Rows of 128 lanes of a step's per-row scalars: ``ceil(R / 128)``."""
        return -(-self.rows // LANES)

    def slab(self, src: Source) -> int:
        """Rows of a band source's slab."""
        return src.front + self.query_block

    def query_lanes(self, values: bool) -> int:
        """Lanes of a query-side block: the keys' (``values``: the values') features of every
        head when ``narrow``, else ``key_blocks`` (``value_blocks``) x 128 of a softmax row."""
        if self.narrow:
            return self.narrow[0] * self.narrow[2 if values else 1]
        return (self.value_blocks if values else self.key_blocks) * LANES

    def query_shape(self, values: bool) -> tuple[int, ...]:
        """The shape of a query-side array (see ``narrow``)."""
        if self.narrow:
            return (self.batch, self.seq, self.query_lanes(values))
        return (self.batch, self.n_h, self.seq * self.head_block, self.query_lanes(values))

    def grad_words(self, table: Table) -> int:
        """Float32 word-rows per row of a table's gradient."""
        return self.key_blocks + (self.value_blocks if table.value_words else 0)

    def grad_tables(self) -> tuple[int, ...]:
        """The tables the backward returns a gradient table of: those a non-band source reads,
        and the bands whose gradients it adds in VMEM."""
        band = {s.table for s in self.sources if s.kind == "band"}
        return tuple(t for t in range(len(self.tables)) if t not in band or self.in_vmem(t))

    def vmem_grad_tables(self) -> tuple[int, ...]:
        """The tables whose gradients the backward accumulates in VMEM."""
        return tuple(t for t in self.grad_tables() if self.in_vmem(t))

    def in_vmem(self, table: int) -> bool:
        return not self.tables[table].hbm_grads

    def slab_bands(self) -> tuple[int, ...]:
        """The band sources whose gradients are slabs (see ``Table.hbm_grads``)."""
        kinds = enumerate(self.sources)
        return tuple(k for k, s in kinds if s.kind == "band" and not self.in_vmem(s.table))


def _vmem(shape: tuple[int, ...], itemsize: int = 4) -> int:
    """Bytes of a VMEM array: its last dimension padded to 128 lanes, the one before to the
    sublanes of its dtype's tiles (8 of 32 bits, 16 of 16 bits)."""
    *lead, rows, lanes = (1, *shape) if len(shape) == 1 else shape
    sublanes = 8 * 4 // itemsize
    n = -(-rows // sublanes) * sublanes * -(-lanes // LANES) * LANES * itemsize
    for d in lead:
        n *= d
    return n


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
    q, o = _vmem((rows, c.query_lanes(False)), item), _vmem((rows, c.query_lanes(True)), item)
    scalars = _vmem((c.scalar_rows, LANES))
    blocks = [q, o, scalars]  # q, out / do, lse
    if backward:
        blocks += [scalars, q]  # the coefficient, dq
    elif c.has_sinks:
        blocks.append(_vmem((r, LANES)))
    blocks.append(_vmem((8, qb)))  # the per-query metadata
    scratch = [_vmem((r, LANES)), _vmem((r, LANES)), _vmem((r, dk if backward else dv))]
    if c.narrow:  # the float32 staging rows, q's rows (and do's) in the compute dtype
        scratch += [_vmem((r, max(dk, dv))), _vmem((r, dk), item)]
        scratch += [_vmem((r, dv), item)] if backward else []
    work = 0
    for src, (bufs, _) in zip(c.sources, _source_scratch(c, backward), strict=True):
        table = c.tables[src.table]
        gg = c.grad_words(table)
        scratch += [_vmem(b.shape, jnp.dtype(b.dtype).itemsize) for b in bufs.values()]
        lanes = {"rows": c.chunk, "band": c.slab(src)}.get(src.kind, c.tile)
        rows = c.head_block if src.kind == "rows" else r
        live = 7 if backward else 3  # [rows, lanes] float32 values at once
        step = live * _vmem((rows, lanes)) + _vmem((lanes, dk + dv), 4 + item)
        if backward:
            step += _vmem((lanes, gg * LANES)) + _vmem((rows, dk))
        if src.kind == "rows":
            blocks.append(_vmem((qb * (src.width // c.chunk), c.chunk)))
        elif src.kind == "tiles":
            blocks.append(_vmem((qb, src.width)))
            if src.visible:
                blocks.append(_vmem((table.rows // c.tile * 8, c.tile)))
            high, padded = table.rows // LANES, qb + -qb % LANES
            picks = _vmem((padded, src.width)) + _vmem((src.width, padded))  # and transposed
            step = max(step, _vmem((high, src.width), 6) + _vmem((src.width, LANES), 6) + picks)
        elif src.kind == "dense":
            blocks.append(_vmem((table.rows // c.tile * 8, c.tile)))
        elif src.kind == "band":
            blocks.append(_vmem((1, c.slab(src))))
            if backward and table.hbm_grads:
                blocks.append(_vmem((c.slab(src) * gg, LANES)))
        work = max(work, step)
    tables = [t.rows * t.words * LANES * 4 for t in c.tables if t.resident]
    if backward:
        tables += [(c.tables[t].rows + 1) * c.grad_words(c.tables[t]) * LANES * 4
                   for t in c.vmem_grad_tables()]  # fmt: skip
    return 2 * sum(blocks) + sum(tables) + sum(scratch) + work


# --- layouts (plain XLA) --------------------------------------------------------------------


def _words(x: Array, blocks: int, packed: bool) -> Array:
    """``x [B, N, d]`` as 32-bit words ``[B, N, words, 128]`` (``d`` zero-padded to ``blocks``
    128-feature blocks; packed: two bfloat16 blocks per word-row, an odd last one alone in the
    low halves)."""
    b, n, d = x.shape
    x = jnp.pad(x, [(0, 0), (0, 0), (0, blocks * LANES - d)]).reshape(b, n, blocks, LANES)
    if not packed:
        return x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    low, high = bits[:, :, 0::2], jnp.left_shift(bits[:, :, 1::2], 16)
    pairs = high.shape[2]  # an odd last block alone: its low halves (no zero block is formed)
    word = jnp.concatenate([low[:, :, :pairs] | high, low[:, :, pairs:]], axis=2)
    return jax.lax.bitcast_convert_type(word, jnp.int32)


def pack_rows(
    keys: Float[Array, "batch n dk"],
    values: Float[Array, "batch n dv"] | None,
    key_blocks: int,
    value_blocks: int,
    packed: bool,
) -> Array:
    """**Arguments:** a table's ``keys`` and ``values`` (``None``: the keys are the values),
    its key and value feature blocks and whether it is ``packed``.

    **Returns:** its words ``[B, N * words, 128]`` (int32 packed, else float32).
    """
    parts = [_words(keys, key_blocks, packed)]
    if values is not None:
        parts.append(_words(values, value_blocks, packed))
    w = jnp.concatenate(parts, axis=2)
    b, n, g, _ = w.shape
    return w.reshape(b, n * g, LANES)


def unpack_rows(
    grads: Float[Array, "batch words 128"], rows: int, key_blocks: int, value_blocks: int
) -> tuple[Array, Array | None]:
    """**Arguments:** float32 gradient words ``[B, >= rows * words, 128]`` (``words =
    key_blocks + value_blocks``), the ``rows`` and the feature blocks (``value_blocks = 0``: the
    values are the keys).

    **Returns:** ``(d_keys [B, rows, key_blocks * 128], d_values | None)``.
    """
    b = grads.shape[0]
    g = key_blocks + value_blocks
    flat = grads[:, : rows * g].reshape(b, rows, g * LANES)
    d_values = flat[..., key_blocks * LANES :] if value_blocks else None
    return flat[..., : key_blocks * LANES], d_values


def query_rows(x: Array, config: Config) -> Array:
    """``x [B, seq, heads, w]`` (padded) in the kernels' ``[B, n_h, seq * head_block, w]``."""
    b, s, _, w = x.shape
    x = x.reshape(b, s, config.n_h, config.head_block, w).transpose(0, 2, 1, 3, 4)
    return x.reshape(b, config.n_h, s * config.head_block, w)


def unquery_rows(x: Array, config: Config) -> Array:
    """The inverse of ``query_rows``."""
    b, _, _, w = x.shape
    x = x.reshape(b, config.n_h, config.seq, config.head_block, w).transpose(0, 2, 1, 3, 4)
    return x.reshape(b, config.seq, config.heads, w)


def narrow_rows(x: Array, config: Config) -> Array:
    """``x [B, seq, heads, w]`` (its queries padded, not its heads nor ``w``) in the
    ``narrow`` layout ``[B, seq, heads * w]``."""
    return x.reshape(x.shape[0], config.seq, -1)


def unnarrow_rows(x: Array, config: Config) -> Array:
    """The inverse of ``narrow_rows``."""
    return x.reshape(x.shape[0], config.seq, config.narrow[0], -1)


def query_meta(rows: Int[Array, "batch k seq"], query_block: int) -> Array:
    """The per-query metadata ``[B, n_q, 8, Qb]`` from its rows ``[B, k <= 8, seq]`` (queries
    padded to the ``query_block``; row 0: the band segment, 1: the dense query index, 2: the
    dense query segment, 3: 1 where the query lives, 0 where a non-finite row poisons it: its
    output NaN): in HBM a block is 8 rows of ``Qb``
    lanes (padded to 128: 2x at 64 queries), where ``[B, seq, 8]`` would pad its 8 lanes to
    128 (16x)."""
    b, k, _ = rows.shape
    rows = jnp.pad(rows, [(0, 0), (0, 8 - k), (0, 0)])
    return rows.reshape(b, 8, -1, query_block).transpose(0, 2, 1, 3)


def row_scalars(x: Float[Array, "batch seq heads"], config: Config) -> Array:
    """Per-row scalars ``[B, seq, heads]`` (padded) as ``[B, n_h, n_q, scalar_rows, 128]`` (a
    step's ``R`` rows in order, zero-padded to whole rows of 128)."""
    c, b = config, x.shape[0]
    x = query_rows(x[..., None], c).reshape(b, c.n_h, c.n_q, c.rows)
    x = jnp.pad(x, [(0, 0)] * 3 + [(0, c.scalar_rows * LANES - c.rows)])
    return x.reshape(b, c.n_h, c.n_q, c.scalar_rows, LANES)


def unrow_scalars(x: Array, config: Config) -> Array:
    """The inverse of ``row_scalars``."""
    c, b = config, x.shape[0]
    x = x.reshape(b, c.n_h, c.n_q, c.scalar_rows * LANES)[..., : c.rows]
    return unquery_rows(x.reshape(b, c.n_h, c.seq * c.head_block, 1), c)[..., 0]


# --- running a kernel -----------------------------------------------------------------------


def _pallas(kernel, config: Config, interpret, name: str, in_specs, out_specs, out_shape,
            scratch, semantics, aliases=None):  # fmt: skip
    """The ``pallas_call`` of a kernel over the grid ``(batch, n_q, n_h)`` (``interpret``: as
    ``run_mosaic`` decides it, ``False`` to compile; ``aliases``: input -> output, the scalar
    prefetch counted)."""
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(config.batch, config.n_q, config.n_h),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    params = None
    if interpret is False:
        params = pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=config.vmem_limit
        )
    return pl.pallas_call(
        functools.partial(kernel, config, interpret is not False),
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=params,
        input_output_aliases=aliases or {},
        name=name,
    )


# --- specs and scratch ----------------------------------------------------------------------


def _query_spec(config: Config, values: bool):
    """The blocks of a query-side array: ``[R, width]`` of ``query_rows``, or ``[Qb, heads *
    width]`` of a ``narrow`` one (every head: its head block index is always 0)."""
    lanes = config.query_lanes(values)
    if config.narrow:
        return pl.BlockSpec((None, config.query_block, lanes), lambda b, i, j, *_: (b, i, 0))
    return pl.BlockSpec((None, None, config.rows, lanes), lambda b, i, j, *_: (b, j, i, 0))


def _scalar_spec(config: Config):
    """``[scalar_rows, 128]`` blocks of a ``row_scalars`` array."""
    shape = (None, None, None, config.scalar_rows, LANES)
    return pl.BlockSpec(shape, lambda b, i, j, *_: (b, j, i, 0, 0))


def _meta_spec(config: Config):
    """``[8, Qb]`` blocks of the per-query metadata (``query_meta``)."""
    shape = (None, None, 8, config.query_block)
    return pl.BlockSpec(shape, lambda b, i, j, *_: (b, i, 0, 0))


def _n_ints(src: Source) -> int:
    """How many int arrays a source reads (``_source_specs``)."""
    return 2 if src.visible or src.kind == "rows" else 1


def _source_specs(config: Config) -> list:
    """The BlockSpecs of each source's int arrays (rows: its indices ``[B, seq, width]`` in
    SMEM, then the same in VMEM as ``[B, seq * width / chunk, chunk]``; tiles: the indices in
    VMEM; dense: the entries' end and segment per tile ``[B, rows / tile, 8, tile]``, as a
    visible tiles source's second; band: the slab rows' segments ``[B, n_q, 1, slab]``), then
    of each table (HBM, or a single-buffered VMEM block per batch row, its batch dimension
    kept: a DMA from a block whose batch dimension is squeezed is lowered with too few
    indices, which Mosaic's verifier rejects)."""
    qb = config.query_block
    specs = []
    for src in config.sources:
        if src.kind in ("rows", "tiles"):
            space = pltpu.SMEM if src.kind == "rows" else None
            index = pl.BlockSpec((None, qb, src.width), lambda b, i, j, *_: (b, i, 0),
                                 memory_space=space)  # fmt: skip
            specs.append(index)
        if src.kind == "rows":  # the same indices in VMEM, a chunk a row: the chunks' masks
            shape = (None, qb * (src.width // config.chunk), config.chunk)
            specs.append(pl.BlockSpec(shape, lambda b, i, j, *_: (b, i, 0)))
        if src.kind == "dense" or src.visible:
            shape = (None, config.tables[src.table].rows // config.tile, 8, config.tile)
            specs.append(pl.BlockSpec(shape, lambda b, i, j, *_: (b, 0, 0, 0)))
        elif src.kind == "band":
            slab = config.slab(src)
            specs.append(pl.BlockSpec((None, None, 1, slab), lambda b, i, j, *_: (b, i, 0, 0)))
    for table in config.tables:
        if table.resident:
            shape = (1, table.rows * table.words, LANES)
            specs.append(
                pl.BlockSpec(shape, lambda b, i, j, *_: (b, 0, 0), pipeline_mode=pl.Buffered(1))
            )
        else:
            specs.append(pl.BlockSpec(memory_space=pl.ANY))
    return specs


def _source_scratch(config: Config, backward: bool) -> list[tuple[dict, int]]:
    """Per source, its named scratch buffers and the number of DMA semaphores it uses: rows:
    ``rows`` (two chunks of row words), ``masks`` (theirs) and in the backward ``contributions``
    (a chunk's gradient rows); tiles: ``counts`` (the block's pick counts); tiles and dense:
    ``tiles`` (two tiles of words, unless the table is resident; 2 semaphores) and in the
    backward of an ``hbm_grads`` table ``grads`` (two tiles of gradient words; 4 semaphores:
    fetches, write-backs); band: ``slab`` (1 semaphore)."""
    out = []
    for src in config.sources:
        table = config.tables[src.table]
        word = jnp.int32 if table.packed else jnp.float32
        g, gg = table.words, config.grad_words(table)
        bufs, sems = {}, 0
        if src.kind == "rows":
            bufs["rows"] = pltpu.VMEM((2, config.chunk * g, LANES), word)
            if backward:
                bufs["contributions"] = pltpu.VMEM((config.chunk * gg, LANES), jnp.float32)
            sems = 2
        elif src.kind == "band":
            bufs["slab"] = pltpu.VMEM((config.slab(src) * g, LANES), word)
            sems = 1
        else:
            if src.kind == "tiles":
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


def _narrow_scratch(config: Config, dtype, backward: bool) -> list:
    """A ``narrow`` kernel's VMEM for its query-side rows: the float32 staging rows, then q's
    rows (and in the backward do's) in the compute dtype (``_narrow_in``)."""
    if not config.narrow:
        return []
    dk, dv = config.key_blocks * LANES, config.value_blocks * LANES
    shapes = [pltpu.VMEM((config.rows, max(dk, dv)), jnp.float32)]
    shapes.append(pltpu.VMEM((config.rows, dk), dtype))
    if backward:
        shapes.append(pltpu.VMEM((config.rows, dv), dtype))
    return shapes


def _scratch_shapes(per_source: list[tuple[dict, int]], extra_sems: int = 0) -> list:
    """The sources' scratch buffers, then one array of every DMA semaphore."""
    shapes = [shape for buffers, _ in per_source for shape in buffers.values()]
    n_sems = sum(sems for _, sems in per_source) + extra_sems
    return [*shapes, pltpu.SemaphoreType.DMA((max(n_sems, 1),))]


class _SourceRefs(NamedTuple):
    """A source's refs in a kernel: its ``ints``, its table ``tab``, its named scratch ``bufs``,
    its DMA semaphores ``sems`` (a slice of them, ``None`` if it uses none) and, in the backward
    of an ``hbm_grads`` table, the table's gradient words in HBM ``grads``."""

    src: Source
    table: Table
    ints: tuple
    tab: object
    bufs: dict
    sems: object
    grads: object = None


class _Refs:
    """Takes a kernel's refs in the order its wrapper passes them."""

    def __init__(self, refs):
        self._refs = list(refs)

    def take(self, n: int | None = None):
        k = 1 if n is None else n
        out, self._refs = self._refs[:k], self._refs[k:]
        return out[0] if n is None else tuple(out)

    def rest(self) -> tuple:
        return self.take(len(self._refs))


def _source_refs(config: Config, ints, tables, scratch, sems, backward: bool, grads=None):
    """Each source's ``_SourceRefs`` (``ints``: their int refs; ``scratch``: the refs of
    ``_source_scratch``'s buffers; ``grads``: table -> its HBM gradient words) and the number of
    semaphores they use."""
    scratch = _Refs(scratch)
    out, k = [], 0
    for src, src_ints, (shapes, n_sems) in zip(
        config.sources, ints, _source_scratch(config, backward), strict=True
    ):
        sem = None
        if n_sems:
            sem = sems.at[k] if src.kind == "band" else sems.at[pl.ds(k, n_sems)]
        table = config.tables[src.table]
        bufs = dict(zip(shapes, scratch.take(len(shapes)), strict=True))
        hbm = None if grads is None else grads.get(src.table)
        out.append(_SourceRefs(src, table, src_ints, tables[src.table], bufs, sem, hbm))
        k += n_sems
    return out, k


# --- in-kernel pieces -----------------------------------------------------------------------


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


def _keys_values(words, offset, n: int, table: Table, config: Config):
    """The keys ``[n, dk]`` and values ``[n, dv]`` of ``n`` consecutive rows."""
    dtype = jnp.dtype(config.dtype)
    keys = _features(words, offset, n, table, 0, config.key_blocks, dtype)
    if table.value_words:
        values = _features(words, offset, n, table, table.key_words, config.value_blocks, dtype)
    else:
        values = keys[:, : config.value_blocks * LANES]
    return keys, values


def _per_row(w, config: Config):
    """Weights ``[Qb, n]`` per query as ``[R, n]`` per softmax row."""
    qb, hb = config.query_block, config.head_block
    return jnp.broadcast_to(w[:, None, :], (qb, hb, w.shape[1])).reshape(qb * hb, w.shape[1])


def _column(ref, n: int):
    """A step's ``n`` per-row scalars (a ``[scalar_rows, 128]`` ref) as a lane-broadcast column
    ``[n, 128]``."""
    rows = [ref[pl.ds(k, 1), :] for k in range(ref.shape[0])]
    row = (rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1))[:, :n]
    return jnp.broadcast_to(row, (LANES, n)).T


def _put_scalars(ref, column):
    """Write a lane-broadcast column ``[n, 128]`` into a ``[scalar_rows, 128]`` ref (the
    inverse of ``_column``; the padding's lanes are left as they are)."""
    row = column.T[0:1, :]
    for k in range(ref.shape[0]):
        lanes = min(LANES, row.shape[1] - k * LANES)
        ref[pl.ds(k, 1), pl.ds(0, lanes)] = row[:, k * LANES : k * LANES + lanes]


def _narrow_in(config: Config, block, stage, rows, values: bool):
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


def _narrow_out(config: Config, rows, block, values: bool):
    """Write each head's first features of float32 ``rows [R, >= width]`` into a ``narrow``
    block (``_narrow_in``'s placement)."""
    heads, width = config.narrow[0], config.narrow[2 if values else 1]
    qb, hb = config.query_block, config.head_block
    for h in range(heads):
        x = rows[pl.ds(h, qb, stride=hb), pl.ds(0, width)]
        block[:, pl.ds(h * width, width)] = x.astype(block.dtype)


def _table_ref(ref, table: Table, b, offset, n: int):
    """Word-rows ``offset .. offset + n`` of batch row ``b`` of a table (resident: of its block,
    whose batch dimension is kept: see ``_source_specs``)."""
    return ref.at[0 if table.resident else b, pl.ds(offset, n), :]


def _wait(buf, sem):
    """Wait for every DMA into ``buf`` signalled on ``sem`` (their sizes add up to its size)."""
    pltpu.make_async_copy(buf, buf, sem).wait()


class _Step(NamedTuple):
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

    def count(self, src: Source):
        """The number of tiles the block reads from a tiles / dense source."""
        c = self.config
        return self.ntiles[(src.slot * c.batch + self.b) * c.n_q + self.i]


def _rows_pipeline(step: _Step, s: _SourceRefs, consume):
    """Gathered rows, per query (the block's queries, not its padding) in chunks of ``chunk``
    rows (DMAs, double-buffered, or from a resident table vector copies): ``consume(query,
    chunk, words_ref, mask [1, chunk])`` for each chunk, the mask read from the indices' VMEM
    copy (a chunk a row) in one load."""
    c = step.config
    size, g = c.chunk, s.table.words
    idx, chunks = s.ints
    buf = s.bufs["rows"]
    per_query = s.src.width // size
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


def _tiles_pipeline(step: _Step, s: _SourceRefs, consume):
    """The table's first ``count`` tiles (double-buffered DMAs, or read in place from a
    resident table): ``consume(t, words_ref, word_offset, grads_ref)`` for each, where
    ``grads_ref`` is ``None``, or (the backward of an ``hbm_grads`` table) tile ``t``'s gradient
    words fetched from HBM, to add to: they are written back after ``consume``. A buffer is
    refilled only once its write-back is done, and the pass ends when every write-back is."""
    c = step.config
    n = step.count(s.src)
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


def _band_start(step: _Step, s: _SourceRefs):
    """Start the DMA of the block's band slab (token rows ``i * Qb ..``)."""
    span = step.config.slab(s.src) * s.table.words
    offset = pl.multiple_of(step.i * step.config.query_block * s.table.words, 8)
    slab = _table_ref(s.tab, s.table, step.b, offset, span)
    pltpu.make_async_copy(slab, s.bufs["slab"], s.sems).start()


def _band_words(s: _SourceRefs):
    """The block's slab words, once they have arrived."""
    _wait(s.bufs["slab"], s.sems)
    return s.bufs["slab"]


def _band_weights(step: _Step, s: _SourceRefs):
    """``[Qb, slab]``: slab row ``l`` is in query ``q``'s window (``0 <= q - l + front <
    window``) and holds the query's segment (rows padded before the first key row and after the
    last hold a segment no query has)."""
    c = step.config
    slab = c.slab(s.src)
    q = jax.lax.broadcasted_iota(jnp.int32, (c.query_block, slab), 0)
    row = jax.lax.broadcasted_iota(jnp.int32, (c.query_block, slab), 1)
    lag = q - row + s.src.front
    same = step.meta(0) == s.ints[0][0:1, :]
    return jnp.where((lag >= 0) & (lag < s.src.width) & same, 1.0, 0.0)


def _count_picks(step: _Step, s: _SourceRefs):
    """Fill the counts scratch ``[rows / 128 * Qb, 128]``: row ``h * Qb + q``, lane ``l`` is
    how often query ``q`` of the block picked table row ``128 h + l``."""
    c = step.config
    idx = s.ints[0]
    counts = s.bufs["counts"]
    high = s.table.rows // LANES
    width = s.src.width
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


def _start(step: _Step, sources) -> None:
    """A step's start: the band slabs' DMAs issued, the tiles sources' pick counts formed."""
    for s in sources:
        if s.src.kind == "band":
            _band_start(step, s)
        if s.src.kind == "tiles":
            _count_picks(step, s)


def _tile_counts(step: _Step, s: _SourceRefs, t):
    """``[Qb, tile]``: the counts of tile ``t``."""
    c = step.config
    per = c.tile // LANES
    parts = []
    for p in range(per):
        start = pl.multiple_of((t * per + p) * c.query_block, 8)
        parts.append(s.bufs["counts"][pl.ds(start, c.query_block), :])
    return parts[0] if per == 1 else jnp.concatenate(parts, axis=1)


def _tile_visibility(step: _Step, s: _SourceRefs, t):
    """``[Qb, tile]``: which entries of tile ``t`` each query sees (its window closed at or
    before the query, in the query's segment)."""
    meta = s.ints[-1].at[t]
    end, segment = meta[0:1, :], meta[1:2, :]
    index, query_segment = step.meta(1), step.meta(2)
    return jnp.where((end >= 0) & (end <= index) & (segment == query_segment), 1.0, 0.0)


def _tile_weights(step: _Step, s: _SourceRefs, t):
    """``[R, tile]`` weights of tile ``t`` of a tiles / dense source."""
    if s.src.kind == "dense":
        return _per_row(_tile_visibility(step, s, t), step.config)
    counts = _tile_counts(step, s, t)
    if s.src.visible:
        counts = counts * _tile_visibility(step, s, t)
    return _per_row(counts, step.config)


# --- forward --------------------------------------------------------------------------------


def _update(state, rows, s, w, values, precision):
    """One online-softmax step of state rows ``rows`` over logits ``s`` weighted by ``w``
    (``0``: not read; a count repeats the logit)."""
    m_ref, l_ref, acc_ref = state
    m_prev = m_ref[rows, :]
    s = jnp.where(w > 0, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - shift)
    p = jnp.where(w > 0, w * jnp.exp(s - shift[:, 0:1]), 0.0)
    l_ref[rows, :] = alpha * l_ref[rows, :] + jnp.sum(p, axis=1, keepdims=True)
    pv = dot(p.astype(values.dtype), values, precision)
    acc_ref[rows, :] = acc_ref[rows, :] * alpha[:, 0:1] + pv
    m_ref[rows, :] = m_new


def _forward_kernel(config: Config, interpret: bool, ntiles_ref, *refs):
    refs = _Refs(refs)
    q_ref = refs.take()
    sink_ref = refs.take() if config.has_sinks else None
    qmeta_ref = refs.take()
    ints = [refs.take(_n_ints(src)) for src in config.sources]
    tables = refs.take(len(config.tables))
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs.take(5)
    if config.narrow:
        stage_ref, rows_ref = refs.take(2)
        _narrow_in(config, q_ref, stage_ref, rows_ref, values=False)
        q_ref = rows_ref
    *scratch, sems = refs.rest()
    sources, _ = _source_refs(config, ints, tables, scratch, sems, backward=False)
    step = _Step(config, interpret, pl.program_id(0), pl.program_id(1), ntiles_ref, qmeta_ref)
    prec, scale, hb = precision(config.dtype), config.scale, config.head_block
    state = (m_ref, l_ref, acc_ref)
    everything = pl.ds(0, config.rows)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    _start(step, sources)
    for s in sources:
        if s.src.kind == "rows":

            def consume(qq, cc, words, mask, s=s):
                keys, values = _keys_values(words, 0, config.chunk, s.table, config)
                rows = pl.ds(pl.multiple_of(qq * hb, hb), hb)
                logits = dot_nt(q_ref[rows, :], keys, prec) * scale
                _update(state, rows, logits, mask, values, prec)

            _rows_pipeline(step, s, consume)
        elif s.src.kind in ("tiles", "dense"):

            def consume(t, words, offset, _, s=s):
                keys, values = _keys_values(words, offset, config.tile, s.table, config)
                logits = dot_nt(q_ref[...], keys, prec) * scale
                _update(state, everything, logits, _tile_weights(step, s, t), values, prec)

            _tiles_pipeline(step, s, consume)

    for s in sources:
        if s.src.kind == "band":
            words = _band_words(s)
            keys, values = _keys_values(words, 0, config.slab(s.src), s.table, config)
            w = _per_row(_band_weights(step, s), config)
            logits = dot_nt(q_ref[...], keys, prec) * scale
            _update(state, everything, logits, w, values, prec)

    m, l_sum, acc = m_ref[...], l_ref[...], acc_ref[...]
    if config.has_sinks:
        shift, l_sum, alpha = fold_sink(m, l_sum, sink_ref[...])
        acc = acc * alpha[:, 0:1]
    else:
        shift = jnp.where(m == -jnp.inf, 0.0, m)
    norm = jnp.where(l_sum > 0, l_sum, 1.0)
    live = _per_row(step.meta(3), config) > 0  # [R, 1]: else poisoned, NaN
    out = jnp.where(live, acc / norm[:, 0:1], jnp.nan)
    if config.narrow:
        acc_ref[...] = out
        _narrow_out(config, acc_ref, out_ref, values=True)
    else:
        out_ref[...] = out.astype(out_ref.dtype)
    _put_scalars(lse_ref, shift + jnp.log(l_sum))


def forward(
    config: Config,
    ntiles: Int[Array, " n"],
    q: Array,
    sink: Array | None,
    qmeta: Array,
    ints: tuple,
    tables: tuple,
) -> tuple[Array, Array]:
    """The forward kernel.

    **Arguments:** the ``config``; the tile counts ``[n_tiled * B * n_q]`` (at least one
    element); ``q`` (``query_rows`` or ``narrow_rows`` layout, ``query_lanes`` wide); the sink
    logit of each row of a step ``[n_h, R, 128]`` (or ``None``); the per-query metadata
    (``query_meta``: row 3 says which queries live); each source's int arrays (a tuple each,
    ``_source_specs``); each table's words (``pack_rows``).

    **Returns:** ``(out`` (``q``'s layout, the values' ``query_lanes`` wide, ``q``'s
    dtype; NaN for the queries that do not live), ``lse`` (``row_scalars`` layout, float32,
    ``-inf`` where a row reads nothing)``)``.
    """
    c = config
    dv = c.value_blocks * LANES
    in_specs = [_query_spec(c, values=False)]
    args = [q]
    if c.has_sinks:
        in_specs.append(pl.BlockSpec((None, c.rows, LANES), lambda b, i, j, *_: (j, 0, 0)))
        args.append(sink)
    in_specs.append(_meta_spec(c))
    args.append(qmeta)
    args += [a for group in ints for a in group] + list(tables)
    scratch = [
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        pltpu.VMEM((c.rows, dv), jnp.float32),
        *_narrow_scratch(c, q.dtype, backward=False),
        *_scratch_shapes(_source_scratch(c, backward=False)),
    ]
    out_shape = (
        jax.ShapeDtypeStruct(c.query_shape(values=True), q.dtype),
        jax.ShapeDtypeStruct((c.batch, c.n_h, c.n_q, c.scalar_rows, LANES), jnp.float32),
    )

    def build(interpret, out_shape):
        return _pallas(
            _forward_kernel, c, interpret, "mosaic_sparse_attention",
            in_specs + _source_specs(c), [_query_spec(c, True), _scalar_spec(c)], out_shape,
            scratch, ("parallel", "parallel", "arbitrary"),
        )  # fmt: skip

    return run_mosaic(
        "mosaic_sparse_attention", build, out_shape, ntiles, *args, interpret=c.interpret
    )


# --- backward -------------------------------------------------------------------------------


def _put(ref, offset, n: int, gg: int, blocks: list, add: bool):
    """Write (``add``: add) ``n`` rows of gradient ``blocks`` (``[n, 128]`` each, one per word-row
    of a gradient row, ``len(blocks) == gg``) into float32 word-rows of ``ref`` from
    ``offset``."""
    for f, x in enumerate(blocks):
        win = pl.ds(offset + f, n, stride=gg)
        ref[win, :] = ref[win, :] + x if add else x


class _Cotangents(NamedTuple):
    """A backward step's refs: queries, output cotangents, ``lse`` and coefficient columns
    ``[R, 128]``, the ``dq`` accumulator."""

    q: object
    do: object
    lse: object
    coeff: object
    dq: object


def _grads(ctx: _Cotangents, config: Config, rows, keys, values, w, table: Table) -> list:
    """The backward of one chunk: adds to ``dq``'s rows; returns the chunk rows' gradient in
    ``[n, 128]`` blocks, one per word-row of the table's gradient rows (the keys', then the
    values' of their own; values that are the keys' first features add to those)."""
    prec, scale = precision(config.dtype), config.scale
    q, do = ctx.q[rows, :], ctx.do[rows, :]
    lse, coeff = ctx.lse[rows, :][:, 0:1], ctx.coeff[rows, :][:, 0:1]
    s = dot_nt(q, keys, prec) * scale
    p = jnp.where(w > 0, w * jnp.exp(s - lse), 0.0)
    ds = p * (dot_nt(do, values, prec) + coeff)
    ctx.dq[rows, :] = ctx.dq[rows, :] + dot(ds.astype(keys.dtype), keys, prec) * scale
    d_keys = dot(ds.T.astype(q.dtype), q, prec) * scale
    d_values = dot(p.T.astype(do.dtype), do, prec)
    blocks = [d_keys[:, f * LANES : (f + 1) * LANES] for f in range(config.key_blocks)]
    values = [d_values[:, f * LANES : (f + 1) * LANES] for f in range(config.value_blocks)]
    if table.value_words:
        return blocks + values
    return [b + v for b, v in zip(blocks, values, strict=False)] + blocks[len(values) :]


def _backward_kernel(config: Config, interpret: bool, ntiles_ref, *refs):
    refs = _Refs(refs)
    q_ref, do_ref, lse_ref, coeff_ref = refs.take(4)
    qmeta_ref = refs.take()
    ints = [refs.take(_n_ints(src)) for src in config.sources]
    tables = refs.take(len(config.tables))
    gathered, in_vmem = config.grad_tables(), config.vmem_grad_tables()
    refs.take(len(gathered) - len(in_vmem))  # the zeros aliased to the HBM gradient tables
    dq_out = refs.take()
    grad_out = dict(zip(gathered, refs.take(len(gathered)), strict=True))
    bands = config.slab_bands()
    band_out = dict(zip(bands, refs.take(len(bands)), strict=True))
    dq_ref, lsec_ref, coeffc_ref = refs.take(3)
    if config.narrow:
        stage_ref, q_rows, do_rows = refs.take(3)
        _narrow_in(config, q_ref, stage_ref, q_rows, values=False)
        _narrow_in(config, do_ref, stage_ref, do_rows, values=True)
        q_ref, do_ref = q_rows, do_rows
    grad_acc = dict(zip(in_vmem, refs.take(len(in_vmem)), strict=True))
    *scratch, sems = refs.rest()
    in_hbm = {t: grad_out[t] for t in gathered if t not in grad_acc}
    sources, n_used = _source_refs(config, ints, tables, scratch, sems, True, in_hbm)
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    step = _Step(config, interpret, b, i, ntiles_ref, qmeta_ref)
    hb = config.head_block
    everything = pl.ds(0, config.rows)

    @pl.when((i == 0) & (j == 0))
    def _():
        for acc in grad_acc.values():
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)
    lsec_ref[...] = _column(lse_ref, config.rows)
    coeffc_ref[...] = _column(coeff_ref, config.rows)
    ctx = _Cotangents(q_ref, do_ref, lsec_ref, coeffc_ref, dq_ref)
    _start(step, sources)
    for s in sources:
        gg = config.grad_words(s.table)
        if s.src.kind == "rows":
            acc, spare = grad_acc[s.src.table], s.table.rows  # spare: where a -1 read adds

            def consume(qq, cc, words, mask, s=s, acc=acc, spare=spare, gg=gg):
                keys, values = _keys_values(words, 0, config.chunk, s.table, config)
                rows = pl.ds(pl.multiple_of(qq * hb, hb), hb)
                blocks = _grads(ctx, config, rows, keys, values, mask, s.table)
                contributions = s.bufs["contributions"]
                _put(contributions, 0, config.chunk, gg, blocks, add=False)
                base = cc * config.chunk

                def add(jj, carry):
                    r = s.ints[0][qq, base + jj]
                    dst = pl.ds(jnp.where(r >= 0, r, spare) * gg, gg)
                    acc[dst, :] = acc[dst, :] + contributions[pl.ds(jj * gg, gg), :]
                    return carry

                jax.lax.fori_loop(0, config.chunk, add, 0, unroll=step.unroll(config.chunk))

            _rows_pipeline(step, s, consume)
        elif s.src.kind in ("tiles", "dense"):
            acc = grad_acc.get(s.src.table)

            def consume(t, words, offset, into, s=s, acc=acc, gg=gg):
                keys, values = _keys_values(words, offset, config.tile, s.table, config)
                w = _tile_weights(step, s, t)
                blocks = _grads(ctx, config, everything, keys, values, w, s.table)
                if into is None:  # the VMEM table's rows of tile t
                    into, at = acc, pl.multiple_of(t * config.tile * gg, 8)
                else:  # tile t's rows, fetched from the HBM table
                    at = 0
                _put(into, at, config.tile, gg, blocks, add=True)

            _tiles_pipeline(step, s, consume)

    for k, s in enumerate(sources):
        if s.src.kind != "band":
            continue
        slab, gg = config.slab(s.src), config.grad_words(s.table)
        if k in band_out:  # the block's slab, summed over the head blocks
            into, at = band_out[k], 0

            @pl.when(j == 0)
            def _(out=into):
                out[...] = jnp.zeros(out.shape, jnp.float32)

        else:  # the VMEM table's rows from the slab's first, i * Qb
            into, at = grad_acc[s.src.table], pl.multiple_of(i * config.query_block * gg, 8)
        keys, values = _keys_values(_band_words(s), 0, slab, s.table, config)
        w = _per_row(_band_weights(step, s), config)
        blocks = _grads(ctx, config, everything, keys, values, w, s.table)
        _put(into, at, slab, gg, blocks, add=True)

    if config.narrow:
        _narrow_out(config, dq_ref, dq_out, values=False)
    else:
        dq_out[...] = dq_ref[...].astype(dq_out.dtype)

    @pl.when((i == config.n_q - 1) & (j == config.n_h - 1))
    def _():
        copies = [
            pltpu.make_async_copy(grad_acc[t], grad_out[t].at[b], sems.at[n_used + k])
            for k, t in enumerate(in_vmem)
        ]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()


def backward(
    config: Config,
    ntiles: Array,
    q: Array,
    do: Array,
    lse: Array,
    coeff: Array,
    qmeta: Array,
    ints: tuple,
    tables: tuple,
) -> tuple[Array, dict, dict]:
    """The backward kernel.

    **Arguments:** as ``forward`` (without the sinks), plus the output's cotangent ``do``
    (``query_rows`` layout, ``value_blocks * 128`` wide, ``q``'s dtype), the forward's ``lse``
    and ``coeff = g_lse - sum(do * out)`` (both ``row_scalars`` layout, float32).

    **Returns:** ``(dq`` (``q``'s layout and dtype), ``{table: float32 gradient words [B,
    >= rows * grad_words, 128]}`` for the tables of ``grad_tables``, ``{source: slab gradient
    words [B, n_q, slab * grad_words, 128]}`` for the band sources of ``slab_bands``)``.
    """
    c = config
    dk = c.key_blocks * LANES
    in_specs = [_query_spec(c, False), _query_spec(c, True), _scalar_spec(c), _scalar_spec(c)]
    args = [q, do, lse, coeff]
    in_specs.append(_meta_spec(c))
    args.append(qmeta)
    args += [a for group in ints for a in group] + list(tables)
    gathered, in_vmem = c.grad_tables(), c.vmem_grad_tables()
    bands = c.slab_bands()
    out_shape = [jax.ShapeDtypeStruct(c.query_shape(values=False), q.dtype)]
    out_specs = [_query_spec(c, False)]
    grad_shapes, aliases = [], {}
    for t in gathered:
        span = (c.tables[t].rows + 1) * c.grad_words(c.tables[t])
        out_shape.append(jax.ShapeDtypeStruct((c.batch, span, LANES), jnp.float32))
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        if t in in_vmem:
            grad_shapes.append(pltpu.VMEM((span, LANES), jnp.float32))
        else:  # added to in place, tile by tile: starts as zeros (+1: the scalar prefetch)
            aliases[1 + len(args)] = len(out_shape) - 1
            in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
            args.append(jnp.zeros((c.batch, span, LANES), jnp.float32))
    for k in bands:
        span = c.slab(c.sources[k]) * c.grad_words(c.tables[c.sources[k].table])
        out_shape.append(jax.ShapeDtypeStruct((c.batch, c.n_q, span, LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, span, LANES), lambda b, i, j, *_: (b, i, 0, 0)))
    scratch = [
        pltpu.VMEM((c.rows, dk), jnp.float32),
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        *_narrow_scratch(c, q.dtype, backward=True),
        *grad_shapes,
        *_scratch_shapes(_source_scratch(c, backward=True), extra_sems=len(in_vmem)),
    ]
    out_shape = tuple(out_shape)
    n_sources = len(in_specs) - (len(gathered) - len(in_vmem))  # the specs before the zeros
    specs = in_specs[:n_sources] + _source_specs(c) + in_specs[n_sources:]

    def build(interpret, out_shape):
        return _pallas(
            _backward_kernel, c, interpret, "mosaic_sparse_attention_bwd", specs, out_specs,
            out_shape, scratch, ("arbitrary", "arbitrary", "arbitrary"), aliases,
        )  # fmt: skip

    name = "mosaic_sparse_attention_bwd"
    dq, *rest = run_mosaic(name, build, out_shape, ntiles, *args, interpret=c.interpret)
    grads = dict(zip(gathered, rest[: len(gathered)], strict=True))
    slabs = dict(zip(bands, rest[len(gathered) :], strict=True))
    return dq, grads, slabs
