"""The records and array layouts of ``MosaicAttention``'s kernels (``mosaic_forward.py``,
``mosaic_backward.py``; docs/kernels.md, "The Mosaic attention kernel (TPU)"): a call's static
``Config`` (its ``Table`` and read set records, ``RowsRead``, ``TilesRead``, ``DenseRead``,
``BandRead``, are ``mosaic_reads``', re-exported here), and the plain XLA layouts the kernels
read and write.

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

Per-row scalars (``lse``, the backward's coefficient) travel as ``[ceil(R / 128), 128]`` blocks
(row ``r`` at ``[r // 128, r % 128]``: whole (8, 128) tiles in HBM for ``R = 1024``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._mosaic import LANES, round_up
from .._ops import pad_axis
from .mosaic_reads import BandRead, DenseRead, Read, RowsRead, Table, TilesRead
from .reads import DenseKeys

__all__ = [
    "Table",
    "RowsRead",
    "TilesRead",
    "DenseRead",
    "BandRead",
    "Read",
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
    "tiles_ints",
    "picked_tiles",
    "visit_lanes",
    "entry_meta",
    "query_columns",
    "QUERY_PAD",
    "KEY_PAD",
]

QUERY_PAD = -(2**31)  # the segment of padded query rows: no key row holds it
KEY_PAD = -(2**31) + 1  # the segment of padded band rows: no query holds it


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
    sources: tuple[Read, ...]
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

    def slab(self, band: BandRead) -> int:
        """Rows of a band's slab."""
        return band.front + self.query_block

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

    def visited_tiles(self, read: TilesRead) -> int:
        """The tiles a skipping tiles set's visit lists choose among (its table's), or ``0``
        where it does not skip (``mosaic_layout.tiles_ints``' ``tiles``)."""
        return self.tables[read.table].rows // self.tile if read.skip else 0

    def grad_tables(self) -> tuple[int, ...]:
        """The tables the backward returns a gradient table of: those a non-band source reads,
        and the bands whose gradients it adds in VMEM."""
        band = {s.table for s in self.sources if isinstance(s, BandRead)}
        return tuple(t for t in range(len(self.tables)) if t not in band or self.in_vmem(t))

    def vmem_grad_tables(self) -> tuple[int, ...]:
        """The tables whose gradients the backward accumulates in VMEM."""
        return tuple(t for t in self.grad_tables() if self.in_vmem(t))

    def in_vmem(self, table: int) -> bool:
        return not self.tables[table].hbm_grads

    def slab_bands(self) -> tuple[int, ...]:
        """The band sources whose gradients are slabs (see ``Table.hbm_grads``)."""
        reads = enumerate(self.sources)
        return tuple(k for k, s in reads if isinstance(s, BandRead) and not self.in_vmem(s.table))


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


# --- the read sets' int arrays (plain XLA) -------------------------------------------------


def tiles_ints(idx: Array, nq: int, qb: int, tile: int, tiles: int = 0):
    """A tiles source's int arrays and its tile counts ``[B, n_q]``.

    **Arguments:** its indices ``idx [B, seq, width]`` (``-1``: none), the query blocks ``nq``
    of ``qb`` queries, the ``tile``; ``tiles``: the table's tiles where the source skips the
    tiles no query of a block picked (``TilesRead.skip``), else ``0``.

    **Returns:** ``((idx,), counts)``, the counts up to the block's largest index (the kernel
    transposes each block of ``idx`` itself); skipping, ``((idx, visits), counts)``: each
    block's picked tiles in order, then the others (``picked_tiles``), ``visit_lanes(tiles)``
    a block (the rest zeros), as ``[B, 1, n_q * visit_lanes]`` (a grid step's block ``[1,
    visit_lanes]``: Mosaic's block rule takes the last two dimensions whole or in (8, 128)
    tiles, and its rule for 1-D blocks asks for the chip it lowers for, which a compile-only
    TPU has not), the counts how many it picked.
    """
    b, _, width = idx.shape
    if not tiles:
        counts = (jnp.max(idx.reshape(b, nq, qb * width), axis=-1) + tile) // tile
        return (idx,), counts
    picked = picked_tiles(idx, nq, qb, tile, tiles)
    visits = jnp.argsort(~picked, axis=-1, stable=True).astype(jnp.int32)
    visits = pad_axis(visits, 2, visit_lanes(tiles)).reshape(b, 1, -1)
    return (idx, visits), jnp.sum(picked, axis=-1, dtype=jnp.int32)


def visit_lanes(tiles: int) -> int:
    """A grid step's visit list's length for a table of ``tiles`` tiles: whole 128s (Mosaic's
    block rule for the last dimension)."""
    return round_up(tiles, LANES)


def picked_tiles(idx: Array, nq: int, qb: int, tile: int, tiles: int) -> Array:
    """bool ``[B, n_q, tiles]``: some query of the block picked a row of the tile (``idx [B,
    seq, width]``, ``-1``: none). Formed as 32 tiles a word, each word one OR-reduction over
    the block's picks (bit ``t % 32`` of word ``t // 32``: tile ``t``), then unpacked: no
    one-hot ``[..., width, tiles]`` (V3.2 at 32k: 2048 blocks x 32768 picks, 64 tiles, two
    passes over the picks)."""
    b, _, width = idx.shape
    idx = idx.reshape(b, nq, qb * width)
    # lax.div, not //: jnp's integer floor division keeps sign corrections XLA may form as
    # arrays of the picks' size (V3.2 at 32k: 0.5 GiB more temporaries, hoisted out of the
    # head groups' loop)
    t = jax.lax.div(jnp.maximum(idx, 0), np.int32(tile))
    word = jnp.where(idx >= 0, jnp.right_shift(t, 5), -1)  # -1: in no word
    bit = jnp.left_shift(np.int32(1), jnp.bitwise_and(t, 31))
    words = []
    for w in range(-(-tiles // 32)):
        hit = jnp.where(word == w, bit, 0)
        words.append(jax.lax.reduce(hit, np.int32(0), jax.lax.bitwise_or, (2,)))
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(jnp.stack(words, axis=-1)[..., None], shifts) & 1
    return bits.reshape(b, nq, -1)[..., :tiles] > 0


def entry_meta(dense: DenseKeys, tile: int) -> Array:
    """int32 ``[B, rows / tile, 8, tile]``: the entries' end (row 0) and segment (row 1) per
    tile (padded entries: end ``-1``, seen by no query), the kernel's visibility rule's."""
    b, t = dense.layout.end.shape
    rows = round_up(t, tile)
    end = pad_axis(dense.layout.end.astype(jnp.int32), 1, rows, -1)
    segment = pad_axis(dense.layout.segment.astype(jnp.int32), 1, rows)
    emeta = jnp.zeros((b, 8, rows), jnp.int32).at[:, 0].set(end).at[:, 1].set(segment)
    return emeta.reshape(b, 8, rows // tile, tile).transpose(0, 2, 1, 3)


def query_columns(dense: DenseKeys, sp: int) -> dict[int, Array]:
    """The per-query metadata columns the visibility rule reads: 1, each query's index; 2, its
    segment (padded queries: index ``-1``, see nothing)."""
    return {
        1: pad_axis(dense.query_index.astype(jnp.int32), 1, sp, -1),
        2: pad_axis(dense.query_segment.astype(jnp.int32), 1, sp, QUERY_PAD),
    }
