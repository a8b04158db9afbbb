"""The low-precision formats of DeepSeek's inference kernels, as pure functions.

Each round trip quantises blocks of the last axis and dequantises them again, with the
arithmetic of DeepSeek's TileLang kernels (``inference/kernel.py``: ``act_quant``,
``fp4_act_quant``): per block, ``amax = max(max|x|, floor)``; the scale is ``amax / max``
(``amax`` times the float32 reciprocal of the format's largest value) or, for power-of-two
("ue8m0") scales, ``2^ceil(log2(amax / max))`` from the float32 bits, or, for E4M3 scales
(DeepSeek-V4.1's compressed entries), ``amax / max`` rounded to FP8 E4M3 (saturating at 448);
values are divided by the scale, clamped to ``±max``, cast to the format with
round-to-nearest-even (the clamp is the saturation), cast back to float32 and multiplied by
the scale. Results are float32; callers cast to their activation dtype. ``hadamard`` is the
orthonormal Walsh-Hadamard rotation DeepSeek applies before quantising the indexer
(``rotate_activation``; V3.2 and V4, not V4.1).

Every quotient is the correctly rounded one, eager and under ``jit``: XLA rewrites a division
by a broadcast or a constant as a multiplication by its (rounded) reciprocal, which moves
quotients that land on a rounding midpoint (``x / s == 1.25`` became ``1.2500001`` and rounded
up). A power-of-two divisor is applied as the exact power-of-two reciprocal built from its
bits; any other divisor is divided at the full shape behind an optimisation barrier, which
XLA cannot rewrite.

The round trips pass gradients straight through (the forward value is ``q(x)`` exactly, the
backward pass sees the identity), as quantisation-aware training does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .._ops import round_to

__all__ = [
    "FP8_E4M3_MAX",
    "FP4_E2M1_MAX",
    "pow2_scale",
    "exact_divide",
    "act_quant",
    "fp8_e4m3_round_trip",
    "fp4_e2m1_round_trip",
    "hadamard",
]

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
_FP8_FLOOR = 1e-4  # DeepSeek's act_quant floors amax at 1e-4


def pow2_scale(v: Float[Array, "..."]) -> Float[Array, "..."]:
    """``2^ceil(log2(v))`` of positive normal float32 ``v``, exactly as DeepSeek's
    ``fast_round_scale`` computes it from the bits (exponent, plus one unless the mantissa is
    zero)."""
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    exponent = (bits >> 23) & 0xFF
    up = ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((exponent + up) << 23, jnp.float32)


def _pow2_reciprocal(s: Array) -> Array:
    """``1 / s`` of float32 powers of two ``2^-126 <= s <= 2^126``, exactly (from the bits)."""
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jax.lax.bitcast_convert_type((254 - ((bits >> 23) & 0xFF)) << 23, jnp.float32)


def exact_divide(
    a: Float[ArrayLike, "..."], b: Float[ArrayLike, "..."] | float
) -> Float[Array, "..."]:
    """The correctly rounded float32 quotient ``a / b``, eager and under ``jit``.

    **Arguments:** ``a`` and a divisor ``b`` that broadcasts to it (an array or a number).

    **Returns:** ``a / b``, each element rounded once (XLA would multiply by ``1 / b`` were
    ``b`` a broadcast or a constant: the divisor is materialised at ``a``'s shape behind an
    optimisation barrier).
    """
    a = jnp.asarray(a, jnp.float32)
    divisor = jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape)
    return a / jax.lax.optimization_barrier(divisor)


def _blocks(x: Array, block: int) -> Array:
    *lead, n = x.shape
    if n % block:
        raise ValueError(f"the last axis ({n}) must be a multiple of the block ({block})")
    return x.astype(jnp.float32).reshape(*lead, n // block, block)


def _quantise(xb, fmt, fmt_max, amax_floor, scales, inner=None):
    """Blocks ``xb [..., nb, block]`` (float32) in ``fmt`` (or cast through ``inner``) and their
    float32 scales ``[..., nb, 1]``; ``scales``: ``"pow2"``, ``"amax"`` (``amax`` times the
    reciprocal of ``fmt_max``) or ``"e4m3"``."""
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), amax_floor)
    if scales == "e4m3":  # DeepSeek's port divides, and its cast saturates
        scaled = jnp.minimum(exact_divide(amax, fmt_max), FP8_E4M3_MAX)
        scale = scaled.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        scaled = amax * np.float32(1.0 / fmt_max)
        scale = pow2_scale(scaled) if scales == "pow2" else scaled
    quotient = xb * _pow2_reciprocal(scale) if scales == "pow2" else exact_divide(xb, scale)
    return jnp.clip(quotient, -fmt_max, fmt_max).astype(inner or fmt), scale


def _round_trip(x, block, fmt, fmt_max, amax_floor, scales, inner=None):
    """Blockwise quantise-dequantise of the last axis of ``x`` (float32 result)."""
    q, scale = _quantise(_blocks(x, block), fmt, fmt_max, amax_floor, scales, inner)
    return (q.astype(jnp.float32) * scale).reshape(x.shape)


def act_quant(
    x: Float[Array, "... n"], block: int, pow2: bool
) -> tuple[Array, Float[Array, "... blocks"]]:
    """DeepSeek's ``act_quant``: FP8 E4M3 values and float32 scales per block of ``block``
    values of the last axis (``amax`` floored at 1e-4; the scale ``amax / 448`` or its
    power-of-two ceiling; quotients clamped to ``±448``, rounded to nearest even).

    **Arguments:**

    - ``x``: values ``[..., n]`` (``n`` a multiple of ``block``; DeepSeek quantises bf16).
    - ``block``: values per scale.
    - ``pow2``: power-of-two scales (DeepSeek's ``scale_fmt="ue8m0"``), else ``amax / 448``.

    **Returns:** ``(q, scale)``: ``q`` ``float8_e4m3fn [..., n]`` and ``scale`` float32
    ``[..., n // block]``, so that ``x ≈ q · scale`` block by block.
    """
    scales = "pow2" if pow2 else "amax"
    q, scale = _quantise(_blocks(x, block), jnp.float8_e4m3fn, FP8_E4M3_MAX, _FP8_FLOOR, scales)
    return q.reshape(x.shape), scale[..., 0]


def _straight_through(fn):
    @functools.wraps(fn)
    def wrapped(x, *args, **kwargs):
        x32 = x.astype(jnp.float32)
        # x - x is exactly 0: the value is q(x) bit for bit, the gradient the identity
        return jax.lax.stop_gradient(fn(x32, *args, **kwargs)) + (x32 - jax.lax.stop_gradient(x32))

    return wrapped


@_straight_through
def fp8_e4m3_round_trip(
    x: Float[Array, "... n"], block: int, pow2: bool, *, cast_to=None
) -> Float[Array, "... n"]:
    """FP8 E4M3 blocks of ``block`` values (``act_quant`` and back; ``amax`` floored at 1e-4).

    **Arguments:**

    - ``x``: values ``[..., n]`` (``n`` a multiple of ``block``).
    - ``block``: values per scale.
    - ``pow2``: power-of-two scales (DeepSeek's ``scale_fmt="ue8m0"``), else ``amax / 448``.
    - ``cast_to``: the dtype the scaled values are cast through (default FP8 E4M3; DeepSeek-
        V4-Flash's kernel file casts its KV round trip through bfloat16 instead).

    **Returns:** float32 ``[..., n]``, the dequantised values.
    """
    scales = "pow2" if pow2 else "amax"
    return _round_trip(x, block, jnp.float8_e4m3fn, FP8_E4M3_MAX, _FP8_FLOOR, scales, cast_to)


@_straight_through
def fp4_e2m1_round_trip(
    x: Float[Array, "... n"], block: int, scales: str = "e8m0"
) -> Float[Array, "... n"]:
    """FP4 E2M1 blocks of ``block`` values (``fp4_act_quant``).

    **Arguments:**

    - ``x [..., n]`` (``n`` a multiple of ``block``) and ``block``.
    - ``scales``: ``"e8m0"``, power-of-two scales with ``amax`` floored at ``6·2^-126`` (the
        indexers of V4 and V4.1), or ``"e4m3"``, FP8 E4M3 scales ``e4m3(amax / 6)`` with
        ``amax`` floored at ``6·2^-9`` (V4.1's compressed entries, in blocks of 16; a scale
        that rounds below ``amax / 6`` clamps the block's largest values at ``±6``).

    **Returns:** float32 ``[..., n]``, the dequantised values.
    """
    if scales == "e8m0":
        return _round_trip(x, block, jnp.float4_e2m1fn, FP4_E2M1_MAX, 6.0 * 2.0**-126, "pow2")
    if scales == "e4m3":
        return _round_trip(x, block, jnp.float4_e2m1fn, FP4_E2M1_MAX, 6.0 * 2.0**-9, "e4m3")
    raise ValueError(f"scales must be 'e8m0' or 'e4m3' (got {scales!r})")


@functools.cache
def _hadamard_matrix(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h * np.float32(n**-0.5)


def hadamard(x: Float[Array, "... n"]) -> Float[Array, "... n"]:
    """The orthonormal Walsh-Hadamard rotation of the last axis (``n`` a power of two),
    computed in float32 and rounded to ``x``'s dtype, also under ``jit`` (``round_to``; DeepSeek's
    ``fast_hadamard_transform`` with scale ``n^-1/2`` returns bf16)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two last axis (got {n})")
    h = jnp.asarray(_hadamard_matrix(n))
    rotated = jnp.einsum("...i,ji->...j", x.astype(jnp.float32), h, precision="highest")
    return round_to(rotated, x.dtype)  # DeepSeek's rotation returns bf16: a rounding to keep
