"""``MosaicAttention``: the sparse attention over ``csa_eqx.Reads`` as Pallas TPU (Mosaic)
kernels, forward and backward (docs/kernels.md, "The Mosaic attention kernel (TPU)"): the
strategy and the ``custom_vjp`` over its kernels. A call is planned in ``mosaic_plan.py`` (the
block sizes, the read sets, the non-finite masks, what lives in VMEM), laid out as
``mosaic_layout.py`` says and run by ``mosaic_forward.py`` and ``mosaic_backward.py`` (each
kind of read set read as ``mosaic_reads.py`` says).

The ``custom_vjp`` takes the natural arrays (queries, tables, sinks); the forward kernel is told
which queries live (the metadata's row 3) and writes NaN for the others; the non-finite
queries (and in the backward the poisoned queries' cotangents) are zeroed inside the
``custom_vjp``, where XLA fuses the masks into the copies to the kernels' layout (no pass of
its own masks the queries, the output or ``dq``). Its backward repacks them, runs the backward
kernel (with a configuration of its own: gradient tables in VMEM or HBM; rows sets whose
gradient table does not fit VMEM read as tiles), overlap-adds the slab gradients of a band whose
gradient table is not in VMEM and forms the sinks' gradient from ``lse``.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._backend import Interpret
from .._mosaic import LANES
from .._ops import pad_axis, summed_like
from . import mosaic_plan
from .base import AbstractAttentionKernel, require_exact_softmax, require_keys
from .mosaic_backward import backward
from .mosaic_forward import forward
from .mosaic_layout import (
    Config,
    narrow_rows,
    pack_rows,
    query_rows,
    row_scalars,
    tiles_ints,
    unnarrow_rows,
    unpack_rows,
    unquery_rows,
    unrow_scalars,
)
from .mosaic_plan import Ints, Static, auto_query_block, check_vmem, value_width
from .mosaic_reads import BandRead, DenseRead, RowsRead, TilesRead
from .reads import Reads

__all__ = ["MosaicAttention"]

GATHERS = ("auto", "rows", "tiles")
GRADIENTS = ("auto", "vmem", "hbm")


class MosaicAttention(AbstractAttentionKernel):
    """The sparse attention kernel for a TPU (Pallas' Mosaic backend; interpreted on the CPU,
    where it is proven against ``XlaAttention``, not fast; refused at lowering for a GPU).
    Every kind of ``Reads`` is taken: gathered rows, a band (with ``extend``'s history), dense
    entries (with or without picks), values of their own or the keys' first features (MLA),
    sinks. One grid step runs ``query_block`` queries x ``head_block`` heads through one online
    softmax over everything they read. Its softmax is the exact one: numerics that round the
    attention (``DeepSeekInference``) are refused with a ``ValueError``. The ``query_block``
    that ``Execution`` passes (sized for XLA's buffers) is ignored.

    The defaults are ``AutoAttention``'s choice on a TPU: gathered rows read as the measured
    cost model says is cheapest: as tiles (short prefill), copied from a table resident in VMEM
    (V4-Flash prefill past 16k tokens; V3.2 prefill at 16k, its backward's gradients in VMEM
    under a raised limit, and at 32k, whose backward, its gradients not fitting VMEM beside the
    table, reads tiles) or by DMA (decoding, very long sequences); tables resident in VMEM and
    the backward's gradient tables in VMEM where they fit (docs/kernels.md, "The automatic
    configuration").

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
        by vector loads, tiles read in place) instead of fetching from HBM (``None``: where it
        fits, for tiles, and for rows where the cost model took their copies; ``False`` also
        keeps the cost model from taking them).
    - ``gradients``: where the backward accumulates the tables' float32 gradients: ``"vmem"``,
        ``"hbm"`` (tile by tile; a rows source's backward then reads its rows as tiles; a
        band's as one slab per query block) or ``"auto"`` (VMEM where it fits; a band's
        gradient table in VMEM where it fits but for ``"hbm"``).
    - ``vmem_limit_bytes``: Mosaic's scoped VMEM limit (the v5e has 128 MiB; ``None``: 100
        MiB, raised to 124 MiB where rows copied from a resident table keep their backward's
        gradient table in VMEM only under it: V3.2 at 16k).
    - ``interpret``: ``None`` (compiled on a TPU, interpreted on the CPU: decided when the
        program is traced), ``True``, ``False`` or a ``pltpu.InterpretParams`` (Pallas' TPU
        interpreter: simulated memories, out-of-bounds reads raising; it carries IO effects,
        so only for the kernel alone: no ``jax.checkpoint`` or ``vmap`` around it).
    - ``skip_tiles``: tiles read only where some query of the grid step's block picked a row
        of them (tables of up to ``mosaic_plan.MAX_SKIP_TILES`` tiles; outputs and gradients
        bitwise those of visiting every tile up to the block's largest pick: ``False``).
    """

    query_block: int = eqx.field(static=True, default=0)
    head_block: int = eqx.field(static=True, default=0)
    key_block: int = eqx.field(static=True, default=0)
    tile_block: int = eqx.field(static=True, default=512)
    gather: str = eqx.field(static=True, default="auto")
    resident: bool | None = eqx.field(static=True, default=None)
    gradients: str = eqx.field(static=True, default="auto")
    vmem_limit_bytes: int | None = eqx.field(static=True, default=None)
    interpret: Interpret = eqx.field(static=True, default=None)
    skip_tiles: bool = eqx.field(static=True, default=True)

    is_kernel = True
    exact_softmax_only = True

    def __check_init__(self):
        for name, least in (("key_block", 0), ("tile_block", 1), ("vmem_limit_bytes", 1)):
            v = getattr(self, name)
            if v is None and name == "vmem_limit_bytes":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                either = " or None" if name == "vmem_limit_bytes" else ""
                raise ValueError(
                    f"MosaicAttention.{name} must be an int >= {least}{either} (got {v!r})"
                )
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
        if not isinstance(self.skip_tiles, bool):
            raise ValueError(f"MosaicAttention.skip_tiles must be a bool (got {self.skip_tiles!r})")

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
            out = jnp.zeros((b, s, h, value_width(reads, d)), q.dtype)
            return (out, jnp.zeros((b, s, h), jnp.float32)) if return_lse else out
        plan = mosaic_plan.plan(self, q, reads, sinks is not None, float(scale))
        sink = jnp.zeros((h,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
        out, lse = _attention(plan.static, q, sink, plan.floats, plan.ints)
        lse = jnp.where(plan.ints.live[:, :, None], lse, jnp.nan)
        return (out, lse) if return_lse else out

    def replay(self, q, reads: Reads, sinks, scale, out, lse, *, query_block=0, numerics=None):
        """The attention whose forward already ran: ``(out, lse)`` as given (``attend``'s with
        ``return_lse``, on these very arguments), differentiable as ``attend``: its backward
        runs the backward kernel on them and no forward kernel (V3.2's head groups keep
        ``out`` and ``lse`` for their backward, ``csa_eqx._layers.v32.in_parts``). The
        plain XLA preparation of the reads runs again (the backward needs its tables).

        **Arguments:** as ``attend``'s, and its outputs ``out [B, S, H, vdim]`` and ``lse
        [B, S, H]`` (``NaN`` for a poisoned query, as ``attend`` returns them).

        **Returns:** ``(out, lse)``, equal to the given ones."""
        del query_block
        require_exact_softmax(self, numerics)
        require_keys(reads)
        if q.shape[1] == 0:
            return out, lse
        plan = mosaic_plan.plan(self, q, reads, sinks is not None, float(scale))
        sink = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks.astype(jnp.float32)
        live = plan.ints.live[:, :, None]
        # a poisoned query's lse is NaN, its cotangents zero: +inf gives its weights exactly
        # the zeros the kernel's own finite lse gives them (no NaN * 0 in the backward kernel)
        kernel_lse = jnp.where(live, lse, jnp.inf)
        out, kernel_lse = _replayed(plan.static, q, sink, plan.floats, plan.ints, out, kernel_lse)
        return out, jnp.where(live, kernel_lse, jnp.nan)


def _query_words(x: Array, static: Static, blocks: int) -> Array:
    """``x [B, S, H, w]`` as the kernels take it: its queries padded, in ``narrow_rows``
    layout, or padded (heads, ``blocks`` features too) in ``query_rows`` layout."""
    c = static.config
    x = pad_axis(x, 1, c.seq)
    if c.narrow:
        return narrow_rows(x, c)
    return query_rows(pad_axis(pad_axis(x, 2, c.heads), 3, blocks * LANES), c)


def _unquery_words(x: Array, static: Static, width: int) -> Array:
    """The inverse of ``_query_words``: ``[B, S, H, width]``."""
    c = static.config
    x = unnarrow_rows(x, c) if c.narrow else unquery_rows(x, c)
    return x[:, : static.seq, : static.heads, :width]


def _scalars(x: Array, static: Static) -> Array:
    """Per-row scalars ``[B, S, H]`` padded, in ``row_scalars`` layout."""
    c = static.config
    return row_scalars(pad_axis(pad_axis(x, 1, c.seq), 2, c.heads), c)


def _table_words(config: Config, static: Static, floats) -> tuple:
    words = []
    for table, front, (keys, values) in zip(config.tables, static.front, floats, strict=True):
        keys = pad_axis(keys, 1, table.rows, front=front)
        values = None if values is None else pad_axis(values, 1, table.rows, front=front)
        blocks = config.key_blocks, config.value_blocks
        words.append(pack_rows(keys, values, *blocks, table.packed))
    return tuple(words)


def _row_dots(x: Array, y: Array, static: Static) -> Array:
    """``sum(x * y)`` over each row's features in float32, ``[B, S, H]``, of two arrays in the
    kernels' layout (``_query_words``). Summed there, not in ``[B, S, H, w]``: XLA on a TPU
    met the output's cotangent in another layout there (a dot's, heads major) and wrote a
    float32 transposed copy of the output for it (4 GiB for V3.2 at 16k)."""
    c = static.config
    if c.narrow:
        x, y = (a.reshape(*a.shape[:2], c.narrow[0], -1) for a in (x, y))
    dots = jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32), axis=-1)
    if not c.narrow:
        dots = unquery_rows(dots[..., None], c)[..., 0]
    return dots[:, : static.seq, : static.heads]


def _sink_rows(sink: Array, static: Static) -> Array:
    """The sink logit of every softmax row of a grid step, ``[n_h, R, 128]``."""
    c = static.config
    per_head = pad_axis(sink, 0, c.heads).reshape(c.n_h, 1, c.head_block)
    rows = jnp.broadcast_to(per_head, (c.n_h, c.query_block, c.head_block))
    return jnp.broadcast_to(rows.reshape(c.n_h, c.rows, 1), (c.n_h, c.rows, LANES))


def _forward(static: Static, qk, sink, floats, ints: Ints):
    """The forward kernel on the queries in its layout ``qk`` (``_query_words``)."""
    c = static.config
    sinks = _sink_rows(sink, static) if c.has_sinks else None
    words = _table_words(c, static, floats)
    out, lse = forward(c, ints.ntiles, qk, sinks, ints.qmeta, ints.sources, words)
    s, h = static.seq, static.heads
    out = _unquery_words(out, static, static.value_width)
    return out, unrow_scalars(lse, c)[:, :s, :h]


def _backward_ints(static: Static, ints: Ints) -> Ints:
    """The backward's int arrays: the forward's, with rows sources the backward reads as tiles
    turned into tiles sources (their counts after the forward's)."""
    c, bc = static.config, static.backward
    counts, sources = [ints.ntiles], []
    for src, back, group in zip(c.sources, bc.sources, ints.sources, strict=True):
        if isinstance(src, RowsRead) and isinstance(back, TilesRead):
            tiles = bc.visited_tiles(back)
            group, block_counts = tiles_ints(group[0], c.n_q, c.query_block, c.tile, tiles)
            counts.append(block_counts.reshape(-1).astype(jnp.int32))
        sources.append(group)
    if len(counts) > 1 and not any(isinstance(s, TilesRead | DenseRead) for s in c.sources):
        counts = counts[1:]  # the forward's placeholder count
    return ints._replace(ntiles=jnp.concatenate(counts), sources=tuple(sources))


def _overlap_add(slabs: Array, static: Static, src: BandRead) -> Array:
    """A band's per-block slab gradients ``[B, n_q, slab * words, 128]`` summed into its
    padded rows ``[B, seq + front, words * 128]`` (slab ``i`` starts at row ``i * Qb``)."""
    c = static.config
    b, qb = slabs.shape[0], c.query_block
    pieces = c.slab(src) // qb
    x = slabs.reshape(b, c.n_q, pieces, qb, -1)
    total = sum(pad_axis(x[:, :, p], 1, c.n_q + pieces - 1, front=p) for p in range(pieces))
    return total.reshape(b, (c.n_q + pieces - 1) * qb, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: Static, q, sink, floats, ints: Ints):
    return _forward(static, _finite_queries(q, static, ints), sink, floats, ints)


def _finite_queries(q, static: Static, ints: Ints):
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


def _attention_bwd(static: Static, residuals, cotangents):
    qk, sink, floats, ints, out, lse = residuals
    g_out, g_lse = cotangents
    c = static.backward
    check_vmem(c, True)
    g_out = jnp.where(ints.live[:, :, None, None], g_out, 0)
    do = _query_words(g_out.astype(qk.dtype), static, c.value_blocks)
    coeff = g_lse.astype(jnp.float32) - _row_dots(
        do, _query_words(out, static, c.value_blocks), static
    )
    coeff = jnp.where(ints.live[:, :, None], coeff, 0.0)  # a poisoned query's output is NaN
    back = _backward_ints(static, ints)
    dq, grads, slabs = backward(
        c,
        back.ntiles,
        qk,
        do,
        _scalars(lse, static),
        _scalars(coeff, static),
        back.qmeta,
        back.sources,
        _table_words(c, static, floats),
    )
    dq = _unquery_words(dq, static, static.key_width).astype(qk.dtype)
    band_of = {src.table: k for k, src in enumerate(c.sources) if isinstance(src, BandRead)}
    d_floats = []
    for t, (table, (keys, values)) in enumerate(zip(c.tables, floats, strict=True)):
        value_blocks = c.value_blocks if table.value_words else 0
        if t in grads:
            d_keys, d_values = unpack_rows(grads[t], table.rows, c.key_blocks, value_blocks)
        else:
            rows = _overlap_add(slabs[band_of[t]], static, c.sources[band_of[t]])
            words = rows.reshape(rows.shape[0], -1, LANES)
            d_keys, d_values = unpack_rows(words, rows.shape[1], c.key_blocks, value_blocks)
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
def _replayed(static: Static, q, sink, floats, ints: Ints, out, lse):
    """``(out, lse)``, the forward kernel's outputs on these arguments, given: differentiated
    as ``_attention`` (its backward), with no forward kernel (``MosaicAttention.replay``)."""
    return out, lse


def _replayed_fwd(static, q, sink, floats, ints, out, lse):
    return (out, lse), (_finite_queries(q, static, ints), sink, floats, ints, out, lse)


def _replayed_bwd(static: Static, residuals, cotangents):
    out, lse = residuals[-2:]
    grads = _attention_bwd(static, residuals, cotangents)
    return (*grads, jnp.zeros_like(out), jnp.zeros_like(lse))


_replayed.defvjp(_replayed_fwd, _replayed_bwd)
