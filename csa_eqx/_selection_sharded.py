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
from jaxtyping import Array, Int

from ._auto import AutoSelection
from ._layout import EntryLayout, Visibility
from ._mesh import MeshLike, batch_axis, is_manual, mesh_with_axis, place, row_spec, run_sharded
from ._problem import AbstractSelection, SelectionProblem

__all__ = ["ShardedSelection"]


def _pad_rows(x: Array, pad: int, value: int | float = 0) -> Array:
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


class ShardedSelection(AbstractSelection):
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
    selection bitwise.
    """

    inner: AbstractSelection = AutoSelection()
    tensor_axis: str = "tensor"
    data_axis: str = "data"
    mesh: MeshLike | None = None

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        mesh = mesh_with_axis(self.tensor_axis, "indexer_sharded_topk", self.mesh)
        tensor_axis, inner = self.tensor_axis, self.inner
        q, weights = problem.queries()  # projected here: each shard gets its rows' queries
        query_index, query_segment, layout = problem.visibility
        b, s = query_index.shape
        if s == 1:  # a single query row (decode) is not split
            return inner.select(problem.with_queries(q, weights), k)
        out_layout = P(*row_spec(query_index), None)
        tp = mesh.shape[tensor_axis]
        rows, pad = -(-s // tp), -s % tp
        if pad:
            q, weights, query_segment = (_pad_rows(a, pad) for a in (q, weights, query_segment))
            query_index = _pad_rows(query_index, pad, -1)  # index -1 sees no entry

        def local(q, weights, keys, query_index, query_segment, layout):
            # The [B, S] int rows are tiny: pass them whole and slice this shard's rows here.
            # (Resharding them by rows outside made XLA's CPU SPMD partitioner emit invalid
            # HLO when the layer also shifts the same segment ids; jax 0.10.2.)
            start = jax.lax.axis_index(tensor_axis) * rows
            query_index, query_segment = (
                jax.lax.dynamic_slice_in_dim(a, start, rows, axis=1)
                for a in (query_index, query_segment)
            )
            shard = problem.with_queries(q, weights)._replace(
                keys=keys, visibility=Visibility(query_index, query_segment, layout)
            )
            return jax.lax.all_gather(inner.select(shard, k), tensor_axis, axis=1, tiled=True)

        def this_device(q, weights, *rest):
            # inside a shard_map already manual over the axis (head parallelism), where every
            # device holds all rows: this device's rows, all-gathered the same way
            start = jax.lax.axis_index(tensor_axis) * rows
            q, weights = (
                jax.lax.dynamic_slice_in_dim(a, start, rows, axis=1) for a in (q, weights)
            )
            return local(q, weights, *rest)

        args = (q, weights, problem.keys, query_index, query_segment, layout)
        # where the shards run: inside a shard_map already manual over the axis, each device
        # takes its slice of the rows; else a shard_map of our own splits them
        if is_manual(jax.sharding.get_abstract_mesh(), tensor_axis):
            out = this_device(*args)
            return out[:, :s] if pad else out
        out = self._shard_map(local, mesh, b, args)
        return place(out[:, :s] if pad else out, mesh, out_layout)

    def _shard_map(self, local: Callable, mesh: MeshLike, batch: int, args: tuple) -> Array:
        """``local`` in a ``shard_map``: query rows over ``tensor_axis``, the batch over
        ``data_axis`` when that is free and divides it (``csa_eqx._mesh.batch_axis``)."""
        dp = batch_axis(mesh, self.data_axis, batch)
        shared = P(dp, None)
        specs = (
            P(dp, self.tensor_axis, None, None),
            P(dp, self.tensor_axis, None),
            P(dp, None, None),
            shared,
            shared,
            EntryLayout(shared, shared, shared),
        )
        # nothing here is differentiated, and the all-gather makes the result replicated over
        # ``tensor_axis``
        return run_sharded(local, mesh, specs, P(dp, None, None), set(mesh.axis_names), *args)
