"""Mesh helpers shared by every sharded strategy: the mesh a feature runs on, axis types,
placing arrays for ``shard_map``, the batch axis, and the one ``shard_map`` call they use.

The mesh is the one set with ``jax.set_mesh`` unless a strategy holds ``mesh=``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

__all__ = [
    "MeshLike",
    "mesh_with_axis",
    "check_axes",
    "is_explicit",
    "is_manual",
    "place",
    "row_spec",
    "batch_axis",
    "each",
    "run_sharded",
]

MeshLike = Mesh | AbstractMesh


def mesh_with_axis(axis: str, feature: str, mesh: MeshLike | None = None) -> MeshLike:
    """**Arguments:** the mesh ``axis`` needed, the ``feature`` that needs it (named in the
    error, e.g. ``"Execution.context"``) and the ``mesh`` (``None``: the ``jax.set_mesh`` one).

    **Returns:** the mesh; a ``ValueError`` when it lacks ``axis``.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{feature} needs a mesh axis named {axis!r}, but the mesh has axes "
            f"{tuple(mesh.axis_names)} (set a mesh with jax.set_mesh or pass mesh=)"
        )
    return mesh


def check_axes(name: str, axis: object, data_axis: object) -> None:
    """``ValueError`` unless a sharded placement's ``axis`` (called ``name`` in the error,
    e.g. ``"HeadParallel.axis"``) and its ``data_axis`` are two different non-empty mesh axis
    names.

    **Returns:** ``None``.
    """
    for field, value in ((name, axis), ("data_axis", data_axis)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{field} must be a non-empty mesh axis name (got {value!r})")
    if axis == data_axis:
        raise ValueError(f"{name} and data_axis must differ (both are {axis!r})")


def is_explicit(mesh: MeshLike, axis: str) -> bool:
    """**Returns:** whether the mesh's ``axis`` (which it must have) is ``Explicit``."""
    return mesh.axis_types[mesh.axis_names.index(axis)] == AxisType.Explicit


def is_manual(mesh: MeshLike, axis: str) -> bool:
    """**Returns:** whether ``axis`` is ``Manual`` in ``mesh`` (inside a ``shard_map`` over it);
    ``False`` where the mesh lacks it (e.g. the empty ambient mesh when a strategy holds
    ``mesh=`` instead of ``jax.set_mesh``)."""
    names = mesh.axis_names
    return axis in names and mesh.axis_types[names.index(axis)] == AxisType.Manual


def place(x: Array, mesh: MeshLike, spec: P) -> Array:
    """**Returns:** ``x`` resharded to the ``Explicit``-axis part of ``spec`` (``shard_map``
    demands an exact match there; for Auto axes it inserts the resharding itself)."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return x
    explicit = P(*(a if a is not None and is_explicit(mesh, a) else None for a in spec))
    return jax.reshard(x, NamedSharding(mesh, explicit) if isinstance(mesh, Mesh) else explicit)


def row_spec(x: Array) -> P:
    """**Returns:** the ``[B, S]`` part of ``x``'s sharding as typed (Explicit axes only; Auto
    axes are untyped)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return P(*(spec + (None,) * (2 - len(spec)))[:2])


def batch_axis(mesh: MeshLike, data_axis: str, batch: int) -> str | None:
    """The data axis handled once for every strategy: ``data_axis`` when the mesh has it, it is
    not manual already (an enclosing ``shard_map`` split the batch) and its size divides the
    ``batch``; else ``None`` (the batch stays whole, replicated over the axis).

    **Arguments:** the mesh, the data axis name and the batch size.

    **Returns:** the axis name or ``None``.
    """
    names = mesh.axis_names
    if data_axis not in names or is_manual(jax.sharding.get_abstract_mesh(), data_axis):
        return None
    return data_axis if batch % mesh.shape[data_axis] == 0 else None


def each(tree, spec: P):
    """**Returns:** ``spec`` for every array of ``tree`` (a ``PartitionSpec`` tree of its
    structure: ``run_sharded`` places its arguments by one)."""
    return jax.tree.map(lambda _: spec, tree)


def run_sharded(fn: Callable, mesh: MeshLike, in_specs, out_specs, axes: set, *args) -> object:
    """``fn(*args)`` in a ``jax.shard_map`` manual over ``axes``, the arguments placed on
    ``in_specs`` first (``place``).

    With JAX's default ``check_vma``: every loop builds its carries from its inputs, and every
    kernel types its outputs for the manual axes (``csa_eqx._dispatch.typed``). Every
    strategy's outputs leave mapped over the manual axes they vary over (partial sums stacked
    and summed outside), so the transpose's sum of the replicated inputs' cotangents is the
    exact gradient.

    **Arguments:** the function, the mesh, ``PartitionSpec`` trees for the arguments and the
    outputs (prefixes allowed), the manual axis names and the arguments.

    **Returns:** ``fn``'s outputs, as ``out_specs`` lays them out.
    """
    args = jax.tree.map(lambda a, spec: place(a, mesh, spec), args, in_specs)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axes - {None}),
    )(*args)
