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
for the whole sequence first.

Selections are bitwise equal to one device's: each query scores the same keys. The sequence is
padded at its end to ``2N`` chunks of a multiple of ``m`` rows, each at least ``h`` rows long;
padded rows come after every real row, so no real query sees them, and they are sliced off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ._compat import stacked_all_gather
from .compressor import EntryLayout, entry_layout
from .heads import HeadSplit, sum_partials
from .sharding import MeshLike, _place, mesh_with_axis

__all__ = ["ContextParallel", "ShardRows", "whole_rows"]

_NO_SEGMENT = int(np.iinfo(np.int32).min)  # halo rows before the sequence: seen by no one


class ShardRows(NamedTuple):
    """The integer side of the rows a forward runs on (all ``[B', L]``; one device: the whole
    batch and sequence; context parallel: one batch row per chunk, halo first).

    Arguments:
        positions, segment, query_index: RoPE positions, segment ids and stream row indices.
        own: the entry slots these rows compress, window ends as row indices of these rows
            (``None`` without a compressor).
        layout: every entry slot of the sequence (window ends as stream rows), for visibility.
        gather: the entries of ``own`` -> those of every slot of ``layout``.
    """

    positions: Int[Array, "batch rows"]
    segment: Int[Array, "batch rows"]
    query_index: Int[Array, "batch rows"]
    own: EntryLayout | None
    layout: EntryLayout | None
    gather: Callable[[Array], Array]


def _same(entries: Array) -> Array:
    return entries


def whole_rows(
    positions: Int[Array, "batch seq"],
    segment: Int[Array, "batch seq"],
    query_index: Int[Array, "batch seq"],
    rate: int,
) -> ShardRows:
    """The rows of a single-device forward: each row compresses all of its windows."""
    layout = entry_layout(segment, rate) if rate else None
    return ShardRows(positions, segment, query_index, layout, layout, _same)


class _Plan(NamedTuple):
    devices: int
    chunk: int  # rows per chunk (a multiple of the compression rate, >= halo)
    halo: int
    chunks: np.ndarray  # [N, 2] chunk ids of each device's two shard rows

    def extended(self) -> np.ndarray:
        """Stream rows of each chunk with its halo before it, in shard order (< 0: none)."""
        first = self.chunks[..., None] * self.chunk - self.halo
        return (first + np.arange(self.halo + self.chunk)).reshape(-1)


