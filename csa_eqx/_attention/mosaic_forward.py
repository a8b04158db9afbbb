"""``MosaicAttention``'s forward kernel (``mosaic.py``; docs/kernels.md, "The Mosaic attention
kernel (TPU)"): one online softmax over a grid step's ``query_block`` queries x ``head_block``
heads (``R = Qb * Hb`` rows, query-major: one query's heads are one aligned window of the
state) and everything they read, the sinks folded into its denominator. Its state is ``[R,
128]`` lane-broadcast (``m``, ``l``) and ``[R, dv]``. A query that does not live (a non-finite
row it reads poisons it) gets NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Int

from .._mosaic import LANES, dot, dot_nt, precision
from . import mosaic_steps as steps
from .base import fold_sink
from .mosaic_layout import Config
from .mosaic_reads import BandRead, ReadRefs, RowsRead

__all__ = ["forward"]

NAME = "mosaic_sparse_attention"


class _Scratch(NamedTuple):
    """The forward's VMEM: the online softmax state (``m``, ``l``: ``[R, 128]``; ``acc``:
    ``[R, dv]``), a ``narrow`` kernel's query rows (``steps.narrow_scratch``), each read set's
    buffers and DMA semaphores (``steps.scratch_of``)."""

    m: object
    l: object  # noqa: E741
    acc: object
    narrow: tuple
    reads: tuple
    sems: tuple


def _forward_kernel(config: Config, interpret: bool, ntiles_ref, q_ref, sink_ref, qmeta_ref,
                    ints, tables, out_ref, lse_ref, scratch: _Scratch):  # fmt: skip
    step = steps.Step(config, interpret, pl.program_id(0), pl.program_id(1), ntiles_ref, qmeta_ref)
    if config.narrow:
        stage_ref, rows_ref = scratch.narrow
        step.narrow_in(q_ref, stage_ref, rows_ref, values=False)
        q_ref = rows_ref
    reads = ReadRefs.of(config, ints, tables, scratch.reads, scratch.sems)
    prec, scale, hb = precision(config.dtype), config.scale, config.head_block
    m_ref, l_ref, acc_ref = scratch.m, scratch.l, scratch.acc
    everything = pl.ds(0, config.rows)

    def update(rows, logits, w, values):
        """One online-softmax step of state rows ``rows`` over ``logits`` weighted by ``w``
        (``0``: not read; a count repeats the logit)."""
        m_prev = m_ref[rows, :]
        s = jnp.where(w > 0, logits, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_prev - shift)
        p = jnp.where(w > 0, w * jnp.exp(s - shift[:, 0:1]), 0.0)
        l_ref[rows, :] = alpha * l_ref[rows, :] + jnp.sum(p, axis=1, keepdims=True)
        pv = dot(p.astype(values.dtype), values, prec)
        acc_ref[rows, :] = acc_ref[rows, :] * alpha[:, 0:1] + pv
        m_ref[rows, :] = m_new

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    for s in reads:
        s.read.start(step, s)
    for s in reads:
        if isinstance(s.read, RowsRead):  # a query's heads against a chunk of its rows

            def consume(qq, cc, words, mask, s=s):
                keys, values = s.keys_values(words, 0, config.chunk, config)
                rows = pl.ds(pl.multiple_of(qq * hb, hb), hb)
                update(rows, dot_nt(q_ref[rows, :], keys, prec) * scale, mask, values)

            s.read.pipeline(step, s, consume)
        elif not isinstance(s.read, BandRead):  # tiles, dense: every row against a tile

            def consume(t, words, offset, _, s=s):
                keys, values = s.keys_values(words, offset, config.tile, config)
                logits = dot_nt(q_ref[...], keys, prec) * scale
                update(everything, logits, s.read.weights(step, s, t), values)

            s.read.pipeline(step, s, consume)

    for s in reads:  # the bands last: their slabs' DMAs overlap the other sets' work
        if isinstance(s.read, BandRead):
            keys, values = s.keys_values(s.read.words(s), 0, config.slab(s.read), config)
            w = s.read.weights(step, s)
            update(everything, dot_nt(q_ref[...], keys, prec) * scale, w, values)

    m, l_sum, acc = m_ref[...], l_ref[...], acc_ref[...]
    if config.has_sinks:
        shift, l_sum, alpha = fold_sink(m, l_sum, sink_ref[...])
        acc = acc * alpha[:, 0:1]
    else:
        shift = jnp.where(m == -jnp.inf, 0.0, m)
    norm = jnp.where(l_sum > 0, l_sum, 1.0)
    live = step.per_row(step.meta(3)) > 0  # [R, 1]: else poisoned, NaN
    out = jnp.where(live, acc / norm[:, 0:1], jnp.nan)
    if config.narrow:
        acc_ref[...] = out
        step.narrow_out(acc_ref, out_ref, values=True)
    else:
        out_ref[...] = out.astype(out_ref.dtype)
    step.put_scalars(lse_ref, shift + jnp.log(l_sum))


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
    (``query_meta``: row 3 says which queries live); each read set's int arrays (a tuple each,
    ``steps.read_specs``); each table's words (``pack_rows``).

    **Returns:** ``(out`` (``q``'s layout, the values' ``query_lanes`` wide, ``q``'s
    dtype; NaN for the queries that do not live), ``lse`` (``row_scalars`` layout, float32,
    ``-inf`` where a row reads nothing)``)``.
    """
    c = config
    sink_spec = pl.BlockSpec((None, c.rows, LANES), lambda b, i, j, *_: (j, 0, 0))
    int_specs, table_specs = steps.read_specs(c, backward=False)
    in_specs = (
        steps.query_spec(c, values=False),
        sink_spec if c.has_sinks else None,
        steps.meta_spec(c),
        int_specs,
        table_specs,
    )
    sink = sink if c.has_sinks else None
    args = (ntiles, q, sink, qmeta, steps.kernel_ints(c, ints, backward=False), tuple(tables))
    scratch = _Scratch(
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        pltpu.VMEM((c.rows, LANES), jnp.float32),
        pltpu.VMEM((c.rows, c.value_blocks * LANES), jnp.float32),
        steps.narrow_scratch(c, q.dtype, backward=False),
        *steps.scratch_of(c, backward=False),
    )
    out_shape = (
        jax.ShapeDtypeStruct(c.query_shape(values=True), q.dtype),
        jax.ShapeDtypeStruct((c.batch, c.n_h, c.n_q, c.scalar_rows, LANES), jnp.float32),
    )
    specs = in_specs, (steps.query_spec(c, values=True), steps.scalar_spec(c))
    semantics = ("parallel", "parallel", "arbitrary")
    return steps.run_kernel(_forward_kernel, NAME, c, args, specs, out_shape, (scratch,), semantics)
