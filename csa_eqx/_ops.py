"""Small numeric primitives shared by the layers (weights kept in torch ``[out, in]`` layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["linear", "rms_norm", "init_linear", "upcast"]


def linear(x: Float[Array, "*batch d_in"], weight: Float[Array, "d_out d_in"]) -> Array:
    """``x @ weight.T`` in the input's dtype (weights use torch's ``[out, in]`` layout)."""
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def upcast(x: Array) -> Array:
    """``x`` in at least float32 (float64 stays float64, so x64 gradient checks are exact)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def rms_norm(x: Array, weight: Array | None, eps: float) -> Array:
    """RMSNorm over the last axis, computed in float32 and cast back to ``x.dtype``."""
    xf = upcast(x)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(xf.dtype)
    return y.astype(x.dtype)


def init_linear(key: Array, d_out: int, d_in: int, dtype=jnp.float32, std: float = 0.02) -> Array:
    """A ``[d_out, d_in]`` weight drawn from N(0, std²)."""
    return (std * jax.random.normal(key, (d_out, d_in))).astype(dtype)