class ContextParallel(eqx.Module):
    """Run a layer's forward with its sequence split over the mesh axis ``axis`` (zigzag
    chunks, halo by ``ppermute``, entries by all-gather; see the module docstring).

    Arguments:
        axis: the mesh axis the sequence is split over; the mesh must have it.
        data_axis: the mesh axis the batch is split over, when the mesh has it and its size
            divides the batch (otherwise the batch is replicated over it).
        mesh: the mesh (``None``: the one set with ``jax.set_mesh``).
    """

    axis: str = "context"
    data_axis: str = "data"
    mesh: MeshLike | None = None

    def __check_init__(self):
        for name, value in (("context_axis", self.axis), ("data_axis", self.data_axis)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty mesh axis name (got {value!r})")
        if self.axis == self.data_axis:
            raise ValueError(f"context_axis and data_axis must differ (both are {self.axis!r})")

    def whole(self, *arrays: Array | None) -> tuple[Array | None, ...]:
        """The integer ``[B, S]`` inputs (positions, segment ids; ``None`` passes) replicated
        on the mesh: every shard reads them whole (they may arrive split along the sequence).
        """
        mesh = mesh_with_axis(self.axis, "context_parallel", self.mesh)
        return tuple(None if a is None else _place(a, mesh, P()) for a in arrays)

    def plan(self, seq: int, halo: int, rate: int) -> _Plan:
        """Chunk sizes for ``seq`` rows on the axis' devices: ``2N`` chunks, each a multiple of
        ``rate`` rows and at least ``halo`` rows (the sequence is padded up to that)."""
        mesh = mesh_with_axis(self.axis, "context_parallel", self.mesh)
        n, m = mesh.shape[self.axis], max(rate, 1)
        chunk = max(-(-seq // (2 * n)), halo, 1)
        chunk = -(-chunk // m) * m
        chunks = np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1)
        return _Plan(n, chunk, halo, chunks)

    def apply(
        self,
        body: Callable,
        params,
        x: Float[Array, "batch seq hidden"],
        positions: Int[Array, "batch seq"],
        segment: Int[Array, "batch seq"],
        *,
        halo: int,
        rate: int,
        selects: bool,
        sums: int = 0,
        heads: HeadSplit | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], Int[Array, "batch seq k"] | None, tuple]:
        """``body(params, x, rows)`` (a forward over ``ShardRows``, returning ``(y, selection
        or None, sums)`` with ``sums`` a tuple of per-shard float32 scalars over its own rows)
        run context-parallel over the whole sequence.

        Arguments:
            body: the layer's per-row forward.
            params: its arrays (replicated over the context axis).
            x, positions, segment: the layer's inputs ``[B, S, ...]``.
            halo: rows before a chunk its queries or windows need.
            rate: the compression rate (0: no compressor).
            selects: whether ``body`` returns a selection.
            sums: how many scalars ``body`` returns to be summed over the shards.
            heads: head parallelism in the same ``shard_map`` (``None``: off): ``params``
                split over ``heads.axis`` as ``heads.specs`` says, and ``body``'s ``y`` a
                partial sum over this device's heads (summed over the axis here).

        Returns:
            ``(y, selection, sums)``: ``y`` and ``selection`` ``[B, S, ...]`` as a
            single-device forward returns them, and the ``sums`` summed over the shards.
        """
        mesh = mesh_with_axis(self.axis, "context_parallel", self.mesh)
        axis, (b, s) = self.axis, x.shape[:2]
        data = self.data_axis
        dp = data if data in mesh.axis_names and b % mesh.shape[data] == 0 else None
        plan = self.plan(s, halo, rate)
        n, c = plan.devices, plan.chunk
        pad = 2 * n * c - s
        if pad:  # padded whole, then split again (Explicit axes cannot pad a sharded axis)
            x = jnp.pad(_place(x, mesh, P()), ((0, 0), (0, pad), (0, 0)))
        segment = jnp.pad(segment, ((0, 0), (0, pad)), mode="edge")
        positions = jnp.pad(positions, ((0, 0), (0, pad)))
        index = jnp.broadcast_to(jnp.arange(2 * n * c, dtype=jnp.int32), segment.shape)
        ext = plan.extended()
        inside, ext = ext >= 0, np.maximum(ext, 0)
        # queries are the own real rows only: halo and padding rows see no entry (and count
        # for no loss); their outputs are dropped
        own_rows = inside & (np.arange(len(ext)) % (halo + c) >= halo) & (ext < s)
        ints = tuple(
            jnp.where(keep, jnp.take(a, ext, axis=1), fill)
            for a, keep, fill in (
                (positions, inside, 0),
                (segment, inside, _NO_SEGMENT),
                (index, own_rows, -1),
            )
        )
        own = layout = None
        if rate:
            layout = entry_layout(segment, rate)
            per = c // rate
            slots = (plan.chunks[..., None] * per + np.arange(per)).reshape(-1)
            offset = np.repeat((plan.chunks * c - halo).reshape(-1), per)
            end = jnp.take(layout.end, slots, axis=1)
            own = EntryLayout(
                jnp.where(end >= 0, end - offset, -1),
                *(jnp.take(a, slots, axis=1) for a in layout[1:]),
            )
        sharded, whole, batch = P(dp, axis), P(), P(dp)
        args = (params, x, ints, own, layout)
        specs = (
            jax.tree.map(lambda _: whole, params) if heads is None else heads.specs,
            sharded,
            (sharded,) * 3,
            None if own is None else EntryLayout(sharded, sharded, sharded),
            None if layout is None else EntryLayout(batch, batch, batch),
        )
        args = jax.tree.map(lambda a, spec: _place(a, mesh, spec), args, specs)

        def local(params, x, ints, own, layout):
            x = _with_halo(_zigzag(x, plan, axis), plan, axis)
            ints = tuple(_chunk_rows(a, 2) for a in ints)
            if own is not None:
                own = EntryLayout(*(_chunk_rows(a, 2) for a in own))
                layout = EntryLayout(*(jnp.repeat(a, 2, axis=0) for a in layout))
            rows = ShardRows(*ints, own, layout, lambda e: _gather_entries(e, plan, axis))
            y, selection, shard_sums = body(params, x, rows)
            y = _unzigzag(_own_rows(y, plan), plan, axis)
            out = (y if heads is None else y[None],)
            if selects:
                out += (_unzigzag(_own_rows(selection, plan), plan, axis),)
            return out + tuple(jnp.reshape(a, (1,)) for a in shard_sums)

        # partial outputs over the heads leave stacked over the head axis and are summed
        # outside (see heads.py); the sums leave mapped over every manual axis and are summed
        tensor = () if heads is None else (heads.axis,)
        y_spec = sharded if heads is None else P(heads.axis, dp, axis)
        out_specs = (y_spec, sharded) if selects else (y_spec,)
        out_specs += (P((*tensor, axis, dp) if dp else (*tensor, axis)),) * sums
        # check_vma=False: the selection's loops start their carries from constants, which the
        # varying-manual-axes check rejects; every output is mapped over the manual axes, so
        # the transpose's psum of the replicated parameters' cotangents is the exact gradient.
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=specs,
            out_specs=out_specs,
            axis_names=frozenset({axis, dp, *tensor} - {None}),
            check_vma=False,
        )(*args)
        if heads is not None:
            out = (sum_partials(out[0], x.dtype), *out[1:])
        rows_out, summed = out[: len(out) - sums], tuple(jnp.sum(a) for a in out[len(out) - sums :])
        if pad:
            rows_out = tuple(_place(a, mesh, whole)[:, :s] for a in rows_out)
        return rows_out[0], rows_out[1] if selects else None, summed


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
