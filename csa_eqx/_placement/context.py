"""Context parallelism: a layer's sequence split over a mesh axis (docs/scaling.md).

``ContextParallel`` runs a layer's per-row forward inside ``jax.shard_map`` over the context
axis, and over the data axis when the mesh has one that divides the batch (manual over those
axes only; the other mesh axes stay with the compiler). With ``N`` devices the (padded)
sequence is cut into ``2N`` chunks of ``c`` rows and device ``i`` owns chunks ``i`` and
``2N - 1 - i`` (zigzag), so every device holds as many early (cheap) as late (expensive)
causal rows. Each chunk becomes one batch row of the shard, preceded by a *halo*: the ``h``
rows before it (V4: the sliding window's ``window - 1`` and the compressor's preceding /
overlapping window, ``2m - 1`` rows for CSA, ``m - 1`` for HCA; V3.2: none). The halo's
hidden states arrive by ``ppermute`` from the neighbouring chunk's owner, and the shard
recomputes their projections (``h / c`` extra work, none of it duplicated communication of
per-token keys). Every shard makes the entries of its own chunks (V4: the windows that close
in them, ``S / m`` rows in all; V3.2: every token's MLA latent and indexer key) and they are
all-gathered. Everything integer (segments, positions, the entry layout) is tiny and computed
for the whole sequence first. State a layer carries (``Carried``: V4.1's published state) is
chunked with the rows when it has one row per token (selections, candidates) and repeated for
each chunk when it is of the whole sequence (the gathered entries, keys and layout).

Selections are bitwise equal to one device's: each query scores the same keys. The sequence is
padded at its end to ``2N`` chunks of a multiple of ``m`` rows, each at least ``h`` rows long;
padded rows come after every real row, so no real query sees them, and they are sliced off.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from .._backend import backend_tiles, shared_tiles
from .._compat import stacked_all_gather
from .._layout import EntryLayout, entry_layout
from .._mesh import MeshLike, batch_axis, check_axes, each, mesh_with_axis, place, run_sharded
from .._rows import Rows
from .base import AbstractPlacement, Body, Carried, Hidden, SingleDevice, untagged

__all__ = ["ContextParallel"]

_NO_SEGMENT = int(np.iinfo(np.int32).min)  # halo rows before the sequence: seen by no one


class _Plan(NamedTuple):
    devices: int
    chunk: int  # rows per chunk (a multiple of the compression rate, >= halo)
    halo: int
    chunks: np.ndarray  # [N, 2] chunk ids of each device's two shard rows

    def extended(self) -> np.ndarray:
        """Stream rows of each chunk with its halo before it, in shard order (< 0: none)."""
        first = self.chunks[..., None] * self.chunk - self.halo
        return (first + np.arange(self.halo + self.chunk)).reshape(-1)


class ContextParallel(AbstractPlacement):
    """Run a layer's forward with its sequence split over the mesh axis ``axis`` (zigzag
    chunks, halo by ``ppermute``, entries by all-gather; see the module docstring).

    **Arguments:**

    - ``axis``: the mesh axis the sequence is split over; the mesh must have it.
    - ``data_axis``: the mesh axis the batch is split over, when the mesh has it and its size
        divides the batch (otherwise the batch is replicated over it).
    - ``mesh``: the mesh (``None``: the one set with ``jax.set_mesh``).
    - ``inner``: the placement each shard runs its chunks with (``SingleDevice()``, or
        ``HeadParallel(...)`` over another axis: context around heads).
    """

    axis: str = "context"
    data_axis: str = "data"
    mesh: MeshLike | None = None
    inner: AbstractPlacement = SingleDevice()

    def __check_init__(self):
        check_axes("ContextParallel.axis", self.axis, self.data_axis)

    def around(self, inner: AbstractPlacement) -> ContextParallel:
        """**Returns:** this placement with ``inner`` run inside its ``shard_map``."""
        return ContextParallel(self.axis, self.data_axis, self.mesh, inner)

    def rows_inputs(self, x, positions, segment_ids):
        """The rows are built whole: integer rows of their own (``x`` may be split along the
        sequence), ``positions`` and ``segment_ids`` replicated on the mesh (every shard reads
        them whole). See ``AbstractPlacement.rows_inputs``."""
        mesh = mesh_with_axis(self.axis, "Execution.context", self.mesh)
        whole = tuple(None if a is None else place(a, mesh, P()) for a in (positions, segment_ids))
        return jnp.zeros(x.shape[:2], jnp.float32), *whole

    def plan(self, seq: int, halo: int, rate: int) -> _Plan:
        """Chunk sizes for ``seq`` rows on the axis' devices: ``2N`` chunks, each a multiple of
        ``rate`` rows and at least ``halo`` rows (the sequence is padded up to that)."""
        mesh = mesh_with_axis(self.axis, "Execution.context", self.mesh)
        n, m = mesh.shape[self.axis], max(rate, 1)
        chunk = max(-(-seq // (2 * n)), halo, 1)
        chunk = -(-chunk // m) * m
        chunks = np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1)
        return _Plan(n, chunk, halo, chunks)

    def run(self, body: Body, layer: eqx.Module, x: Hidden, rows: Rows, carried: Carried):
        """The body over this device's zigzag chunks, each with its halo (``layer.context_halo``
        rows) and the entries its rows close (``layer.entry_rate`` rows per entry), gathered
        into every slot's by ``rows.gather``; each chunk's shard runs ``inner``, with the
        layer's tiles shared over the devices (``csa_eqx._backend.shared_tiles``). The ``carried``
        state's ``per_row`` arrays are chunked as ``x`` (halo rows included) and its ``whole``
        ones repeated for each chunk's batch row. See ``AbstractPlacement.run``: ``y``,
        ``selection`` and ``carried.per_row`` come back ``[B, S, ...]`` as one device returns
        them, ``carried.whole`` (of the entry slots, ``[B, T, ...]``) as the first chunk's
        shard returns it, cut to the sequence's ``T`` slots (the padding's are dropped; the
        queries see only the sequence's own slots, so the layout comes back as ``rows.layout``),
        the ``sums`` over each shard's own rows summed."""
        mesh = mesh_with_axis(self.axis, "Execution.context", self.mesh)
        axis, (b, s) = self.axis, x.shape[:2]
        dp = batch_axis(mesh, self.data_axis, b)
        plan = self.plan(s, layer.context_halo, layer.entry_rate)
        pad = 2 * plan.devices * plan.chunk - s
        if pad:  # padded whole, then split again (Explicit axes cannot pad a sharded axis)
            x, per_row = _padded((x, carried.per_row), mesh, pad)
            carried = carried._replace(per_row=per_row)
        segment = jnp.pad(rows.segment, ((0, 0), (0, pad)), mode="edge")
        ints = _chunk_ints(rows.positions, segment, plan, s, pad)
        own, layout = _entry_layouts(segment, rows.layout, plan, layer.entry_rate)
        layer = untagged(layer)  # inside a caller's shard_map: its selection unnamed
        params, static = eqx.partition(layer, eqx.is_array)
        # heads inside (HeadParallel): one shard_map over both axes, the layer's heads split
        # by its specs (JAX types a nested shard_map's backward residuals with the enclosing
        # one's axes too, which it cannot lower)
        split = getattr(self.inner, "param_specs", None)
        inner_axes = set() if split is None else {self.inner.axis}
        sharded, batch = P(dp, axis), P(dp)
        specs = (
            each(params, P()) if split is None else split(layer, mesh),
            sharded,
            (sharded,) * 3,
            None if own is None else EntryLayout(sharded, sharded, sharded),
            None if layout is None else EntryLayout(batch, batch, batch),
            Carried(each(carried.per_row, sharded), each(carried.whole, batch)),
        )
        run = self.inner.run if split is None else self.inner.run_split
        local = partial(_shard, body, run, static, plan, axis)
        # the sums leave mapped over every manual axis and are summed outside; the whole state
        # leaves unmapped over the axis (every device holds it all)
        out_specs = (sharded, sharded, P((axis, dp) if dp else axis), Carried(sharded, batch))
        args = (params, x, ints, own, layout, carried)
        manual = {axis, dp} | inner_axes
        y, selection, sums, carried = run_sharded(local, mesh, specs, out_specs, manual, *args)
        if pad:
            y, selection, carried = _unpadded(y, selection, carried, rows.layout, mesh, s)
        return y, selection, tuple(jnp.sum(a) for a in sums), carried


