"""Row-sharded indexer selection and head-sharded indexer activations (docs/memory.md,
"Sharding").

``ShardedSelection`` runs the per-query-row selection stage (scores, visibility, exact
top-k) inside an explicit ``jax.shard_map``: query rows are split over the tensor axis, the batch
over the data axis when the mesh has it and it divides the batch; keys and the entry layout are
replicated over the tensor axis. Every row's top-k depends on that row only, so after the
all-gather the indices equal the unsharded ones bitwise. Rows that do not divide the tensor
axis are padded (never an error); a batch the data axis does not divide is replicated.

``constrain_heads`` / ``tensor_axis_auto`` place the per-head indexer tensors on the tensor axis
over heads. ``with_sharding_constraint`` only acts on Auto mesh axes (on Explicit axes it is an
assertion, and a contraction over explicitly sharded heads is a type error), so where the tensor
axis is Explicit the stage runs under ``jax.sharding.auto_axes`` for that one axis.

The mesh is the one set with ``jax.set_mesh`` unless a function takes ``mesh=``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .auto import AutoSelection
from .compressor import EntryLayout
from .selection import AbstractSelection, SelectionProblem, Visibility

__all__ = ["mesh_with_axis", "ShardedSelection", "constrain_heads", "tensor_axis_auto"]

MeshLike = Mesh | AbstractMesh


def mesh_with_axis(axis: str, flag: str, mesh: MeshLike | None = None) -> MeshLike:
    """Arguments: the mesh ``axis`` needed, the ``flag`` naming the feature in the error, and
    the ``mesh`` (``None``: the ``jax.set_mesh`` one).

    Returns: the mesh; a ``ValueError`` when it lacks ``axis``.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{flag} needs a mesh axis named {axis!r}, but the mesh has axes "
            f"{tuple(mesh.axis_names)} (set a mesh with jax.set_mesh or pass mesh=)"
        )
    return mesh


def _explicit(mesh: MeshLike, axis: str) -> bool:
    return mesh.axis_types[mesh.axis_names.index(axis)] == AxisType.Explicit


def _manual(mesh: MeshLike, axis: str) -> bool:
    """Whether ``axis`` is Manual in ``mesh`` (False where the mesh lacks it, e.g. the empty
    ambient mesh when the caller passes ``mesh=`` instead of ``jax.set_mesh``)."""
    names = mesh.axis_names
    return axis in names and mesh.axis_types[names.index(axis)] == AxisType.Manual


def _place(x: Array, mesh: MeshLike, spec: P) -> Array:
    """Reshard ``x`` to the Explicit-axis part of ``spec`` (``shard_map`` demands an exact match
    there; for Auto axes it inserts the resharding itself)."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return x
    explicit = P(*(a if a is not None and _explicit(mesh, a) else None for a in spec))
    return jax.reshard(x, NamedSharding(mesh, explicit) if isinstance(mesh, Mesh) else explicit)


def _pad_rows(x: Array, pad: int, value: int | float = 0) -> Array:
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)


def _row_spec(x: Array) -> P:
    """``[B, S]`` spec of ``x`` as typed (Explicit axes only; Auto axes are untyped)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return P(*(spec + (None,) * (2 - len(spec)))[:2])


