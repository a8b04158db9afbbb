"""``TritonAttention``: the sparse attention over ``csa_eqx.Reads`` in Pallas kernels, forward
and backward (docs/kernels.md, "The sparse attention kernel").

Each program takes ``query_block`` query rows of a batch row and runs them one at a time with
all heads at once (the FlashMLA layout: a row's ``[H, d]`` queries are the left side of every
dot, so a gathered tile is one dot however scattered its rows are). A row reads, in one online
softmax (then the sink, in the denominator):

- each ``GatheredRows`` set: its indices in tiles of ``key_block``, the rows loaded by masked
  pointer gathers (``-1`` loads nothing);
- the ``BandRows`` window: its own ``window`` token rows (with a history: the ring's rows
  first), in tiles, masked to the window and the segment;
- the ``DenseKeys`` entries: every tile of entries, masked by the visibility; entries with
  ``picks`` (``MaskedPicks``) are read as gathered rows of the visible picks instead (the same
  set, without the ``[S, T]`` mask).

No ``[S, S + T]`` mask or ``[B, S, n, d]`` gathered keys exist outside a tile. The contract of
``AbstractAttentionKernel`` holds row by row: a row that sees nothing returns zeros and
``lse = -inf``; a masked lane loads zeros, so a non-finite row reaches only the rows that see
it, which (like a row whose query is non-finite) return NaN.

The backward recomputes each tile's probabilities from the saved ``lse`` (no online state):
``dq`` per row, and the keys' and values' gradients by float32 atomic adds of each tile's
rows into zero-initialised tables (a lane that reads nothing adds to a row of its own past the
table's end, so every add of a tile has distinct rows), the sinks' per program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._ops import pad_axis, summed_like
from .._triton import (
    MIN_DOT,
    count,
    dot_t,
    feature_parts,
    next_pow2,
    run_kernel,
    sum_in_order,
)
from .base import AbstractAttentionKernel, fold_sink, require_exact_softmax, require_keys
from .reads import Reads

__all__ = ["TritonAttention"]


class TritonAttention(AbstractAttentionKernel):
    """The sparse attention kernel (see the module docstring): Triton on a GPU, interpret mode
    on the CPU (where it is proven against ``XlaAttention``, not fast). Every kind of
    ``Reads`` is taken natively (masked dense picks as gathered rows); the ``query_block``
    a caller passes (``Execution.query_block``, sized for XLA's buffers) is ignored. Its online
    softmax is the exact one: numerics that round the attention (``DeepSeekInference``: bf16
    probabilities, the logits' maximum without the sink) are refused with a ``ValueError``.

    **Arguments:**

    - ``query_block``: query rows per program.
    - ``key_block``: rows per tile of gathered indices, window rows and dense entries (a power
        of two; at least 16 on a GPU; fewer rows take the least power of two, at least 16,
        that holds them).
    - ``interpret``: ``None`` (compiled on a GPU, interpreted on the CPU), ``True`` or
        ``False`` (``csa_eqx._backend.kernel_interpret``).
    """

    query_block: int = 16
    key_block: int = 64
    interpret: bool | None = None

    is_kernel = True
    exact_softmax_only = True

    def __check_init__(self):
        for name in ("query_block", "key_block"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TritonAttention.{name} must be an int >= 1 (got {v!r})")
        if self.key_block & (self.key_block - 1):
            raise ValueError(
                f"TritonAttention.key_block must be a power of two (got {self.key_block})"
            )

    def attend(
        self, q, reads: Reads, sinks, scale, *, return_lse=False, query_block, numerics=None
    ):
        del query_block  # rows run one at a time; programs take self.query_block rows
        require_exact_softmax(self, numerics)
        require_keys(reads)
        b, s, h, d = q.shape
        sources, floats, ints = _sources(reads, q.dtype, self.key_block)
        if s == 0:
            dv = _value_width(floats, sources, d)
            out = jnp.zeros((b, s, h, dv), q.dtype)
            return (out, jnp.zeros((b, s, h), jnp.float32)) if return_lse else out
        heads = next_pow2(h, MIN_DOT)  # Triton's dots: at least 16 rows
        config = _Config(
            sources=sources,
            seq=s,
            scale=float(scale),
            rows=self.query_block,
            dk=d,
            dv=_value_width(floats, sources, d),
            has_sinks=sinks is not None,
            interpret=self.interpret,
        )
        qp = pad_axis(q, 2, heads)
        sink = jnp.zeros((heads,), jnp.float32)
        if sinks is not None:
            sink = pad_axis(sinks.astype(jnp.float32), 0, heads)
        out, lse = _attention(config, qp, sink, floats, ints)
        out, lse = out[:, :, :h], lse[:, :, :h]
        return (out, lse) if return_lse else out


# A read set as the kernels see it, one record per kind (the kernels dispatch on the type):
# whether it has ``values`` of its own, its tile, table rows (a band's window and history rows)
# and ``n_ints``, its int arrays.


@dataclasses.dataclass(frozen=True)
class _Gathered:
    values: bool
    tile: int
    rows: int
    n_ints: ClassVar[int] = 1  # the indices


@dataclasses.dataclass(frozen=True)
class _Band:
    values: bool
    tile: int
    rows: int
    window: int
    before: int
    n_ints: ClassVar[int] = 2  # the rows' segments, the queries'


@dataclasses.dataclass(frozen=True)
class _Dense:
    values: bool
    tile: int
    rows: int
    n_ints: ClassVar[int] = 4  # the entries' end and segment, the queries' index and segment


_Source = _Gathered | _Band | _Dense


class _Config(NamedTuple):
    """The static side of a call: the read sets, the query rows, the softmax scale, rows per
    program, key and value widths, whether there are sinks, the ``interpret`` field."""

    sources: tuple[_Source, ...]
    seq: int
    scale: float
    rows: int
    dk: int
    dv: int
    has_sinks: bool
    interpret: bool | None


def _value_width(floats, sources, d: int) -> int:
    """The output width: the first set with values of its own gives it, else the keys' ``d``."""
    for (_, values), src in zip(floats, sources, strict=True):
        if src.values:
            return values.shape[-1]
    return d


def _sources(reads: Reads, dtype, kt: int):
    """The static description of each read set, its float arrays ``(keys, values | None)``
    (keys in the queries' dtype) and its int arrays, in the order the kernels read them."""
    sources, floats, ints = [], [], []
    gathered = list(reads.gathered)
    dense = reads.dense
    if dense is not None and dense.picks is not None:  # the visible picks, as gathered rows
        gathered.append(dense.picked_rows())
        dense = None
    for g in gathered:
        tile = min(kt, next_pow2(g.indices.shape[-1], MIN_DOT))
        n = -(-g.indices.shape[-1] // tile) * tile
        values = g.value_rows()
        sources.append(_Gathered(values is not None, tile, g.keys.shape[1]))
        floats.append((g.keys.astype(dtype), values))
        ints.append((pad_axis(g.indices.astype(jnp.int32), 2, n, -1),))
    band = reads.band
    if band is not None:
        before = 0 if band.history is None else band.window - 1
        key_segment = band.segment
        if before:
            key_segment = jnp.concatenate([band.history, band.segment], axis=1)
        tile = min(kt, _span(band.window))
        sources.append(
            _Band(band.values is not None, tile, band.keys.shape[1], band.window, before)
        )
        floats.append((band.keys.astype(dtype), band.values))
        ints.append((key_segment.astype(jnp.int32), band.segment.astype(jnp.int32)))
    if dense is not None:
        t = dense.keys.shape[1]
        tile = min(kt, next_pow2(t, MIN_DOT))
        tp = -(-t // tile) * tile
        values = dense.value_rows()
        values = None if values is None else pad_axis(values, 1, tp)
        sources.append(_Dense(values is not None, tile, t))
        floats.append((pad_axis(dense.keys.astype(dtype), 1, tp), values))
        end = pad_axis(dense.layout.end.astype(jnp.int32), 1, tp, -1)
        segment = pad_axis(dense.layout.segment.astype(jnp.int32), 1, tp, -1)
        ints.append((end, segment, dense.query_index, dense.query_segment))
    return tuple(sources), tuple(floats), tuple(ints)


def _span(window: int) -> int:
    """Rows a band tile set covers per query: the window, as a power of two of at least 16."""
    return next_pow2(window, MIN_DOT)


# --- in-kernel pieces shared by the forward and the backward ---------------------------------


class _Tile(NamedTuple):
    keys: list  # per key feature part [tile, size]
    values: list  # per value feature part [tile, size]
    mask: jax.Array  # [tile] bool: the row reads this lane
    bad: jax.Array  # int32 scalar: lanes read holding a non-finite key or value
    rows: jax.Array  # [tile] int32: distinct rows of the gradient tables


def _load(ref, bi, rows, start, size, mask):
    """Masked gather of ``ref[bi, rows, start:start + size]`` (zeros where not ``mask``)."""
    cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
    full = jnp.broadcast_to(mask[:, None], (rows.shape[0], size))
    return plgpu.load(ref.at[bi, rows[:, None], cols], mask=full, other=0)


def _tile_of(src: _Source, refs, config: _Config, bi, r, c) -> _Tile:
    """Tile ``c`` of what query row ``r`` of batch row ``bi`` reads from ``src``."""
    k_ref, v_ref, ints = refs
    lane = jax.lax.broadcasted_iota(jnp.int32, (src.tile,), 0)
    if isinstance(src, _Gathered):
        (idx_ref,) = ints
        idx = idx_ref[bi, r, pl.ds(c * src.tile, src.tile)]
        mask = idx >= 0
        rows = jnp.clip(idx, 0, src.rows - 1)
        grad_rows = jnp.where(mask, rows, src.rows + lane)
    elif isinstance(src, _Band):
        key_segment_ref, segment_ref = ints
        span = _span(src.window)
        raw = src.before + r - (span - 1) + c * src.tile + lane  # may precede row 0
        inside = (raw >= 0) & (src.before + r - raw < src.window)
        rows = jnp.maximum(raw, 0)
        key_segment = plgpu.load(key_segment_ref.at[bi, rows], mask=inside, other=-1)
        mask = inside & (key_segment == segment_ref[bi, r])
        grad_rows = raw + (span - 1)  # the tables start span - 1 rows early
    else:
        end_ref, seg_ref, qi_ref, qs_ref = ints
        rows = c * src.tile + lane
        entries = pl.ds(c * src.tile, src.tile)
        end, seg = end_ref[bi, entries], seg_ref[bi, entries]
        mask = (end >= 0) & (end <= qi_ref[bi, r]) & (seg == qs_ref[bi, r])
        grad_rows = rows
    keys = [_load(k_ref, bi, rows, st, sz, mask) for st, sz in feature_parts(config.dk)]
    if src.values:
        values = [_load(v_ref, bi, rows, st, sz, mask) for st, sz in feature_parts(config.dv)]
    else:
        values = keys
    nonfinite = sum_in_order(count(~jnp.isfinite(x), 1) for x in keys + values)
    bad = count(mask & (nonfinite > 0), 0)
    return _Tile(keys, values, mask, bad, grad_rows)


def _n_tiles(src: _Source, ints) -> int:
    """Tiles of ``src`` each row reads (from its int arrays' static shapes)."""
    if isinstance(src, _Gathered):
        return ints[0].shape[-1] // src.tile
    if isinstance(src, _Band):
        return _span(src.window) // src.tile
    return ints[0].shape[1] // src.tile


def _logits(q_parts, tile: _Tile, scale: float):
    """``[H, tile]`` scaled logits of one row, ``-inf`` where the row reads nothing."""
    s = sum_in_order(dot_t(qp, kp) for qp, kp in zip(q_parts, tile.keys, strict=True)) * scale
    return jnp.where(tile.mask[None, :], s, -jnp.inf)


def _dot(a, b):
    """``a [m, k] . b [k, n]`` in float32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _split_refs(config: _Config, refs):
    """``(per source (keys, values | None, ints), rest)`` from the kernel's refs after
    ``q`` and the sinks."""
    out, refs = [], list(refs)
    for src in config.sources:
        k_ref = refs.pop(0)
        v_ref = refs.pop(0) if src.values else None
        out.append([k_ref, v_ref])
    for pair, src in zip(out, config.sources, strict=True):
        n = src.n_ints
        pair.append(tuple(refs[:n]))
        refs = refs[n:]
    return [tuple(p) for p in out], refs


def _flat_inputs(floats, ints):
    """The kernels' array inputs after ``q`` and the sinks, in ``_split_refs``' order."""
    arrays = []
    for keys, values in floats:
        arrays += [keys] if values is None else [keys, values]
    for group in ints:
        arrays += list(group)
    return arrays


def _q_parts(q_ref, bi, r, width: int):
    """Row ``r``'s ``[H, size]`` queries, per feature part."""
    return [q_ref[bi, r, :, pl.ds(st, sz)] for st, sz in feature_parts(width)]


def _row_range(config: _Config):
    """The program's first row and its number of rows (the last program's may be fewer)."""
    first = pl.program_id(1) * config.rows
    return first, jnp.minimum(config.rows, config.seq - first)


# --- forward ------------------------------------------------------------------------------


def _padded(config: _Config, q, floats):
    """``(q, floats, key width, value width)``: the queries and the read sets' keys and values
    zero-padded to the widths of their feature parts."""
    dk = sum(sz for _, sz in feature_parts(config.dk))
    dv = sum(sz for _, sz in feature_parts(config.dv))
    floats = tuple(
        (pad_axis(k, 2, dk), None if v is None else pad_axis(v, 2, dv)) for k, v in floats
    )
    return pad_axis(q, 3, dk), floats, dk, dv


def _forward(config: _Config, q, sink, floats, ints):
    b, s, h, _ = q.shape
    dv_parts = feature_parts(config.dv)
    q, floats, _, dv = _padded(config, q, floats)
    inputs = [q, sink, *_flat_inputs(floats, ints)]
    out_dtype = q.dtype

    def kernel(q_ref, sink_ref, *refs):  # the same body interpreted or compiled
        *refs, out_ref, lse_ref = refs
        per_source, _ = _split_refs(config, refs)
        bi = pl.program_id(0)
        first, n_rows = _row_range(config)

        def row_body(j, carry):
            r = first + j
            q_parts = _q_parts(q_ref, bi, r, config.dk)
            q_bad = sum_in_order(count(~jnp.isfinite(x).reshape(-1), 0) for x in q_parts)
            state = (
                jnp.full((h,), -jnp.inf, jnp.float32),
                jnp.zeros((h,), jnp.float32),
                [jnp.zeros((h, sz), jnp.float32) for _, sz in dv_parts],
                q_bad,
            )
            for src, src_refs in zip(config.sources, per_source, strict=True):

                def tile_body(c, state, src=src, src_refs=src_refs):
                    m, total, acc, bad = state
                    tile = _tile_of(src, src_refs, config, bi, r, c)
                    s_ = _logits(q_parts, tile, config.scale)
                    m_new = jnp.maximum(m, jnp.max(s_, axis=1))
                    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    alpha = jnp.exp(m - shift)
                    p = jnp.exp(s_ - shift[:, None])
                    total = total * alpha + jnp.sum(p, axis=1)
                    acc = [
                        a * alpha[:, None] + _dot(p.astype(v.dtype), v)
                        for a, v in zip(acc, tile.values, strict=True)
                    ]
                    return m_new, total, acc, bad + tile.bad

                state = jax.lax.fori_loop(0, _n_tiles(src, src_refs[2]), tile_body, state)
            m, total, acc, bad = state
            if config.has_sinks:
                shift, total, alpha = fold_sink(m, total, sink_ref[...])
                acc = [a * alpha[:, None] for a in acc]
            else:
                shift = jnp.where(m == -jnp.inf, 0.0, m)
            poisoned = bad > 0
            lse = jnp.where(poisoned, jnp.nan, shift + jnp.log(total))
            norm = jnp.where(total > 0, total, 1.0)[:, None]
            for (st, sz), a in zip(dv_parts, acc, strict=True):
                o = jnp.where(poisoned, jnp.nan, a / norm)
                out_ref[bi, r, :, pl.ds(st, sz)] = o.astype(out_dtype)
            lse_ref[bi, r, :] = lse
            return carry

        jax.lax.fori_loop(0, n_rows, row_body, 0)

    out_shape = (
        jax.ShapeDtypeStruct((b, s, h, dv), out_dtype),
        jax.ShapeDtypeStruct((b, s, h), jnp.float32),
    )
    grid = (b, -(-s // config.rows))
    out, lse = run_kernel(
        lambda _: kernel, out_shape, grid, "sparse_attention", *inputs, interpret=config.interpret
    )
    return out[..., : config.dv], lse


# --- backward -----------------------------------------------------------------------------


def _backward(config: _Config, q, sink, floats, ints, out, lse, g_out, g_lse):
    b, s, h, _ = q.shape
    dk_parts, dv_parts = feature_parts(config.dk), feature_parts(config.dv)
    delta = jnp.sum(g_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    qp, padded, dk, dv = _padded(config, q, floats)
    g_out = pad_axis(g_out, 3, dv)
    tables = _zero_tables(config, padded, b, dk, dv)
    flat_tables = [jnp.zeros((h,), jnp.float32)] + [t for _, group in tables for t in group]
    inputs = [qp, sink, *_flat_inputs(padded, ints), lse, delta, g_out, g_lse, *flat_tables]
    n_in = len(inputs)

    def kernel(q_ref, sink_ref, *refs):
        refs = list(refs)
        per_source, rest = _split_refs(config, refs)
        lse_ref, delta_ref, go_ref, glse_ref = rest[:4]
        rest = rest[4 + len(flat_tables) :]  # the aliased inputs' outputs follow
        dq_ref, dsink_ref, *grad_refs = rest  # dsink and the tables: aliased zeros
        grads = []
        for src in config.sources:
            grads.append((grad_refs.pop(0), grad_refs.pop(0) if src.values else None))
        bi = pl.program_id(0)
        first, n_rows = _row_range(config)

        def row_body(j, dsink):
            r = first + j
            q_parts = _q_parts(q_ref, bi, r, config.dk)
            go_parts = [go_ref[bi, r, :, pl.ds(st, sz)] for st, sz in dv_parts]
            lse_r = lse_ref[bi, r, :]
            ok = ~jnp.isnan(lse_r)  # poisoned rows pass no gradient (their output is NaN)
            shift = jnp.where(ok, lse_r, 0.0)[:, None]
            coeff = jnp.where(ok, glse_ref[bi, r, :] - delta_ref[bi, r, :], 0.0)
            dq = [jnp.zeros((h, sz), jnp.float32) for _, sz in dk_parts]
            for src, src_refs, (gk_ref, gv_ref) in zip(
                config.sources, per_source, grads, strict=True
            ):

                def tile_body(c, dq, src=src, src_refs=src_refs, gk_ref=gk_ref, gv_ref=gv_ref):
                    tile = _tile_of(src, src_refs, config, bi, r, c)
                    s_ = _logits(q_parts, tile, config.scale)
                    live = tile.mask[None, :] & ok[:, None]
                    p = jnp.where(live, jnp.exp(s_ - shift), 0.0)
                    dp = sum_in_order(
                        dot_t(go.astype(v.dtype), v)
                        for go, v in zip(go_parts, tile.values, strict=True)
                    )
                    ds = p * (dp + coeff[:, None]) * config.scale
                    dq = [
                        a + _dot(ds.astype(k.dtype), k) for a, k in zip(dq, tile.keys, strict=True)
                    ]
                    d_keys = [_dot(ds.T.astype(qp_.dtype), qp_) for qp_ in q_parts]
                    d_values = [_dot(p.T.astype(go.dtype), go) for go in go_parts]
                    if gv_ref is None:  # values are the keys: one gradient
                        d_keys = [a + b_ for a, b_ in zip(d_keys, d_values, strict=True)]
                    _add_rows(gk_ref, bi, tile.rows, dk_parts, d_keys)
                    if gv_ref is not None:
                        _add_rows(gv_ref, bi, tile.rows, dv_parts, d_values)
                    return dq

                dq = jax.lax.fori_loop(0, _n_tiles(src, src_refs[2]), tile_body, dq)
            for (st, sz), a in zip(dk_parts, dq, strict=True):
                dq_ref[bi, r, :, pl.ds(st, sz)] = a
            p_sink = jnp.where(ok, jnp.exp(sink_ref[...] - shift[:, 0]), 0.0)
            return dsink + p_sink * coeff

        dsink = jax.lax.fori_loop(0, n_rows, row_body, jnp.zeros((h,), jnp.float32))
        plgpu.atomic_add(dsink_ref, (jax.lax.broadcasted_iota(jnp.int32, (h,), 0),), dsink)

    out_shape = [jax.ShapeDtypeStruct((b, s, h, dk), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in flat_tables]
    aliases = {n_in - len(flat_tables) + i: 1 + i for i in range(len(flat_tables))}
    grid = (b, -(-s // config.rows))
    dq, dsink, *flat = run_kernel(
        lambda _: kernel, tuple(out_shape), grid, "sparse_attention_bwd", *inputs,
        interpret=config.interpret, aliases=aliases,
    )  # fmt: skip
    d_floats = _table_grads(config, tables, floats, flat)
    return dq[..., : config.dk].astype(q.dtype), dsink, d_floats


def _zero_tables(config: _Config, padded, b: int, dk: int, dv: int) -> list:
    """Per read set, ``(front, [keys' (, values')] zero float32 gradient tables)`` for the
    backward's atomic adds: rows a lane without a read adds to lie past the end (a gathered
    set's, a tile past it) or, a band's, before its first row (``front`` of them)."""
    tables = []
    for src, (keys, values) in zip(config.sources, padded, strict=True):
        extra = 0  # a gathered set's lanes that read nothing add past its end; a band's start early
        if isinstance(src, _Gathered | _Band):
            extra = src.tile if isinstance(src, _Gathered) else _span(src.window) - 1
        front = extra if isinstance(src, _Band) else 0
        rows = keys.shape[1] + extra
        shapes = [(b, rows, dk)] + ([(b, rows, dv)] if values is not None else [])
        tables.append((front, [jnp.zeros(shape, jnp.float32) for shape in shapes]))
    return tables


def _table_grads(config: _Config, tables, floats, flat: list) -> tuple:
    """Each read set's ``(d_keys, d_values | None)`` from the kernel's gradient tables
    (``flat``, in ``_zero_tables``' order): their rows' and features' padding cut, in the
    inputs' dtypes."""
    d_floats = []
    for (front, _), (k_in, v_in) in zip(tables, floats, strict=True):
        n = k_in.shape[1]
        d_keys = flat.pop(0)[:, front : front + n, : config.dk].astype(k_in.dtype)
        d_values = None
        if v_in is not None:
            d_values = flat.pop(0)[:, front : front + n, : config.dv].astype(v_in.dtype)
        d_floats.append((d_keys, d_values))
    return tuple(d_floats)


def _add_rows(ref, bi, rows, parts, values):
    """Atomically add ``values`` (per feature part ``[tile, size]``) to rows ``rows`` of
    ``ref[bi]`` (distinct rows: the interpreter adds distinct rows only)."""
    for (st, sz), v in zip(parts, values, strict=True):
        cols = st + jax.lax.broadcasted_iota(jnp.int32, (1, sz), 1)
        plgpu.atomic_add(ref, (bi, rows[:, None], cols), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config, q, sink, floats, ints):
    return _forward(config, q, sink, floats, ints)


def _attention_fwd(config, q, sink, floats, ints):
    out, lse = _forward(config, q, sink, floats, ints)
    return (out, lse), (q, sink, floats, ints, out, lse)


def _attention_bwd(config, residuals, cotangents):
    q, sink, floats, ints, out, lse = residuals
    g_out, g_lse = cotangents
    dq, dsink, d_floats = _backward(config, q, sink, floats, ints, out, lse, g_out, g_lse)
    if not config.has_sinks:
        dsink = jnp.zeros_like(sink)
    dsink, d_floats = summed_like((dsink, tuple(d_floats)), (sink, tuple(floats)))
    d_ints = jax.tree.map(lambda _: None, ints)
    return dq, dsink, d_floats, d_ints


_attention.defvjp(_attention_fwd, _attention_bwd)
