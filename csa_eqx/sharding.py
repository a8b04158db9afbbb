"""Mesh helpers and head-sharded indexer activations (docs/memory.md, "Sharding"); the
row-sharded selection, ``ShardedSelection``, is built on them in its own module.

``constrain_heads`` / ``tensor_axis_auto`` place the per-head indexer tensors on the tensor axis
over heads. ``with_sharding_constraint`` only acts on Auto mesh axes (on Explicit axes it is an
assertion, and a contraction over explicitly sharded heads is a type error), so where the tensor
axis is Explicit the stage runs under ``jax.sharding.auto_axes`` for that one axis.

The mesh is the one set with ``jax.set_mesh`` unless a function takes ``mesh=``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

__all__ = ["mesh_with_axis", "constrain_heads", "tensor_axis_auto"]

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


def _row_spec(x: Array) -> P:
    """``[B, S]`` spec of ``x`` as typed (Explicit axes only; Auto axes are untyped)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return P(*(spec + (None,) * (2 - len(spec)))[:2])


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