def _padded(tree, mesh: MeshLike, pad: int):
    """``tree``'s ``[B, S, ...]`` arrays replicated on the mesh and padded with ``pad`` rows."""
    return jax.tree.map(
        lambda a: jnp.pad(place(a, mesh, P()), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)),
        tree,
    )


def _unpadded(y, selection, carried: Carried, layout, mesh: MeshLike, s: int):
    """The shard_map's results without the padding: ``y``, ``selection`` and the per-row state
    cut to the sequence's ``s`` rows, the whole state to its entry slots (the queries see only
    the sequence's own slots)."""
    y, selection, per_row = jax.tree.map(
        lambda a: place(a, mesh, P())[:, :s], (y, selection, carried.per_row)
    )
    t = 0 if layout is None else layout.end.shape[1]
    whole = jax.tree.map(lambda a: place(a, mesh, P())[:, :t], carried.whole)
    return y, selection, Carried(per_row, whole)


def _chunk_ints(positions: Array, segment: Array, plan: _Plan, s: int, pad: int) -> tuple:
    """The integer rows of every chunk with its halo, in shard order (``plan.extended``):
    positions, segments (``_NO_SEGMENT`` for halo rows before the sequence) and the query
    index, ``-1`` on every row but the chunks' own real rows (halo and padding rows see no
    entry, count for no loss, and their outputs are dropped). ``segment`` is already padded."""
    positions = jnp.pad(positions, ((0, 0), (0, pad)))
    index = jnp.broadcast_to(jnp.arange(s + pad, dtype=jnp.int32), segment.shape)
    ext = plan.extended()
    inside, ext = ext >= 0, np.maximum(ext, 0)
    own_rows = inside & (np.arange(len(ext)) % (plan.halo + plan.chunk) >= plan.halo) & (ext < s)
    return tuple(
        jnp.where(keep, jnp.take(a, ext, axis=1), fill)
        for a, keep, fill in (
            (positions, inside, 0),
            (segment, inside, _NO_SEGMENT),
            (index, own_rows, -1),
        )
    )


