"""The read sets of ``MosaicAttention``'s kernels (``mosaic_forward.py``, ``mosaic_backward.py``;
docs/kernels.md, "The Mosaic attention kernel (TPU)"): each key / value ``Table``, one record
per kind of read set (``RowsRead``, ``TilesRead``, ``DenseRead``, ``BandRead``) and a read set's
refs in a kernel (``ReadRefs``: no ref is taken by position). A kernel dispatches on the record's
type: each kind's methods say how a grid step reads it (what it starts at the step's start, its
pipeline, its weights).

A rows / tiles / dense table lives in HBM (``pl.ANY``: rows and tiles fetched by DMA) or is
``resident`` (the whole table one single-buffered VMEM block per batch row: rows copied by
vector loads, tiles read in place). A grid step reads its sets in order: gathered rows (a
query's heads against a chunk of its rows; double-buffered DMAs), tiles and dense entries (all
the step's rows against a tile; double-buffered DMAs), then the band (one slab, fetched at the
step's start).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._mosaic import LANES, dot

__all__ = ["Table", "RowsRead", "TilesRead", "DenseRead", "BandRead", "Read", "ReadRefs"]


class Table(NamedTuple):
    """A key / value table as the kernels read it (``mosaic_layout``'s docstring).

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

    @classmethod
    def of(cls, config, ints, tables, bufs, sems, grads=None) -> list[ReadRefs]:
        """Each read set's refs from the kernel's refs: its int refs (``ints``), its table's
        (``tables``), its scratch (``bufs`` and ``sems``: ``mosaic_steps.scratch_of``'s) and
        ``grads`` (table -> its gradient words in HBM; the backward's)."""
        out = []
        for read, own, buffers, sem in zip(config.sources, ints, bufs, sems, strict=True):
            if isinstance(read, BandRead):
                sem = sem.at[0]
            hbm = None if grads is None else grads.get(read.table)
            table = config.tables[read.table]
            out.append(cls(read, table, own, tables[read.table], buffers, sem, hbm))
        return out

    def table_rows(self, b, offset, n: int):
        """Word-rows ``offset .. offset + n`` of batch row ``b`` of the table (resident: of its
        block, whose batch dimension is kept: see ``mosaic_steps.read_specs``)."""
        return self.tab.at[0 if self.table.resident else b, pl.ds(offset, n), :]

    def keys_values(self, words, offset, n: int, config):
        """The keys ``[n, dk]`` and values ``[n, dv]`` of ``n`` consecutive table rows from
        word-row ``offset`` of the ref ``words``."""
        table, dtype = self.table, jnp.dtype(config.dtype)

        def features(first: int, blocks: int):  # from word-row ``first`` within a row
            parts = []
            for f in range(blocks):
                start = offset + first + (f // 2 if table.packed else f)
                w = words[pl.ds(start, n, stride=table.words), :]
                if table.packed:
                    bits = jnp.left_shift(w, 16) if f % 2 == 0 else jnp.bitwise_and(w, -65536)
                    w = jax.lax.bitcast_convert_type(bits, jnp.float32)
                parts.append(w.astype(dtype))
            return parts[0] if blocks == 1 else jnp.concatenate(parts, axis=1)

        keys = features(0, config.key_blocks)
        if table.value_words:
            values = features(table.key_words, config.value_blocks)
        else:
            values = keys[:, : config.value_blocks * LANES]
        return keys, values


def _wait(buf, sem):
    """Wait for every DMA into ``buf`` signalled on ``sem`` (their sizes add up to its size)."""
    pltpu.make_async_copy(buf, buf, sem).wait()


# One record per kind of read set (frozen dataclasses: two kinds with equal fields differ, so a
# Config is a sound cache key). In a kernel, with ``step`` its ``mosaic_steps.Step`` and ``s``
# the set's ``ReadRefs``: ``start`` runs at the step's start; ``pipeline`` hands each chunk /
# tile to the kernel's ``consume``; ``weights`` are each softmax row's.


@dataclasses.dataclass(frozen=True)
class RowsRead:
    """Gathered rows, each query's by row DMAs (or vector copies from a resident table) in
    chunks of ``Config.chunk``: its ``table`` (index into ``Config.tables``) and ``width``
    (index columns per query, a multiple of the chunk). Its int arrays: the indices in SMEM
    (for a resident table, their word-rows: ``steps.kernel_ints``), and again in VMEM a chunk
    a row (the chunks' masks)."""

    table: int
    width: int

    def start(self, step, s: ReadRefs) -> None:
        """Nothing: each chunk's DMAs are issued by the pipeline."""

    def pipeline(self, step, s: ReadRefs, consume) -> None:
        """Per query (the block's queries, not its padding) in chunks of ``chunk`` rows (DMAs,
        double-buffered, or from a resident table vector copies: ``copies``): ``consume(query,
        chunk, words_ref, mask [1, chunk])`` for each chunk, the mask read from the indices'
        VMEM copy (a chunk a row) in one load."""
        if s.table.resident:
            self.copies(step, s, consume)
            return
        c = step.config
        size, g = c.chunk, s.table.words
        idx, buf = s.ints[0], s.bufs["rows"]
        per_query = self.width // size
        total = self.chunks(step)

        def issue(n, slot):
            qq = jax.lax.div(n, per_query)
            base = (n - qq * per_query) * size

            def one(jj, carry):
                r = idx[qq, base + jj]
                row = s.table_rows(step.b, jnp.maximum(r, 0) * g, g)
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

            _wait(buf.at[slot], s.sems.at[slot])
            qq = jax.lax.div(n, per_query)
            consume(qq, n - qq * per_query, buf.at[slot], self.mask(s, n))
            return carry

        jax.lax.fori_loop(0, total, body, 0)

    def copies(self, step, s: ReadRefs, consume) -> None:
        """``pipeline`` from a resident table: each chunk's rows copied into one buffer by
        vector loads (a local DMA costs ~3x more; ``each_row``), then consumed. The copies
        are synchronous, so nothing would overlap a second buffer."""
        g, buf = s.table.words, s.bufs["rows"]
        per_query = self.width // step.config.chunk

        def copy(jj, first):  # first: the row's first word-row
            buf[pl.ds(jj * g, g), :] = s.table_rows(step.b, first, g)[...]

        def body(n, carry):
            self.each_row(step, s, n, copy)
            qq = jax.lax.div(n, per_query)
            consume(qq, n - qq * per_query, buf, self.mask(s, n))
            return carry

        jax.lax.fori_loop(0, self.chunks(step), body, 0)

    def each_row(self, step, s: ReadRefs, n, row, which: int = 0) -> None:
        """``row(jj, word)`` for each row ``jj`` of the step's chunk ``n`` from a resident
        table, ``word`` its first word-row from SMEM array ``which`` (``steps.kernel_ints``:
        ``0``, the table's; ``1``, the gradient table's). The scalar slots bound these loops
        (Mosaic's bundles for a v5e), so the word-rows come formed and flat, read at constant
        offsets from a group's first (one add and one load a row, where indices in a 2-D SMEM
        array, tiled (8, 128), cost ~8 scalar ops more), 16 rows a group (8 where the chunk is
        no multiple of 16): a group's rows overlap, and each group drains its own."""
        size = step.config.chunk
        per = 16 if size % 16 == 0 else 8
        at = n * size

        def group(e, carry):
            first = pl.multiple_of(e * per, per)
            start = at + first
            for k in range(per):
                row(first + k, s.ints[which][start + k])
            return carry

        jax.lax.fori_loop(0, size // per, group, 0)

    def chunks(self, step):
        """The step's chunks: its queries' (not its padding's)."""
        c = step.config
        queries = jnp.minimum(c.query_block, c.queries - step.i * c.query_block)
        return queries * (self.width // c.chunk)

    def mask(self, s: ReadRefs, n):
        """``[1, chunk]``: which rows of the step's chunk ``n`` were picked (one load from the
        indices' VMEM copy)."""
        return jnp.where(s.ints[-1][pl.ds(n, 1), :] >= 0, 1.0, 0.0)


@dataclasses.dataclass(frozen=True)
class TilesRead:
    """Gathered rows as a masked pass over the table's tiles, each row weighted per query by how
    often the query picked it: ``table``, ``width`` (index columns per query), ``slot`` (its row
    of the tile counts), ``visible`` (each pick read only where the query sees its entry, by
    ``DenseRead``'s rule: its last int array the entries' end and segment per tile) and
    ``skip`` (tile skipping: the step visits only the tiles some query of its block picked).

    Its int arrays: the indices ``[B, seq, width]`` in VMEM; skipping, the block's visit list
    in SMEM (``[1, lanes]`` a step: its picked tiles in order, their number the step's tile
    count; ``mosaic_layout.tiles_ints``); ``visible``, the entries' end and segment per tile.

    **Tile skipping.** Without it a step visits every tile up to its block's largest pick,
    though picks with locality (a recent window and a few heavy regions, as trained indexers
    pick) leave most of them unpicked by the block. A tile no query of the block picked has
    zero weights in every row: in the forward's online softmax it changes nothing (logits
    ``-inf``: ``m`` kept, ``p = 0``, ``alpha`` 1, or 0 on a state still empty), in the
    backward it adds zeros (``P = 0``, so ``dS = 0``) to ``dq`` and to gradient rows, which
    start at ``+0`` and so never hold ``-0``, and the tables' non-finite rows are zeros by then
    (the poisoning is decided outside, from the picks): skipping it gives the same outputs,
    ``lse`` and gradients bitwise (but for the sign of an output that underflowed to ``-0``,
    which a visited empty tile would turn to ``+0``). Skipped
    tiles are not fetched either (nor, in the backward of an ``hbm_grads`` table, their
    gradient rows fetched and written back): a visit list, not a ``pl.when`` around the dense
    work, because on a v5e (V3.2, tiles of 512) a tile's fetch costs ~1/9 of its forward work
    and its fetch and gradients' round trip ~1/5 of its backward work, which a pass over
    mostly unpicked tiles would still pay. The list costs SMEM (4 bytes a tile a step) and
    XLA one pass over the picks per 32 tiles, so only tables of up to
    ``mosaic_plan.MAX_SKIP_TILES`` tiles skip (``mosaic_plan.skips``)."""

    table: int
    width: int
    slot: int
    visible: bool = False
    skip: bool = False

    def tile(self, s: ReadRefs, n):
        """The step's ``n``-th visited tile: its visit list's (``skip``), else tile ``n``."""
        return s.ints[1][0, n] if self.skip else n

    def start(self, step, s: ReadRefs) -> None:
        """Fill the counts scratch ``[rows / 128 * Qb, 128]``: row ``h * Qb + q``, lane ``l``
        is how often query ``q`` of the block picked table row ``128 h + l``."""
        c = step.config
        idx = s.ints[0]
        counts = s.bufs["counts"]
        high = s.table.rows // LANES
        width = self.width
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

    def pipeline(self, step, s: ReadRefs, consume) -> None:
        """The step's ``count`` tiles, ``tile(s, 0 .. count - 1)`` (double-buffered DMAs, or
        read in place from a resident table): ``consume(t, words_ref, word_offset, grads_ref)``
        for each, where ``grads_ref`` is ``None``, or (the backward of an ``hbm_grads`` table)
        tile ``t``'s gradient words fetched from HBM, to add to: they are written back after
        ``consume``. A buffer is refilled only once its write-back is done, and the pass ends
        when every write-back is."""
        c = step.config
        n = step.count(self)
        tile = lambda k: self.tile(s, k)  # noqa: E731
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
                tile = s.table_rows(step.b, pl.multiple_of(t * span, 8), span)
                pltpu.make_async_copy(tile, keys.at[slot], s.sems.at[slot]).start()
            if grads is not None:
                pltpu.make_async_copy(grad_hbm(t), grads.at[slot], s.sems.at[first + slot]).start()

        @pl.when(n > 0)
        def _():
            fetch(tile(0), 0)

        def body(k, carry):
            slot, t = jax.lax.rem(k, 2), tile(k)

            @pl.when(k + 1 < n)
            def _():
                if grads is not None:

                    @pl.when(k > 0)
                    def _():
                        write_back(tile(k - 1), 1 - slot).wait()

                fetch(tile(k + 1), 1 - slot)

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
        if grads is not None:  # the write-backs not yet waited for: visits n - 2 and n - 1
            for back in (2, 1):

                @pl.when(n >= back)
                def _(back=back):
                    write_back(tile(n - back), jax.lax.rem(n - back, 2)).wait()

    def weights(self, step, s: ReadRefs, t):
        """``[R, tile]``: tile ``t``'s pick counts, each query's (``visible``: of the entries it
        sees)."""
        c = step.config
        per = c.tile // LANES
        parts = []
        for p in range(per):
            start = pl.multiple_of((t * per + p) * c.query_block, 8)
            parts.append(s.bufs["counts"][pl.ds(start, c.query_block), :])
        counts = parts[0] if per == 1 else jnp.concatenate(parts, axis=1)
        if self.visible:
            counts = counts * step.visible(s.ints[-1].at[t])
        return step.per_row(counts)


@dataclasses.dataclass(frozen=True)
class DenseRead:
    """Dense entries (``DenseKeys``), tile by tile up to the block's last visible one, masked by
    the visibility rule: ``table`` and ``slot`` (its row of the tile counts). Its int array:
    the entries' end and segment per tile."""

    table: int
    slot: int

    def start(self, step, s: ReadRefs) -> None:
        """Nothing: its tiles' DMAs are issued by the pipeline."""

    def tile(self, s: ReadRefs, n):
        """The step's ``n``-th tile: tile ``n`` (every tile up to the block's last visible
        one)."""
        return n

    pipeline = TilesRead.pipeline  # read as the tiles are

    def weights(self, step, s: ReadRefs, t):
        """``[R, tile]``: the entries of tile ``t`` each query sees."""
        return step.per_row(step.visible(s.ints[-1].at[t]))


@dataclasses.dataclass(frozen=True)
class BandRead:
    """A band (``BandRows``): one slab of ``front + Qb`` token rows per query block, masked to
    each query's ``window`` and segment; ``table`` and ``front`` (slab rows before the block's
    own, a multiple of the query block). Its int array: the slab rows' segments."""

    table: int
    window: int
    front: int

    def start(self, step, s: ReadRefs) -> None:
        """Start the DMA of the block's slab (token rows ``i * Qb ..``)."""
        span = step.config.slab(self) * s.table.words
        offset = pl.multiple_of(step.i * step.config.query_block * s.table.words, 8)
        slab = s.table_rows(step.b, offset, span)
        pltpu.make_async_copy(slab, s.bufs["slab"], s.sems).start()

    def words(self, s: ReadRefs):
        """The block's slab words, once they have arrived."""
        _wait(s.bufs["slab"], s.sems)
        return s.bufs["slab"]

    def weights(self, step, s: ReadRefs):
        """``[R, slab]``: slab row ``l`` is in query ``q``'s window (``0 <= q - l + front <
        window``) and holds the query's segment (rows padded before the first key row and after
        the last hold a segment no query has)."""
        c = step.config
        slab = c.slab(self)
        q = jax.lax.broadcasted_iota(jnp.int32, (c.query_block, slab), 0)
        row = jax.lax.broadcasted_iota(jnp.int32, (c.query_block, slab), 1)
        lag = q - row + self.front
        same = step.meta(0) == s.ints[0][0:1, :]
        return step.per_row(jnp.where((lag >= 0) & (lag < self.window) & same, 1.0, 0.0))


Read = RowsRead | TilesRead | DenseRead | BandRead
