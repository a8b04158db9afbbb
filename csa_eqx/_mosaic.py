"""What every Mosaic (Pallas TPU) kernel shares (``_attention/mosaic*.py``,
``_selection/mosaic_topk.py``; docs/kernels.md): how one is run (``run_mosaic``), a vreg's
``LANES``, rounding sizes up to Mosaic's tiles and the in-kernel dots, whose precision is always
explicit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._backend import Interpret, kernel_interpret
from ._dispatch import launch

__all__ = [
    "LANES",
    "MIN_QUERY_BLOCK",
    "MOSAIC_REFUSED",
    "run_mosaic",
    "round_up",
    "precision",
    "dot",
    "dot_nt",
]

LANES = 128  # a vreg's lanes: the last dimension of Mosaic's (8, 128) tiles
MIN_QUERY_BLOCK = 16  # Mosaic's sublane tile for bf16 (8 for float32): the smallest TPU block
MOSAIC_REFUSED = (
    "csa_eqx's Pallas kernel {name!r} is a Mosaic (TPU) kernel and runs only on a TPU (and "
    "interpreted on the CPU): the automatic choices take it on a TPU only; force another "
    "strategy here (docs/kernels.md)."
)


def run_mosaic(
    name: str,
    build,
    out_shape,
    *args,
    interpret: Interpret,
    tpu_refusal: str | None = None,
):
    """Run a Mosaic TPU kernel: ``build(mode, out_shape)(*args)`` (a ``pallas_call``), with
    ``mode`` what ``kernel_interpret`` decides for the TPU: ``False`` (compiled by Mosaic),
    ``True`` (Pallas' interpret mode) or a ``pltpu.InterpretParams``.

    **Arguments:** the kernel's ``name``, ``build``, its ``out_shape`` (``ShapeDtypeStruct``
    pytree), its ``args``, the strategy's ``interpret`` field and ``tpu_refusal``: a message to
    refuse compiling with (a configuration the chip cannot run, e.g. blocks below Mosaic's
    tiles, which the interpreters still run).

    **Returns:** the kernel's outputs; a ``NotImplementedError`` where the kernel cannot run.
    """
    mode = kernel_interpret(interpret, "tpu", MOSAIC_REFUSED.format(name=name))
    if mode is False and tpu_refusal is not None:
        raise NotImplementedError(tpu_refusal)
    return launch(build, mode, out_shape, args, name)


def round_up(n: int, multiple: int) -> int:
    """**Returns:** the least multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


def precision(dtype) -> jax.lax.Precision:
    """An in-kernel dot's precision for operands of ``dtype``, always explicit: ``HIGHEST`` for
    float32, ``DEFAULT`` for bfloat16. Left as ``None`` it would follow
    ``jax.default_matmul_precision``, and under ``"highest"`` Mosaic refuses a bfloat16 dot
    (``Bad lhs type``: an fp32 contraction asked of bf16 operands, seen on a TPU v5e)."""
    return (
        jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
    )


def dot_nt(a, b, precision):
    """``a [m, k] . b [n, k]^T`` in float32."""
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def dot(a, b, precision):
    """``a [m, k] . b [k, n]`` in float32."""
    dims = (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)