class ShardedSelection(AbstractSelection):
    """The selection with query rows sharded over ``tensor_axis`` in an explicit
    ``jax.shard_map``; each shard runs ``inner`` on its rows.

    Arguments:
        inner: the single-device strategy each shard runs (default ``AutoSelection()``).
        tensor_axis: mesh axis the query rows are split over; the mesh must have it.
        data_axis: mesh axis the batch is split over, when the mesh has it and its size
            divides the batch (otherwise the batch is replicated; inside context
            parallelism, which splits the batch over it already, it is left alone).
        mesh: the mesh (``None``: the one set with ``jax.set_mesh``).

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

    def tiling(self, batch: int, seq: int, entries: int, heads: int) -> AbstractSelection:
        return self.inner.tiling(batch, seq, entries, heads)

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        mesh = mesh_with_axis(self.tensor_axis, "indexer_sharded_topk", self.mesh)
        tensor_axis, inner = self.tensor_axis, self.inner
        q, weights = problem.queries()  # projected here: each shard gets its rows' queries
        query_index, query_segment, layout = problem.visibility
        keys, head_chunk, score_dtype = problem.keys, problem.head_chunk, problem.score_dtype
        b, s = query_index.shape
        if s == 1:
            return inner.select(SelectionProblem.from_queries(q, weights, *problem[2:]), k)
        out_layout = P(*_row_spec(query_index), None)
        tp = mesh.shape[tensor_axis]
        data = self.data_axis
        # a data axis already manual (the batch split by context parallelism) is not split again
        free = data in mesh.axis_names and not _manual(mesh, data)
        dp = data if free and b % mesh.shape[data] == 0 else None
        pad = -s % tp
        if pad:
            q, weights, query_segment = (_pad_rows(a, pad) for a in (q, weights, query_segment))
            query_index = _pad_rows(query_index, pad, -1)  # index -1 sees no entry

        shared = P(dp, None)
        specs = (
            P(dp, tensor_axis, None, None),
            P(dp, tensor_axis, None),
            P(dp, None, None),
            shared,
            shared,
            EntryLayout(shared, shared, shared),
        )
        args = (q, weights, keys, query_index, query_segment, layout)
        rows = (s + pad) // tp

        def local(q, weights, keys, query_index, query_segment, layout):
            # The [B, S] int rows are tiny: pass them whole and slice this shard's rows here.
            # (Resharding them by rows outside made XLA's CPU SPMD partitioner emit invalid
            # HLO when the layer also shifts the same segment ids; jax 0.10.2.)
            start = jax.lax.axis_index(tensor_axis) * rows
            query_index, query_segment = (
                jax.lax.dynamic_slice_in_dim(a, start, rows, axis=1)
                for a in (query_index, query_segment)
            )
            visibility = Visibility(query_index, query_segment, layout)
            shard = SelectionProblem.from_queries(
                q, weights, keys, visibility, head_chunk, score_dtype
            )
            return jax.lax.all_gather(inner.select(shard, k), tensor_axis, axis=1, tiled=True)

        if _manual(jax.sharding.get_abstract_mesh(), tensor_axis):
            # inside a shard_map already manual over the axis (head parallelism), where every
            # device holds all rows: run this device's rows directly
            start = jax.lax.axis_index(tensor_axis) * rows
            q, weights = (jax.lax.dynamic_slice_in_dim(a, start, rows, axis=1) for a in args[:2])
            out = local(q, weights, *args[2:])
            return out[:, :s] if pad else out
        # check_vma=False: the selection's loops (chunked heads, streaming) start their carries
        # from constants, which the varying-manual-axes check rejects; nothing here is
        # differentiated, and the all-gather makes the result replicated over ``tensor_axis``.
        args = jax.tree.map(lambda a, spec: _place(a, mesh, spec), args, specs)
        out = jax.shard_map(
            local, mesh=mesh, in_specs=specs, out_specs=P(dp, None, None), check_vma=False
        )(*args)
        return _place(out[:, :s] if pad else out, mesh, out_layout)


def constrain_heads(x: Float[Array, "batch seq heads *rest"], tensor_axis: str) -> Array:
    """Constrain a per-head tensor to ``tensor_axis`` over heads (axis 2), batch and sequence
    left to the compiler.

    Acts where ``tensor_axis`` is Auto in the current mesh; where it is Explicit this returns
    ``x`` unchanged (run the stage under ``tensor_axis_auto`` to apply it there, as
    the layers do). A mesh without ``tensor_axis``, or whose ``tensor_axis`` size does not
    divide the heads, is a ``ValueError``.

    Arguments: ``x [B, S, H, ...]`` and the mesh axis name.

    Returns: ``x``, with the sharding constraint where it applies.
    """
    mesh = mesh_with_axis(tensor_axis, "shard_indexer_acts")
    devices, heads = mesh.shape[tensor_axis], x.shape[2]
    if heads % devices:
        raise ValueError(
            f"shard_indexer_acts: mesh axis {tensor_axis!r} has {devices} devices, which does "
            f"not divide the {heads} indexer heads (index_n_heads)"
        )
    if _explicit(mesh, tensor_axis):
        return x
    spec = P(None, None, tensor_axis, *([None] * (x.ndim - 3)))
    return jax.lax.with_sharding_constraint(x, spec)


def tensor_axis_auto(fn: Callable, tensor_axis: str, like: Array) -> Callable:
    """``fn`` run with ``tensor_axis`` Auto, so ``constrain_heads`` can act inside it.

    A no-op where the axis already is Auto. Where it is Explicit, the ``[B, S, ...]`` result
    comes back in the ``[B, S]`` layout of ``like``.

    Arguments: the function ``fn``, the mesh axis name and ``like`` (a ``[B, S]`` array).

    Returns: the wrapped function.
    """
    mesh = mesh_with_axis(tensor_axis, "shard_indexer_acts")
    if not _explicit(mesh, tensor_axis):
        return fn
    return jax.sharding.auto_axes(fn, axes=tensor_axis, out_sharding=P(*_row_spec(like), None))
