"""Mesh helpers shared by every sharded strategy: the mesh a feature runs on, axis types,
placing arrays for ``shard_map``, the batch axis, and the one ``shard_map`` call they use.

The mesh is the one set with ``jax.set_mesh`` unless a strategy holds ``mesh=``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
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
    "in_manual_context",
    "per_device",
    "typed_mesh",
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


def explicit_part(spec: P, mesh: MeshLike) -> P:
    """**Returns:** ``spec`` keeping only the mesh's ``Explicit`` axis names (of an entry that
    names several axes, e.g. a batch over ``("data", "fsdp")``, those that are)."""

    def kept(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(n for n in names if n is not None and is_explicit(mesh, n))
        return None if not names else names[0] if len(names) == 1 else names

    return P(*(kept(e) for e in spec))


def place(x: Array, mesh: MeshLike, spec: P) -> Array:
    """**Returns:** ``x`` resharded to the ``Explicit``-axis part of ``spec`` (``shard_map``
    demands an exact match there; for Auto axes it inserts the resharding itself)."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return x
    explicit = explicit_part(spec, mesh)
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

    JAX's default ``check_vma=True``, for every user (``HeadParallel``, ``ContextParallel``,
    ``ShardedSelection``, ``per_device``): everything their bodies run is typed for the
    varying-manual-axes check (loop carries, kernels' outputs, ``custom_vjp`` cotangents,
    and collectives: what is equal on every device of an axis, e.g. all-gathered entries or
    top-k rows, is gathered ``to="invarying"``; docs/composing.md). Outputs leave mapped
    over the manual axes they vary over (partial sums stacked and summed outside, or
    ``psum``-ed inside) and replicated where they are typed invariant, so the transpose's
    sum of the replicated inputs' cotangents is the exact gradient. A placement wrapping
    another takes the inner one's axes into its own ``shard_map`` rather than nesting one
    (JAX types a nested ``shard_map``'s backward residuals with the enclosing one's manual
    axes too, and cannot lower that).

    Inside any ``shard_map`` already in context (``in_manual_context``: a caller's, e.g.
    ``HeadParallel`` under a user's data-parallel ``shard_map``, or a placement's around
    ``ShardedSelection`` or a ``per_device`` kernel call) ``fn`` runs under a
    ``jax.checkpoint`` that saves nothing, so that no residual crosses this ``shard_map``'s
    boundary: JAX (0.10 to 0.12) gives a non-forwarded residual the out spec of every axis it
    varies over (``ShapedArray.nospec``), the enclosing one's manual axes included, which the
    lowering refuses ("operates on axis ... already bound by a parent
    sdy.manual_computation", or under ``vmap`` "manual axis ... after free axis ..."). The
    residuals that remain are the arguments, passed on with their own specs; the backward
    recomputes ``fn``'s forward (a nested placement's layer, a nested ``per_device``
    kernel's forward; a selection has no backward).

    **Arguments:** the function, the mesh, ``PartitionSpec`` trees for the arguments and the
    outputs (prefixes allowed), the manual axis names and the arguments.

    **Returns:** ``fn``'s outputs, as ``out_specs`` lays them out.
    """
    args = jax.tree.map(lambda a, spec: place(a, mesh, spec), args, in_specs)
    if in_manual_context():  # no residual leaves it: recomputed in the backward instead
        fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axes - {None}),
    )(*args)


def in_manual_context() -> bool:
    """**Returns:** whether the mesh in context has ``Manual`` axes: the code runs inside a
    ``jax.shard_map`` (a caller's, or a placement's)."""
    return any(t == AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types)


def per_device(fn: Callable, batched, replicated=(), differentiable: bool = True):
    """``fn(batched, replicated)`` once per device of the mesh in context (with none in
    context, the mesh the arrays are typed over: ``typed_mesh``), where the compiler shards
    its batch: a Pallas kernel is one device's program, so under a mesh whose axes are not all
    ``Manual`` (``jit`` sharding the batch, no placement) it runs in a ``shard_map`` manual
    over the axes that shard the batch (an ``Explicit`` one of size 1 included: the arrays
    stay typed sharded over it, which the kernels' reshapes and refs refuse) and every other
    ``Explicit`` axis of size 1 (a batch replicated over it: the Pallas interpreter's buffers
    lose its type), ``batched`` split over the batch's axes and whole over the others,
    ``replicated`` whole. Elsewhere (no mesh, ``Auto`` axes of size 1, inside a ``shard_map``
    over them, a batch replicated over larger axes) ``fn`` is called as it is (the compiler
    replicates a kernel over the other axes; under ``Explicit`` axes its outputs, which carry
    no mesh, typed replicated over the mesh, as the arrays they meet are). Under ``jax.vmap``
    the mapped axis folds into the batch first (``_folded``): the kernel's grid takes it, not
    a loop of kernel calls.

    The batch axes are the ``Explicit`` ones ``batched``'s first array is sharded over, else
    the ``Auto`` axes (in mesh order) whose sizes divide the batch.

    **Arguments:** ``fn``, ``batched`` (a pytree of ``[B, ...]`` arrays), ``replicated`` (a
    pytree of arrays every device takes whole, e.g. sinks) and ``differentiable`` (``False``
    where nothing is differentiated, e.g. a selection's integer picks of inputs whose
    gradient is stopped: no fold, JAX maps the kernel itself; the fold's ``custom_vmap``
    would stay in the backward of a ``jax.checkpoint`` whose policy saves the picks).

    **Returns:** ``fn``'s outputs (a pytree of ``[B, ...]`` arrays).
    """
    # only arrays cross the fold and the shard_map (a read set's int fields stay Python ints)
    arrays, static = eqx.partition(batched, eqx.is_array)
    fn = functools.partial(_with_static, fn, static)
    sharded = functools.partial(_sharded, fn)
    if not differentiable:  # JAX's own vmap of the kernel (the fold's custom_vmap would stay
        return sharded(arrays, replicated)  # in a remat's backward, see _folded)
    return _folded(sharded)(arrays, replicated)


def _with_static(fn: Callable, static, arrays, replicated):
    return fn(eqx.combine(arrays, static), replicated)


def _typed_mesh(tree) -> AbstractMesh | None:
    """**Returns:** the mesh ``tree``'s arrays are typed over (``Explicit`` axes: arrays put on
    a ``jax.make_mesh`` mesh and jitted without ``jax.set_mesh``), else ``None``."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
            if mesh is not None and mesh.axis_names:
                return mesh
    return None


def typed_mesh(*trees):
    """A context: where no mesh is in context but the arrays of ``trees`` are typed over one
    (put on a ``jax.make_mesh`` mesh, whose axes are ``Explicit``, and jitted without
    ``jax.set_mesh``), that mesh as the abstract mesh in context, so that the arrays the
    library builds from constants (loop carries, buffers) are typed over it as the inputs are
    (a ``dynamic_update_slice`` of one by the other is otherwise a sharding type error); else
    nothing."""
    if jax.sharding.get_abstract_mesh().axis_names or (mesh := _typed_mesh(trees)) is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def _sharded(fn: Callable, batched, replicated):
    """``per_device`` after the fold: the ``shard_map`` over the batch's axes and every
    ``Explicit`` axis, if any."""
    with typed_mesh(batched, replicated):  # no mesh in context: the arrays' own, if any
        return _sharded_on(fn, batched, replicated)


def _sharded_on(fn: Callable, batched, replicated):
    """``_sharded`` on the mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    # an Explicit axis of size 1 counts too: the arrays stay typed sharded over it, which a
    # kernel's reshapes and refs refuse (one chip, a mesh written for many)
    axes = [
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Explicit or (t != AxisType.Manual and mesh.shape[a] > 1)
    ]  # fmt: skip
    first = jax.tree.leaves(batched)[0]
    spec = tuple(jax.typeof(first).sharding.spec) if axes else ()
    typed = (spec or (None,))[0]
    chosen = [a for a in ([typed] if isinstance(typed, str) else typed or ()) if a in axes]
    if not chosen:
        size = 1
        for a in axes:
            if not is_explicit(mesh, a) and first.shape[0] % (size * mesh.shape[a]) == 0:
                chosen.append(a)
                size *= mesh.shape[a]
    # an Explicit axis of size 1 is manual too, the batch replicated over it: the Pallas
    # interpreter's buffers lose it (a sharding type error); over a larger one the kernels
    # run replicated as they are (a nested shard_map there fails to lower under vmap)
    manual = set(chosen) | {a for a in axes if is_explicit(mesh, a) and mesh.shape[a] == 1}
    if not manual:
        out = fn(batched, replicated)
        if any(is_explicit(mesh, a) for a in axes):  # a kernel's outputs carry no mesh: typed
            out = jax.tree.map(lambda o: jax.reshard(o, P()), out)  # replicated over it
        return out
    spec = P(tuple(chosen)) if chosen else P()
    in_specs = (each(batched, spec), each(replicated, P()))
    return run_sharded(fn, mesh, in_specs, spec, manual, batched, replicated)


def _folded(fn: Callable) -> Callable:
    """``fn(batched, replicated)`` whose ``jax.vmap`` folds the mapped axis into the batch axis
    of ``batched`` (``[V, B, ...] -> [V * B, ...]``, one call, outputs unfolded), where
    ``replicated`` is not mapped; otherwise (e.g. a ``vmap`` over stacked weights whose sinks
    differ) ``fn`` is mapped as JAX maps it.

    The fold is a ``custom_vmap``, which JAX cannot differentiate in reverse mode: the
    derivative is ``fn``'s own (a ``custom_vjp`` whose forward is ``jax.vjp(fn)``), so under
    ``grad`` of a ``vmap`` the kernels are mapped as JAX maps them."""

    @jax.custom_batching.custom_vmap
    def call(batched, replicated):
        return fn(batched, replicated)

    @call.def_vmap
    def _(size, in_batched, batched, replicated):
        mapped, replicated_mapped = in_batched
        if any(jax.tree.leaves(replicated_mapped)):
            axes = jax.tree.map(lambda m: 0 if m else None, in_batched)
            out = jax.vmap(fn, in_axes=axes)(batched, replicated)
            return out, jax.tree.map(lambda _: True, out)

        def fold(x, m):
            x = x if m else jnp.broadcast_to(x, (size, *x.shape))
            return x.reshape(size * x.shape[1], *x.shape[2:])

        out = call(jax.tree.map(fold, batched, mapped), replicated)
        out = jax.tree.map(lambda o: o.reshape(size, -1, *o.shape[1:]), out)
        return out, jax.tree.map(lambda _: True, out)

    @jax.custom_vjp
    def derivable(batched, replicated):
        return call(batched, replicated)

    def forward(batched, replicated):
        return jax.vjp(fn, batched, replicated)  # the vjp is a pytree of its residuals

    def backward(vjp, cotangent):
        return vjp(cotangent)

    derivable.defvjp(forward, backward)
    return derivable