def _entry_layouts(segment: Array, layout: EntryLayout | None, plan: _Plan, rate: int):
    """``(own, layout)``: the entry slots each chunk compresses (their ends relative to the
    chunk's first halo row), and what the queries see (``layout``, the sequence's own slots,
    with empty slots up to the padded sequence's); ``(None, None)`` for a layer without
    entries (``rate == 0``). ``segment`` is the padded sequence's."""
    if not rate:
        return None, None
    padded = entry_layout(segment, rate)
    per = plan.chunk // rate
    slots = (plan.chunks[..., None] * per + np.arange(per)).reshape(-1)
    offset = np.repeat((plan.chunks * plan.chunk - plan.halo).reshape(-1), per)
    end = jnp.take(padded.end, slots, axis=1)
    own = EntryLayout(
        jnp.where(end >= 0, end - offset, -1),
        *(jnp.take(a, slots, axis=1) for a in padded[1:]),
    )
    return own, _with_empty_slots(layout, padded.end.shape[1])


def _shard(body: Body, run, static, plan: _Plan, axis: str, params, x, ints, own, layout, carried):
    """One device's shard (inside the ``shard_map``): its contiguous rows to zigzag chunks with
    their halos (one batch row per chunk), the inner placement's ``run`` over them with the
    layer's tiles shared over the devices, and the results back to its contiguous rows."""

    def chunked(a):  # contiguous rows -> zigzag chunks with their halos
        return _with_halo(_zigzag(a, plan, axis), plan, axis)

    def joined(a):  # per-chunk rows -> this device's contiguous rows, halos dropped
        return _unzigzag(_own_rows(a, plan), plan, axis)

    x = chunked(x)
    carried = Carried(
        jax.tree.map(chunked, carried.per_row),
        jax.tree.map(lambda a: jnp.repeat(a, 2, axis=0), carried.whole),
    )
    ints = tuple(_chunk_rows(a, 2) for a in ints)
    if own is not None:
        own = EntryLayout(*(_chunk_rows(a, 2) for a in own))
        layout = EntryLayout(*(jnp.repeat(a, 2, axis=0) for a in layout))
    rows = Rows(*ints, own, layout, lambda e: _gather_entries(e, plan, axis))
    # each device's working buffers sized for its share of the rows (same results)
    shard = eqx.combine(params, static)
    ex = shard.execution
    tiles = shared_tiles(backend_tiles(ex.tiles), plan.devices)
    shard = shard.with_execution(dataclasses.replace(ex, tiles=tiles))
    y, selection, sums, carried = run(body, shard, x, rows, carried)
    y, selection, per_row = jax.tree.map(joined, (y, selection, carried.per_row))
    # the chunks' batch rows hold the same whole-sequence state: the first chunk's
    whole = jax.tree.map(lambda a: a[::2], carried.whole)
    return y, selection, tuple(jnp.reshape(a, (1,)) for a in sums), Carried(per_row, whole)


def _with_empty_slots(layout: EntryLayout, slots: int) -> EntryLayout:
    """``layout`` with empty slots (``end = -1``, no segment, no prior) appended up to ``slots``."""
    pad = [(0, 0), (0, slots - layout.end.shape[1])]
    return EntryLayout(
        *(jnp.pad(a, pad, constant_values=v) for a, v in zip(layout, (-1, -1, False), strict=True))
    )


