"""How a Pallas kernel is run, decided once when the program is traced (docs/kernels.md,
"Where a kernel runs"; docs/composing.md): the one mechanism the Triton kernels
(``csa_eqx._triton.run_kernel``) and the Mosaic TPU kernels (``csa_eqx._mosaic.run_mosaic``)
share.

A kernel strategy's ``interpret`` field (``csa_eqx._backend.kernel_interpret``) says whether its
kernels are compiled (for the platform the program is built for) or interpreted; nothing is
chosen per platform at lowering, so a program holds one version of each kernel and no effect:
it composes with ``jax.checkpoint``, ``custom_vjp``, ``vmap`` and ``scan`` as any XLA program
does. A kernel that cannot run where the program is built for raises a
``NotImplementedError`` naming it while the program is traced.

Inside a ``shard_map`` with ``check_vma`` (JAX's default), a kernel's outputs vary over the
manual axes its inputs vary over (``typed``): ``pallas_call`` takes its output types as given;
there Pallas' plain interpret mode runs through ``csa_eqx._compat.interpreted``.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from ._backend import Interpret, kernel_dtypes
from ._compat import interpreted

__all__ = ["launch", "typed", "converted_for_blocks"]


def typed(out_shape, args):
    """``out_shape`` (a ``jax.ShapeDtypeStruct`` pytree) varying over every manual mesh axis
    any of ``args`` varies over: what a kernel's outputs are inside a ``shard_map`` with
    ``check_vma`` (invariant where none of ``args`` varies: a batch replicated over the manual
    axes; unchanged outside one)."""
    mats = [jax.typeof(a).manual_axis_type for a in jax.tree.leaves(args)]
    varying = frozenset().union(*(m.varying for m in mats))
    manual = any(t == AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types)
    if not varying and not manual:
        return out_shape
    mat = type(mats[0])(varying=varying)
    # the manual axis type of an abstract value needs a sharding over the (manual) mesh
    sharding = jax.NamedSharding(jax.sharding.get_abstract_mesh(), jax.P())
    return jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sharding, manual_axis_type=mat),
        out_shape,
    )


def converted_for_blocks(project, rows, n: int):
    """``jax.closure_convert(project, ...)`` for blocks of ``n`` rows of each ``[B, S, ...]``
    array of ``rows``, the blocks typed as their arrays vary (inside a ``shard_map`` with
    ``check_vma`` the converted function then takes the rows it is given).

    **Returns:** ``(converted, consts)``, as ``jax.closure_convert``.
    """
    block = [typed(jax.ShapeDtypeStruct((r.shape[0], n, *r.shape[2:]), r.dtype), r) for r in rows]
    return jax.closure_convert(project, *block)


def launch(build, mode: Interpret, out_shape, args, name: str):
    """``build(mode, out_shape)(*args)``: a ``pallas_call`` built for ``mode`` (as
    ``kernel_interpret`` decides it) and the kernel's ``out_shape``, its outputs typed for the
    manual axes its ``args`` vary over (``typed``). A kernel is a 32-bit program (Mosaic and
    Triton have no float64): its body is traced with ``jax_enable_x64`` off, and a 64-bit
    argument is a ``TypeError`` naming the kernel (``name``)."""
    dtypes = {jax.numpy.dtype(a.dtype) for a in jax.tree.leaves(args)}
    if not kernel_dtypes(*dtypes):
        wide = sorted(str(d) for d in dtypes if not kernel_dtypes(d))
        raise TypeError(
            f"csa_eqx's Pallas kernel {name!r} computes in 32 bits or fewer, got {wide} inputs "
            "(a float64 layer under jax_enable_x64): run the layer in float32 or bfloat16, or "
            "force the XLA strategies (DenseSelection / StreamingSelection, XlaAttention)"
        )
    varying = typed(out_shape, args)
    if mode is True and (varying is not out_shape or _sharded_axes()):
        # interpret mode under check_vma or mesh axes the compiler shards: one device's values
        def one_device(*a):
            with jax.enable_x64(False):
                return jax.tree.leaves(build(True, out_shape)(*a))

        return interpreted(one_device, varying, *args)

    def kernel_launch(*args):
        # Python scalars and loop indices in the body stay 32-bit under jax_enable_x64
        with jax.enable_x64(False):
            return build(mode, varying)(*args)

    # traced, in a jit of its own: Pallas never removes an unused pallas_call from a jaxpr (its
    # DCE rule keeps every one), a jit whose outputs are all unused goes; so where a
    # ``jax.checkpoint`` saves a kernel's outputs (the selection, compose_selection_policy)
    # the backward holds no second call of it. (Called eagerly, as it is: nothing to remove.)
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args)):
        return jax.jit(kernel_launch)(*args)
    return kernel_launch(*args)


def _sharded_axes() -> bool:
    """Whether the mesh in context has an axis of size > 1 that is not ``Manual``."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(
        t != AxisType.Manual and mesh.shape[a] > 1
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    )
