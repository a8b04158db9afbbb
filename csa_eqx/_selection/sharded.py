"""``ShardedSelection``: the indexer selection with query rows sharded over a mesh axis
(docs/memory.md, "Sharding").

The per-query-row selection stage (scores, visibility, exact top-k) runs inside an explicit
``jax.shard_map``: query rows are split over the tensor axis, the batch over the data axis when
the mesh has it and it divides the batch; keys and the entry layout are replicated over the
tensor axis. Every row's top-k depends on that row only, so after the all-gather the indices
equal the unsharded ones bitwise. Rows that do not divide the tensor axis are padded (never an
error); a batch the data axis does not divide is replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from .._mesh import MeshLike, batch_axis, is_manual, mesh_with_axis, place, row_spec, run_sharded
from .auto import AutoSelection
from .base import AbstractSelection, AbstractSplitSelection, SelectionProblem

__all__ = ["ShardedSelection"]


def _pad_rows(x: Array, pad: int) -> Array:
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


class ShardedSelection(AbstractSplitSelection):
    """The selection with query rows sharded over ``tensor_axis`` in an explicit
    ``jax.shard_map``; each shard runs ``inner`` on its rows.

    **Arguments:**

    - ``inner``: the single-device strategy each shard runs (default ``AutoSelection()``).
    - ``tensor_axis``: mesh axis the query rows are split over; the mesh must have it.
    - ``data_axis``: mesh axis the batch is split over, when the mesh has it and its size
        divides the batch (otherwise the batch is replicated; inside context
        parallelism, which splits the batch over it already, it is left alone).
    - ``mesh``: the mesh (``None``: the one set with ``jax.set_mesh``).

    Inside a ``shard_map`` that is already manual over ``tensor_axis`` (head parallelism, where
    every device of the axis holds every row), each device selects its slice of the rows and
    the slices are all-gathered the same way. A single query row (decode) is not sharded.
    Rows that do not divide evenly are **padded** to a multiple of the tensor size with rows
    that see no entry, and the padding is sliced off. The gathered ``[B, S, k]`` result comes
    back in the ``[B, S]`` layout the query indices came in, and equals the unsharded
    selection bitwise; so do a V4.1 candidate source's blocks (``split`` runs any per-row
    computation) and a consumer's selection (its visibility is split with the rows,
    ``visibility.rows``).
    """

    inner: AbstractSelection = AutoSelection()
    tensor_axis: str = "tensor"
    data_axis: str = "data"
    mesh: MeshLike | None = None

    def split(self, problem: SelectionProblem, run: Callable) -> tuple[Array, ...]:
        """``run``'s ``[B, S, n]`` results (a tuple), each shard running it on its rows of the
        problem (their queries and visibility) and the shards all-gathered."""
        mesh = mesh_with_axis(self.tensor_axis, "indexer_sharded_topk", self.mesh)
        tensor_axis = self.tensor_axis
        q, weights = problem.queries()  # projected here: each shard gets its rows' queries
        visibility = problem.visibility
        b, s = visibility.query_index.shape
        if s == 1:  # a single query row (decode) is not split
            return run(problem.with_queries(q, weights))
        out_layout = P(*row_spec(visibility.query_index), None)
        tp = mesh.shape[tensor_axis]
        rows, pad = -(-s // tp), -s % tp
        # padded with rows that see no entry
        per_row = (q, weights)
        if pad:
            per_row = tuple(_pad_rows(a, pad) for a in per_row)
            visibility = visibility.pad_rows(pad)

        def shard(per_row, keys, visibility):
            # The visibility's per-row arrays are tiny beside the queries: pass them whole and
            # slice this shard's rows here. (Resharding the [B, S] int rows by rows outside made
            # XLA's CPU SPMD partitioner emit invalid HLO when the layer also shifts the same
            # segment ids; jax 0.10.2.)
            start = jax.lax.axis_index(tensor_axis) * rows
            q, weights = per_row
            part = problem.with_queries(q, weights)._replace(
                keys=keys, visibility=visibility.rows(start, rows)
            )
            return run(part)

        def local(*args):  # this shard's rows, all-gathered: equal on every device (typed
            # invariant over the axis, as check_vma wants of what leaves replicated over it)
            return tuple(_gathered_rows(out, tensor_axis) for out in shard(*args))

        def this_device(per_row, *rest):
            # inside a shard_map already manual over the axis (head parallelism), where every
            # device holds all rows: this device's rows, all-gathered the same way
            start = jax.lax.axis_index(tensor_axis) * rows
            per_row = tuple(jax.lax.dynamic_slice_in_dim(a, start, rows, axis=1) for a in per_row)
            return local(per_row, *rest)

        args = (per_row, problem.keys, visibility)
        # where the shards run: inside a shard_map already manual over the axis, each device
        # takes its slice of the rows; else a shard_map of our own splits them
        if is_manual(jax.sharding.get_abstract_mesh(), tensor_axis):
            return tuple(out[:, :s] for out in this_device(*args))
        outs = self._shard_map(shard, mesh, b, args)
        whole = P(batch_axis(mesh, self.data_axis, b), None, None)  # the rows joined
        return tuple(place(place(out, mesh, whole)[:, :s], mesh, out_layout) for out in outs)

    def _shard_map(
        self, local: Callable, mesh: MeshLike, batch: int, args: tuple
    ) -> tuple[Array, ...]:
        """``local`` in a ``shard_map``: query rows over ``tensor_axis``, the batch over
        ``data_axis`` when that is free and divides it (``csa_eqx._mesh.batch_axis``); the
        shards' rows joined by the ``shard_map``'s output (typed as varying over the axis,
        as ``check_vma`` wants, where an all-gather inside would be typed varying too)."""
        dp = batch_axis(mesh, self.data_axis, batch)
        per_row = tuple(P(dp, self.tensor_axis, *[None] * (a.ndim - 2)) for a in args[0])
        whole = jax.tree.map(lambda a: P(dp, *[None] * (a.ndim - 1)), args[2])
        specs = (per_row, P(dp, None, None), whole)
        # nothing here is differentiated
        axes = {a for a in mesh.axis_names if not is_manual(jax.sharding.get_abstract_mesh(), a)}
        return run_sharded(local, mesh, specs, P(dp, self.tensor_axis, None), axes, *args)


def _gathered_rows(x: Array, axis: str) -> Array:
    """The shards' rows of ``x`` (axis 1) all-gathered over ``axis``; typed invariant over it
    where ``x`` is typed varying (``check_vma``): equal on every device, so it may leave a
    placement replicated over the axis."""
    to = "invarying" if axis in jax.typeof(x).manual_axis_type.varying else "varying"
    return jax.lax.all_gather(x, axis, axis=1, tiled=True, to=to)
