"""Head-sharded indexer activations (docs/memory.md, "Sharding"); the mesh helpers are in
``csa_eqx._mesh``, the row-sharded selection (``ShardedSelection``) in its own module.

``constrain_heads`` / ``tensor_axis_auto`` place the per-head indexer tensors on the tensor axis
over heads. ``with_sharding_constraint`` only acts on Auto mesh axes (on Explicit axes it is an
assertion, and a contraction over explicitly sharded heads is a type error), so where the tensor
axis is Explicit the stage runs under ``jax.sharding.auto_axes`` for that one axis.

The mesh is the one set with ``jax.set_mesh`` unless a function takes ``mesh=``.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from .._mesh import explicit_part, is_explicit, mesh_with_axis, row_spec

__all__ = ["constrain_heads", "tensor_axis_auto", "on_context_mesh"]


def constrain_heads(x: Float[Array, "batch seq heads *rest"], tensor_axis: str) -> Array:
    """Constrain a per-head tensor to ``tensor_axis`` over heads (axis 2), batch and sequence
    left to the compiler.

    Acts where ``tensor_axis`` is Auto in the current mesh; where it is Explicit this returns
    ``x`` unchanged (run the stage under ``tensor_axis_auto`` to apply it there, as
    the layers do). A mesh without ``tensor_axis``, or whose ``tensor_axis`` size does not
    divide the heads, is a ``ValueError``.

    **Arguments:** ``x [B, S, H, ...]`` and the mesh axis name.

    **Returns:** ``x``, with the sharding constraint where it applies.
    """
    mesh = mesh_with_axis(tensor_axis, "Execution.indexer_heads_axis")
    devices, heads = mesh.shape[tensor_axis], x.shape[2]
    if heads % devices:
        raise ValueError(
            f"Execution.indexer_heads_axis: mesh axis {tensor_axis!r} has {devices} devices, "
            f"which does not divide the {heads} indexer heads (index_n_heads)"
        )
    if is_explicit(mesh, tensor_axis):
        return x
    spec = P(None, None, tensor_axis, *([None] * (x.ndim - 3)))
    return jax.lax.with_sharding_constraint(x, spec)


def tensor_axis_auto(fn: Callable, tensor_axis: str, like: Array) -> Callable:
    """``fn`` run with ``tensor_axis`` Auto, so ``constrain_heads`` can act inside it.

    A no-op where the axis already is Auto. Where it is Explicit, the ``[B, S, ...]`` result
    comes back in the ``[B, S]`` layout of ``like``.

    **Arguments:** the function ``fn``, the mesh axis name and ``like`` (a ``[B, S]`` array).

    **Returns:** the wrapped function.
    """
    mesh = mesh_with_axis(tensor_axis, "Execution.indexer_heads_axis")
    if not is_explicit(mesh, tensor_axis):
        return fn
    return jax.sharding.auto_axes(fn, axes=tensor_axis, out_sharding=P(*row_spec(like), None))


def on_context_mesh(tree):
    """``tree``'s arrays typed on the mesh in context where it is theirs with some ``Explicit``
    axes made ``Auto`` (inside ``tensor_axis_auto``); the rest unchanged.

    ``auto_axes`` recasts the arguments of the function it wraps, not what that function closes
    over: the indexer's weights, which a ``SelectionProblem``'s ``project`` closes over, keep
    the ``Explicit`` mesh they were placed on (``jax.device_put`` on a mesh: a multi-process
    run's global arrays), and an operation that meets them and the stage's own arrays fails
    ("context mesh ... should match the aval mesh"). Their specs keep the axes that stay
    ``Explicit`` (a cast of the type: nothing moves).

    **Arguments:** a pytree (e.g. an indexer module).

    **Returns:** the pytree, its arrays recast where that applies.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.empty or AxisType.Auto not in context.axis_types:
        return tree

    def cast(a):
        if not eqx.is_array(a):
            return a
        sharding = jax.typeof(a).sharding
        mesh = sharding.mesh
        if mesh.empty or mesh == context or mesh.axis_names != context.axis_names:
            return a
        pairs = zip(mesh.axis_types, context.axis_types, strict=True)
        if not all(t == u or (t, u) == (AxisType.Explicit, AxisType.Auto) for t, u in pairs):
            return a
        return jax.reshard(a, explicit_part(sharding.spec, context))

    return jax.tree.map(cast, tree)
