"""Where a Pallas kernel runs, decided per platform when the program is lowered (docs/kernels.md):
the one mechanism the Triton kernels (``csa_eqx._pallas.run_kernel``) and the Mosaic TPU kernels
(``run_mosaic``) share.

``jax.lax.platform_dependent`` traces one branch per platform and lowers only the branch of the
platform a program is lowered for, so no module needs to ask JAX for the backend: the CPU runs
a kernel in an interpreter (where the test suite proves it), its own platform compiles it, and
any other platform meets ``refusal``, a primitive whose lowering raises a
``NotImplementedError`` naming the kernel (Pallas' own lowering would fail there on a bare
assertion, or later in the compiler).
"""

from __future__ import annotations

import jax
from jax.experimental import io_callback
from jax.experimental.pallas import tpu as pltpu
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

__all__ = ["refusal", "run_mosaic", "MOSAIC_REFUSED"]

MOSAIC_REFUSED = (
    "csa_eqx's Pallas kernel {name!r} is a Mosaic (TPU) kernel and runs only on a TPU (and "
    "interpreted on the CPU): the automatic choices take it on a TPU only; force another "
    "strategy here (docs/kernels.md)."
)

_refused_p = Primitive("csa_eqx_kernel_refused")
_refused_p.multiple_results = True
_refused_p.def_abstract_eval(lambda *args, avals, message: avals)


def _refused_lowering(ctx, *args, avals, message):
    raise NotImplementedError(message)


def _refused_batched(args, dims, *, avals, message):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    batched = tuple(a.update(shape=(size, *a.shape)) for a in avals)
    return _refused_p.bind(*args, avals=batched, message=message), [0] * len(avals)


mlir.register_lowering(_refused_p, _refused_lowering)
batching.primitive_batchers[_refused_p] = _refused_batched


def refusal(out_shape, message: str):
    """**Arguments:** a kernel's ``out_shape`` (a ``jax.ShapeDtypeStruct`` pytree) and the
    ``message`` to raise.

    **Returns:** a ``platform_dependent`` branch taking the kernel's arguments and returning
    outputs of its shapes, whose lowering raises ``NotImplementedError(message)``."""

    def branch(*args):
        flat, tree = jax.tree.flatten(out_shape)
        avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in flat)
        return jax.tree.unflatten(tree, _refused_p.bind(*args, avals=avals, message=message))

    return branch


# Pallas' TPU interpreter brackets every kernel with *ordered* IO callbacks, so the
# ``platform_dependent`` around a kernel carries that ordered effect; lowered for a TPU (whose
# branch alone is kept) it would find no token for it ("incorrect set of output tokens"). The
# TPU branch therefore passes its arguments through ``_ordered_p``, which declares the same
# effect and threads the token through unchanged: nothing at run time.
_ORDERED = tuple(jax.make_jaxpr(lambda: io_callback(lambda: None, None, ordered=True))().effects)
_ordered_p = Primitive("csa_eqx_mosaic_ordered")
_ordered_p.multiple_results = True
_ordered_p.def_effectful_abstract_eval(lambda *avals: (avals, set(_ORDERED)))


def _ordered_lowering(ctx, *args):
    ctx.set_tokens_out(ctx.tokens_in)
    return args


mlir.register_lowering(_ordered_p, _ordered_lowering)
batching.primitive_batchers[_ordered_p] = lambda args, dims: (_ordered_p.bind(*args), dims)


def run_mosaic(name: str, build, out_shape, *args, tpu_refusal: str | None = None):
    """Run a Mosaic TPU kernel: ``build(interpret)(*args)`` (a ``pallas_call``), interpreted by
    Pallas' TPU interpreter (``build(pltpu.InterpretParams())``: simulated memories, DMAs and
    semaphores, out-of-bounds reads raising) when the program is lowered for the CPU, compiled
    by Mosaic (``build(False)``) on a TPU, refused (``MOSAIC_REFUSED``) on any other platform.

    **Arguments:** the kernel's ``name``, ``build``, its ``out_shape`` (``ShapeDtypeStruct``
    pytree), its ``args`` and ``tpu_refusal``: a message to refuse the TPU with instead of
    compiling (a configuration the chip cannot run, e.g. blocks below Mosaic's tiles, which the
    interpreter still runs).

    **Returns:** the kernel's outputs."""

    def interpreted(*args):
        return build(pltpu.InterpretParams())(*args)

    def effectful(branch):  # the interpreter's ordered effect, in every other branch too
        return lambda *args: branch(*_ordered_p.bind(*args))

    refused = refusal(out_shape, MOSAIC_REFUSED.format(name=name))
    tpu = build(False) if tpu_refusal is None else refusal(out_shape, tpu_refusal)
    return jax.lax.platform_dependent(
        *args, cpu=interpreted, tpu=effectful(tpu), default=effectful(refused)
    )
