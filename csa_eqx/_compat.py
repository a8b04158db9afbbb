"""What differs between the supported JAX versions (``jax >= 0.10, < 0.13``), in one place.

- ``stacked_all_gather``: from JAX 0.11, the transpose of ``lax.all_gather`` (a
  ``psum_scatter``) fails to lower inside a ``shard_map`` whose mesh keeps an ``Explicit`` axis
  ("Length of sharding.spec (5) must be equal to aval's ndim (0)": its reducer's scalar keeps
  the array's sharding). There the untyped gather (in a ``shard_map`` without the
  varying-manual-axes check) gets a backward of ``psum`` and a slice instead; the typed one is
  invariant and has that backward anyway.
"""

from functools import partial

import jax
from jaxtyping import Array

_PSUM_SCATTER_LOWERS_UNDER_EXPLICIT_AXES = jax.__version_info__ < (0, 11)


def stacked_all_gather(x: Array, axis_name: str) -> Array:
    """``lax.all_gather(x, axis_name)``: ``[N, *x.shape]``, device ``i``'s ``x`` at index ``i``;
    differentiable under a mesh with ``Explicit`` axes on every supported JAX.

    Inside a ``shard_map`` with ``check_vma`` (``x`` typed as varying over the axis) the
    result is typed invariant over it (equal on every device: ``to="invarying"``, whose
    backward is the implicit broadcast's ``psum`` and this device's slice, on every version);
    untyped (a ``shard_map`` without the check) it is JAX's own gather, whose backward sums
    by itself."""
    if axis_name in jax.typeof(x).manual_axis_type.varying:
        return jax.lax.all_gather(x, axis_name, to="invarying")
    if _PSUM_SCATTER_LOWERS_UNDER_EXPLICIT_AXES:
        return jax.lax.all_gather(x, axis_name)
    return _gather_with_psum_backward(x, axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_with_psum_backward(x: Array, axis_name: str) -> Array:
    return jax.lax.all_gather(x, axis_name)


def _gather_forward(x: Array, axis_name: str) -> tuple[Array, None]:
    return jax.lax.all_gather(x, axis_name), None


def _gather_backward(axis_name: str, _, cotangent: Array) -> tuple[Array]:
    """The sum over devices of each one's cotangent of this device's slot."""
    return (jax.lax.psum(cotangent, axis_name)[jax.lax.axis_index(axis_name)],)


_gather_with_psum_backward.defvjp(_gather_forward, _gather_backward)


# --- Pallas' interpret mode inside a ``shard_map`` with ``check_vma`` ---------------------------
# JAX's HLO interpreter of a ``pallas_call`` (``interpret=True``) mixes the grid's program ids
# (unvarying) with the blocks (varying over the manual axes) when it is lowered, and the
# varying-manual-axes check refuses it ("Primitive mul requires varying manual axes to match",
# JAX 0.10 to 0.12). ``interpreted`` binds the kernel as one primitive whose outputs are typed
# as its inputs vary, and lowers the interpreter with that check off (the values are one
# device's either way): nothing else in a program changes. It is the only user of JAX's
# internal ``_check_vma`` flag, and only for interpret mode (the CPU).

from jax._src import config as _config  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax.extend.core import Primitive  # noqa: E402
from jax.interpreters import ad, batching, mlir  # noqa: E402

_interpreted_p = Primitive("csa_eqx_interpreted_kernel")
_interpreted_p.multiple_results = True
_interpreted_p.def_abstract_eval(lambda *args, fn, avals: avals)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _unvarying(aval):
    """``aval`` as one device's value: no manual axis type, no mesh (the interpreter's own
    constants have none)."""
    spec = jax.P(*([None] * len(aval.shape)))
    return aval.update(manual_axis_type=_core.empty_mat, sharding=jax.NamedSharding(_NO_MESH, spec))


def _interpreted_lowering(ctx, *args, fn, avals):
    with _config._check_vma(False), jax.sharding.use_abstract_mesh(_NO_MESH):
        ctx = ctx.replace(
            avals_in=[_unvarying(a) for a in ctx.avals_in],
            avals_out=[_unvarying(a) for a in ctx.avals_out],
        )
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _interpreted_batched(args, dims, *, fn, avals):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [
        jax.numpy.broadcast_to(a, (size, *a.shape)) if d is None else jax.numpy.moveaxis(a, d, 0)
        for a, d in zip(args, dims, strict=True)
    ]
    batched = tuple(a.update(shape=(size, *a.shape)) for a in avals)
    return _interpreted_p.bind(*args, fn=jax.vmap(fn), avals=batched), [0] * len(avals)


def _interpreted_jvp(primals, tangents, *, fn, avals):
    # the kernels' float outputs are differentiated by the custom_vjp around them; only int
    # outputs (picks) reach here, whose tangents are zero
    if any(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in avals) and any(
        type(t) is not ad.Zero for t in tangents
    ):
        raise NotImplementedError("an interpreted kernel is differentiated by its custom_vjp")
    out = _interpreted_p.bind(*primals, fn=fn, avals=avals)
    return out, [ad.Zero.from_primal_value(o) for o in out]


mlir.register_lowering(_interpreted_p, _interpreted_lowering)
batching.primitive_batchers[_interpreted_p] = _interpreted_batched
ad.primitive_jvps[_interpreted_p] = _interpreted_jvp


def interpreted(fn, out_shape, *args):
    """``fn(*args)``, a ``pallas_call`` in plain interpret mode, inside a ``shard_map`` with
    ``check_vma`` (see above).

    **Arguments:** ``fn`` (the call, its outputs a flat sequence), the ``out_shape`` pytree its
    outputs have (already ``typed`` for the manual axes) and the ``args``.

    **Returns:** ``fn``'s outputs, as ``out_shape`` lays them out.
    """
    flat, tree = jax.tree.flatten(out_shape)
    avals = tuple(jax.typeof(o) for o in flat)
    out = _interpreted_p.bind(*args, fn=lambda *a: jax.tree.leaves(fn(*a)), avals=avals)
    return jax.tree.unflatten(tree, out)
