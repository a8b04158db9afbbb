"""Walks over a jaxpr and every jaxpr nested in it (scan, while, cond, pjit, custom_vjp,
checkpoint, a Pallas kernel's body), shared by the tests that check which path was traced and
what it holds; and the lowering of a program for a GPU on this CPU-only machine."""

import jax
from jax.extend.core import jaxprs_in_params


def walk_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from walk_eqns(sub)


def walk_avals(jaxpr):
    """The abstract value of every equation output, nested jaxprs included."""
    for eqn in walk_eqns(jaxpr):
        for v in eqn.outvars:
            yield v.aval


def primitives(jaxpr) -> set[str]:
    """Names of the primitives used anywhere in ``jaxpr``."""
    return {eqn.primitive.name for eqn in walk_eqns(jaxpr)}


def loop_primitives(jaxpr) -> set[str]:
    """Names of the primitives used inside a loop (a ``while`` or ``scan``, at any depth) of
    ``jaxpr``."""
    inside = set()
    for eqn in walk_eqns(jaxpr):
        if eqn.primitive.name in ("while", "scan"):
            for sub in jaxprs_in_params(eqn.params):
                inside |= primitives(sub)
    return inside


def gpu_lowering(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)`` lowered for CUDA on an abstract H200 (no GPU
    needed): Pallas kernels go through their Triton lowering (``__gpu$xla.gpu.triton`` custom
    calls); nothing is compiled."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def tpu_lowering(fn, *args):
    """``jax.jit(fn)`` traced under an abstract TPU v5e mesh (the platform the kernels' choices
    read: ``csa_eqx._backend.target_platform``) and lowered for a TPU (no TPU needed; nothing
    is compiled): Pallas kernels go through their Mosaic lowering (``tpu_custom_call``)."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("tpu",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))


def kernel_dots(fn, *args) -> set[tuple[str, str]]:
    """``(operand dtype, precision)`` of every ``dot_general`` inside a Pallas kernel's body in
    ``jax.make_jaxpr(fn)(*args)``, traced under ``jax.default_matmul_precision("highest")``
    (where a dot left at ``precision=None`` takes ``HIGHEST``, which Mosaic refuses for
    bfloat16 operands)."""
    with jax.default_matmul_precision("highest"):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    dots = set()
    for eqn in walk_eqns(jaxpr):
        if eqn.primitive.name != "pallas_call":
            continue
        for sub in jaxprs_in_params(eqn.params):
            for dot in walk_eqns(sub):
                if dot.primitive.name == "dot_general":
                    precision = dot.params["precision"]
                    name = str(precision[0] if isinstance(precision, tuple) else precision)
                    dots.add((str(dot.invars[0].aval.dtype), name))
    return dots
