"""DeepSeek's FP8 projections: an FP8 weight as its checkpoint stores it, and the product
DeepSeek's ``linear`` computes with it (``inference/model.py`` + ``kernel.py``: ``act_quant``
then ``fp8_gemm``; docs/numerics.md, "FP8 checkpoints").

A layer holds a projection whose checkpoint tensor is FP8 as an ``Fp8Weight``
(``csa_eqx._numerics.fp8_weight``): the E4M3 values and their block scales, one byte a weight as
released. ``ExactNumerics`` multiplies by
its dequantisation; ``DeepSeekInference`` quantises the input as ``act_quant`` does and runs
``fp8_product``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float8e4m3fn

from .._ops import round_to, varying_like
from .formats import act_quant
from .fp8_weight import Fp8Weight

__all__ = ["fp8_product", "fp8_linear"]


def fp8_product(
    q: Float8e4m3fn[Array, "*batch d_in"],
    q_scale: Float[Array, "*batch in_blocks"],
    weight: Fp8Weight,
) -> Float[Array, "*batch d_out"]:
    """DeepSeek's ``fp8_gemm``: ``q · weightᵀ`` of FP8 activations and an FP8 weight with both
    block scales, in float32.

    As its kernel: for each tile of ``block[1]`` input columns in order, the FP8 products are
    summed in float32, multiplied by the activation's scale times the weight tile's scale
    (a float32 product) and added to a float32 accumulator. The sum within a tile is XLA's
    (exact products, float32 additions; the tensor cores' order is not modelled).

    **Arguments:**

    - ``q``, ``q_scale``: the activations as ``act_quant`` returns them, quantised in blocks of
        ``weight.block[1]`` (``d_in`` a multiple of it).
    - ``weight``: the ``Fp8Weight`` ``[d_out, d_in]``.

    **Returns:** float32 ``[..., d_out]`` (DeepSeek rounds it to bf16).
    """
    *lead, d_in = q.shape
    rows, cols = weight.block
    out = weight.shape[0]
    if weight.shape[1] != d_in or d_in % cols:
        raise ValueError(
            f"fp8_product: {d_in} input columns for a {weight.shape} weight in {cols}-column tiles"
        )
    tiles = d_in // cols
    xs = (
        jnp.moveaxis(q.reshape(-1, tiles, cols), 1, 0),  # [tiles, M, cols]
        jnp.moveaxis(weight.values.reshape(out, tiles, cols), 1, 0),  # [tiles, out, cols]
        q_scale.reshape(-1, tiles).astype(jnp.float32).T,  # [tiles, M]
        jnp.repeat(weight.scale.astype(jnp.float32), rows, axis=0)[:out].T,  # [tiles, out]
    )

    def tile(acc, args):
        a, w, a_scale, w_scale = args
        part = jnp.dot(
            a.astype(jnp.float32), w.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST
        )
        return acc + part * (a_scale[:, None] * w_scale[None, :]), None

    acc = varying_like(jnp.zeros((xs[0].shape[1], out), jnp.float32), xs)
    acc, _ = jax.lax.scan(tile, acc, xs)
    return acc.reshape(*lead, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_linear(x, weight, pow2):
    q, scale = act_quant(x, weight.block[1], pow2)
    return round_to(fp8_product(q, scale, weight), jnp.bfloat16)


def _fp8_linear_fwd(x, weight, pow2):
    return _fp8_linear(x, weight, pow2), weight


def _fp8_linear_bwd(pow2, weight, g):
    dx = jnp.einsum("...o,oi->...i", g.astype(jnp.float32), weight.dequantize())
    return dx.astype(jnp.bfloat16), jax.tree.map(jnp.zeros_like, weight)


_fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


def fp8_linear(
    x: Float[Array, "*batch d_in"], weight: Fp8Weight, pow2: bool
) -> Float[Array, "*batch d_out"]:
    """DeepSeek's ``linear`` on an FP8 weight: ``act_quant(x)`` in blocks of the weight's
    column tile, ``fp8_product``, the result rounded to bf16.

    Training passes straight through the quantisation: the gradient with respect to ``x`` is
    that of ``x · dequantize(weight)ᵀ``; the weight's is zero (an ``Fp8Weight`` is frozen).

    **Arguments:** the activations ``x`` (DeepSeek quantises bf16 ones), the ``Fp8Weight`` and
    whether activation scales are powers of two (``scale_fmt`` set).

    **Returns:** bf16 ``[..., d_out]``.
    """
    return _fp8_linear(round_to(x, jnp.bfloat16), weight, pow2)