def _chunk_rows(a: Array, chunks: int) -> Array:
    """``[B, chunks * L, ...]`` -> ``[B * chunks, L, ...]`` (one batch row per chunk)."""
    return a.reshape(a.shape[0] * chunks, a.shape[1] // chunks, *a.shape[2:])


def _own_rows(a: Array, plan: _Plan) -> Array:
    """``[2B, h + c, ...]`` per-chunk results -> ``[B, 2c, ...]`` without the halo rows."""
    a = a[:, plan.halo :]
    return a.reshape(a.shape[0] // 2, 2 * plan.chunk, *a.shape[2:])


def _owner(chunk: int, devices: int) -> int:
    """The device that owns ``chunk`` in the zigzag order."""
    return chunk if chunk < devices else 2 * devices - 1 - chunk


def _zigzag(x: Array, plan: _Plan, axis: str) -> Array:
    """This device's contiguous rows (chunks ``2i``, ``2i + 1``) -> its zigzag chunks (``i``,
    ``2N - 1 - i``), by one ``ppermute`` per chunk parity: ``i`` and ``2N - 1 - i`` differ in
    parity, so each device receives one chunk of each."""
    n, c = plan.devices, plan.chunk
    got = [
        jax.lax.ppermute(
            x[:, k * c : (k + 1) * c], axis, [(d, _owner(2 * d + k, n)) for d in range(n)]
        )
        for k in (0, 1)
    ]
    even = jax.lax.axis_index(axis) % 2 == 0
    first, second = jnp.where(even, got[0], got[1]), jnp.where(even, got[1], got[0])
    return jnp.concatenate([first, second], axis=1)


def _unzigzag(x: Array, plan: _Plan, axis: str) -> Array:
    """``_zigzag``'s inverse: ``[B, 2c, ...]`` zigzag chunks -> this device's contiguous rows."""
    n, c = plan.devices, plan.chunk
    first, second = x[:, :c], x[:, c:]
    even = jax.lax.axis_index(axis) % 2 == 0
    sends = jnp.where(even, first, second), jnp.where(even, second, first)  # parity 0, 1
    back = [
        jax.lax.ppermute(sends[k], axis, [(_owner(2 * d + k, n), d) for d in range(n)])
        for k in (0, 1)
    ]
    return jnp.concatenate(back, axis=1)


def _with_halo(x: Array, plan: _Plan, axis: str) -> Array:
    """This device's two chunks ``[B, 2c, d]``, each preceded by the ``h`` rows before it:
    ``[2B, h + c, d]``. Chunk ``i``'s halo is the tail of chunk ``i - 1`` on device ``i - 1``
    (none on device 0); chunk ``2N - 1 - i``'s is the tail of chunk ``2N - 2 - i`` on device
    ``i + 1``, or of this device's first chunk on the last device."""
    n, c, h = plan.devices, plan.chunk, plan.halo
    first, second = x[:, :c], x[:, c:]
    if h:
        tails = first[:, c - h :], second[:, c - h :]
        up = [(j, j + 1) for j in range(n - 1)]
        down = [(j + 1, j) for j in range(n - 1)]
        halo_first = jax.lax.ppermute(tails[0], axis, up) if up else jnp.zeros_like(tails[0])
        halo_second = jax.lax.ppermute(tails[1], axis, down) if down else tails[0]
        last = jax.lax.axis_index(axis) == n - 1
        halo_second = jnp.where(last, tails[0], halo_second)
        first = jnp.concatenate([halo_first, first], axis=1)
        second = jnp.concatenate([halo_second, second], axis=1)
    return _chunk_rows(jnp.concatenate([first, second], axis=1), 2)


def _gather_entries(entries: Array, plan: _Plan, axis: str) -> Array:
    """This device's chunks' entries ``[2B, c/m, d]`` -> every slot's, in slot order and
    repeated per chunk: ``[2B, T, d]``."""
    b2, per = entries.shape[:2]
    e = entries.reshape(b2 // 2, 2, per, *entries.shape[2:])
    g = stacked_all_gather(e, axis)  # [N, B, 2, per, d]: device i holds chunks i, 2N-1-i
    early, late = g[:, :, 0], g[::-1, :, 1]  # chunks 0..N-1 and N..2N-1
    every = jnp.concatenate([early, late], axis=0)  # [2N, B, per, d]
    every = jnp.moveaxis(every, 0, 1).reshape(b2 // 2, 2 * plan.devices * per, -1)
    return jnp.repeat(every, 2, axis=0)
