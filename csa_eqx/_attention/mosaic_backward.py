"""``MosaicAttention``'s backward kernel (``mosaic.py``; docs/kernels.md, "The Mosaic
attention kernel (TPU)"). It recomputes each chunk's probabilities from the saved ``lse`` (no
online state) and accumulates ``dq`` per step. Each read row's key / value gradients add into a
float32 gradient table: in VMEM (``[(rows + 1) * grad_words, 128]``, the spare row taking the
clamped ``-1`` reads of rows sets; written out once per batch row) or, for tiles and dense sets,
in HBM (each tile's gradient rows fetched, added to and written back, double-buffered, so that
no VMEM grows with the table; steps run in order, and every write-back is waited for before its
buffer is refilled and at the end of the pass). A band's gradients go into a VMEM table too
(each block's slab added at its first row, ``i * Qb``) or, in HBM, into one slab per query
block (summed over the head blocks), overlap-added by the caller. The sinks' gradient needs
only ``lse`` and the cotangents: the caller forms it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from .._mosaic import LANES, dot, dot_nt, precision
from . import mosaic_steps as steps
from .mosaic_layout import Config
from .mosaic_reads import BandRead, ReadRefs, RowsRead, Table

__all__ = ["backward"]

NAME = "mosaic_sparse_attention_bwd"


class _Scratch(NamedTuple):
    """The backward's VMEM: the ``dq`` accumulator ``[R, dk]``, the ``lse`` and coefficient
    columns ``[R, 128]``, a ``narrow`` kernel's query-side rows (``steps.narrow_scratch``), the VMEM
    gradient tables (``Config.vmem_grad_tables``' order), each read set's buffers and DMA
    semaphores (``steps.scratch_of``) and the semaphores of the gradient tables' final copies."""

    dq: object
    lse: object
    coeff: object
    narrow: tuple
    grads: tuple
    reads: tuple
    sems: tuple
    copies: object


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


def _backward_kernel(config: Config, interpret: bool, ntiles_ref, q_ref, do_ref, lse_ref,
                     coeff_ref, qmeta_ref, ints, tables, zeros, dq_out, grads_out, slabs_out,
                     scratch: _Scratch):  # fmt: skip
    del zeros  # aliased to the HBM gradient tables among grads_out
    gathered, in_vmem = config.grad_tables(), config.vmem_grad_tables()
    grad_out = dict(zip(gathered, grads_out, strict=True))
    band_out = dict(zip(config.slab_bands(), slabs_out, strict=True))
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    step = steps.Step(config, interpret, b, i, ntiles_ref, qmeta_ref)
    if config.narrow:
        stage_ref, q_rows, do_rows = scratch.narrow
        step.narrow_in(q_ref, stage_ref, q_rows, values=False)
        step.narrow_in(do_ref, stage_ref, do_rows, values=True)
        q_ref, do_ref = q_rows, do_rows
    grad_acc = dict(zip(in_vmem, scratch.grads, strict=True))
    in_hbm = {t: grad_out[t] for t in gathered if t not in grad_acc}
    reads = ReadRefs.of(config, ints, tables, scratch.reads, scratch.sems, in_hbm)

    @pl.when((i == 0) & (j == 0))
    def _():
        for acc in grad_acc.values():
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    scratch.dq[...] = jnp.zeros(scratch.dq.shape, jnp.float32)
    scratch.lse[...] = step.column(lse_ref)
    scratch.coeff[...] = step.column(coeff_ref)
    ctx = _Cotangents(q_ref, do_ref, scratch.lse, scratch.coeff, scratch.dq)
    for s in reads:
        s.read.start(step, s)
    for s in reads:
        if isinstance(s.read, RowsRead):
            s.read.pipeline(step, s, _rows_grads(step, ctx, s, grad_acc[s.read.table]))
        elif not isinstance(s.read, BandRead):  # tiles, dense
            s.read.pipeline(step, s, _tiles_grads(step, ctx, s, grad_acc.get(s.read.table)))

    for k, s in enumerate(reads):
        if isinstance(s.read, BandRead):
            if k in band_out:  # the block's slab, summed over the head blocks
                into, at = band_out[k], 0

                @pl.when(j == 0)
                def _(out=into):
                    out[...] = jnp.zeros(out.shape, jnp.float32)

            else:  # the VMEM table's rows from the slab's first, i * Qb
                gg = config.grad_words(s.table)
                into, at = grad_acc[s.read.table], pl.multiple_of(i * config.query_block * gg, 8)
            _band_grads(step, ctx, s, into, at)

    if config.narrow:
        step.narrow_out(scratch.dq, dq_out, values=False)
    else:
        dq_out[...] = scratch.dq[...].astype(dq_out.dtype)

    @pl.when((i == config.n_q - 1) & (j == config.n_h - 1))
    def _():  # the VMEM gradient tables, written out once per batch row
        copies = [
            pltpu.make_async_copy(grad_acc[t], grad_out[t].at[b], scratch.copies.at[k])
            for k, t in enumerate(in_vmem)
        ]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()


def _rows_grads(step: steps.Step, ctx: _Cotangents, s, acc):
    """``RowsRead.pipeline``'s ``consume`` of a rows set: the backward of a query's chunk, its
    rows' gradients added row by row into the VMEM table ``acc`` (a ``-1`` read adds to the
    spare row past the table's end)."""
    config, hb, spare = step.config, step.config.head_block, s.table.rows
    gg = config.grad_words(s.table)

    def consume(qq, cc, words, mask):
        keys, values = s.keys_values(words, 0, config.chunk, config)
        rows = pl.ds(pl.multiple_of(qq * hb, hb), hb)
        blocks = _grads(ctx, config, rows, keys, values, mask, s.table)
        contributions = s.bufs["contributions"]
        _put(contributions, 0, config.chunk, gg, blocks, add=False)

        def add(jj, at):  # at: the row's first gradient word-row
            dst = pl.ds(at, gg)
            acc[dst, :] = acc[dst, :] + contributions[pl.ds(jj * gg, gg), :]

        if s.table.resident:
            s.read.each_row(step, s, qq * (s.read.width // config.chunk) + cc, add, which=1)
            return
        base = cc * config.chunk

        def one(jj, carry):
            r = s.ints[0][qq, base + jj]
            add(jj, jnp.where(r >= 0, r, spare) * gg)
            return carry

        jax.lax.fori_loop(0, config.chunk, one, 0, unroll=step.unroll(config.chunk))

    return consume


def _tiles_grads(step: steps.Step, ctx: _Cotangents, s, acc):
    """``TilesRead.pipeline``'s ``consume`` of a tiles / dense set: the backward of a tile, its
    rows' gradients added into the VMEM table ``acc`` or into the tile's rows fetched from the
    HBM table."""
    config = step.config
    gg = config.grad_words(s.table)

    def consume(t, words, offset, into):
        keys, values = s.keys_values(words, offset, config.tile, config)
        w = s.read.weights(step, s, t)
        blocks = _grads(ctx, config, pl.ds(0, config.rows), keys, values, w, s.table)
        if into is None:  # the VMEM table's rows of tile t
            into, at = acc, pl.multiple_of(t * config.tile * gg, 8)
        else:  # tile t's rows, fetched from the HBM table
            at = 0
        _put(into, at, config.tile, gg, blocks, add=True)

    return consume


def _band_grads(step: steps.Step, ctx: _Cotangents, s, into, at) -> None:
    """The backward of a band's slab, its gradient rows added to ``into`` from word-row
    ``at``."""
    config = step.config
    slab, gg = config.slab(s.read), config.grad_words(s.table)
    keys, values = s.keys_values(s.read.words(s), 0, slab, config)
    w = s.read.weights(step, s)
    blocks = _grads(ctx, config, pl.ds(0, config.rows), keys, values, w, s.table)
    _put(into, at, slab, gg, blocks, add=True)


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
    >= rows * grad_words, 128]}`` for the tables of ``grad_tables``, ``{read set: slab gradient
    words [B, n_q, slab * grad_words, 128]}`` for the bands of ``slab_bands``)``.
    """
    c = config
    gathered, in_vmem, bands = c.grad_tables(), c.vmem_grad_tables(), c.slab_bands()
    int_specs, table_specs = steps.read_specs(c, backward=True)
    args = (
        ntiles,
        q,
        do,
        lse,
        coeff,
        qmeta,
        steps.kernel_ints(c, ints, backward=True),
        tuple(tables),
    )
    spans = {t: (c.tables[t].rows + 1) * c.grad_words(c.tables[t]) for t in gathered}
    in_hbm = [t for t in gathered if t not in in_vmem]
    # the HBM gradient tables are added to in place, tile by tile: they start as zeros
    zeros = tuple(jnp.zeros((c.batch, spans[t], LANES), jnp.float32) for t in in_hbm)
    first = len(jax.tree.leaves(args))  # the zeros' flat index (the scalar prefetch counted)
    aliases = {first + k: 1 + gathered.index(t) for k, t in enumerate(in_hbm)}
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    scalars = steps.scalar_spec(c)
    in_specs = (
        steps.query_spec(c, False), steps.query_spec(c, True), scalars, scalars,
        steps.meta_spec(c), int_specs, table_specs, tuple(any_space for _ in in_hbm),
    )  # fmt: skip
    slab_spans = [c.slab(c.sources[k]) * c.grad_words(c.tables[c.sources[k].table]) for k in bands]
    out_shape = (
        jax.ShapeDtypeStruct(c.query_shape(values=False), q.dtype),
        tuple(jax.ShapeDtypeStruct((c.batch, spans[t], LANES), jnp.float32) for t in gathered),
        tuple(jax.ShapeDtypeStruct((c.batch, c.n_q, n, LANES), jnp.float32) for n in slab_spans),
    )
    out_specs = (
        steps.query_spec(c, False),
        tuple(any_space for _ in gathered),
        tuple(
            pl.BlockSpec((None, None, n, LANES), lambda b, i, j, *_: (b, i, 0, 0))
            for n in slab_spans
        ),
    )
    scratch = _Scratch(
        pltpu.VMEM((c.rows, c.key_blocks * LANES), jnp.float32),
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        steps.narrow_scratch(c, q.dtype, backward=True),
        tuple(pltpu.VMEM((spans[t], LANES), jnp.float32) for t in in_vmem),
        *steps.scratch_of(c, backward=True),
        pltpu.SemaphoreType.DMA((len(in_vmem),)) if in_vmem else None,
    )
    semantics = ("arbitrary", "arbitrary", "arbitrary")
    dq, grads, slabs = steps.run_kernel(
        _backward_kernel, NAME, c, (*args, zeros), (in_specs, out_specs), out_shape, (scratch,),
        semantics, aliases,
    )  # fmt: skip
    return dq, dict(zip(gathered, grads, strict=True)), dict(zip(bands, slabs, strict=True))
