"""Small numeric primitives shared by the layers (weights kept in torch ``[out, in]`` layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = [
    "linear",
    "rms_norm",
    "init_linear",
    "upcast",
    "round_to",
    "pad_axis",
    "varying_like",
    "summed_like",
]


def linear(x: Float[Array, "*batch d_in"], weight: Float[Array, "d_out d_in"]) -> Array:
    """``x @ weight.T`` in the input's dtype (weights use torch's ``[out, in]`` layout)."""
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))


def round_to(x: Array, dtype) -> Array:
    """``x`` rounded to ``dtype`` (round-to-nearest-even) and returned in it, also under ``jit``.

    A plain ``x.astype(dtype)`` whose result is upcast again is not a rounding XLA must keep:
    fused into a reduction or an elementwise chain it may be removed (CPU's bf16 normalisation
    keeps the float32 value, ~27 % of a normed latent one bf16 step off in a test); the
    rounding DeepSeek's code performs has to happen whatever follows. ``reduce_precision`` is
    never removed, and the cast after it is then exact.

    **Arguments:** ``x`` (floating) and a floating ``dtype`` with IEEE semantics (bfloat16,
    float16, float32, float64: what ``lax.reduce_precision`` models; the FP8 / FP4 formats
    round through ``csa_eqx._numerics.formats``).

    **Returns:** ``x`` rounded, in ``dtype`` (``x`` unchanged when it is no wider).
    """
    dtype = jnp.dtype(dtype)
    if dtype not in _IEEE:
        raise ValueError(f"round_to rounds to bfloat16, float16, float32 or float64 (got {dtype})")
    if jnp.finfo(x.dtype).nmant > jnp.finfo(dtype).nmant:
        info = jnp.finfo(dtype)
        x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(dtype)


_IEEE = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))


def upcast(x: Array) -> Array:
    """``x`` in at least float32 (float64 stays float64, so x64 gradient checks are exact)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def rms_norm(x: Array, weight: Array | None, eps: float) -> Array:
    """RMSNorm over the last axis, computed in float32 and rounded back to ``x.dtype``
    (``round_to``: a bf16 norm's result is bf16 also where XLA would fuse it into what
    follows)."""
    xf = upcast(x)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(xf.dtype)
    return round_to(y, x.dtype)


def init_linear(key: Array, d_out: int, d_in: int, dtype=jnp.float32, std: float = 0.02) -> Array:
    """A ``[d_out, d_in]`` weight drawn from N(0, std²)."""
    return (std * jax.random.normal(key, (d_out, d_in))).astype(dtype)


def pad_axis(x: Array, axis: int, size: int, value=0, front: int = 0) -> Array:
    """``x`` padded with ``value`` along ``axis``: ``front`` entries before it, then to ``size``
    in all (``x`` itself when nothing is padded)."""
    if x.shape[axis] == size and not front:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (front, size - front - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def varying_like(x, *likes):
    """``x`` typed as the data it will meet: a loop carry or buffer built from constants must
    vary over every manual mesh axis any of ``likes`` (arrays or pytrees) varies over, inside a
    ``shard_map`` with ``check_vma`` (JAX's default), and, under ``jit`` with ``Explicit`` mesh
    axes, have its leading (batch) axis sharded as the first of ``likes`` whose leading axis
    is sharded and as long (a select or update of a sharded row by a replicated one is a
    sharding type error). Unchanged outside both.

    **Arguments:** the array (or pytree of arrays) ``x`` and the arrays whose types it takes.

    **Returns:** ``x``, so typed (no data moves but the leading axis' split).
    """
    leaves = jax.tree.leaves(likes)
    axes = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in leaves))
    leads = [
        (a.shape[0], spec[0])
        for a in leaves
        if jnp.ndim(a) and (spec := jax.typeof(a).sharding.spec) and spec[0] is not None
    ]

    def cast(a):
        missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying))
        a = jax.lax.pcast(a, missing, to="varying") if missing else a
        lead = next((axis for size, axis in leads if a.ndim and a.shape[0] == size), None)
        if lead is not None and (jax.typeof(a).sharding.spec or (None,))[0] is None:
            a = jax.reshard(a, jax.P(lead))
        return a

    return jax.tree.map(cast, x)


def summed_like(cotangents, primals):
    """Each cotangent summed over the manual mesh axes it varies over and its primal does not:
    a ``custom_vjp``'s backward under a ``shard_map`` with ``check_vma`` owes an input used on
    every device (e.g. replicated sinks) the sum of the devices' cotangents, as JAX's own
    transpose of the implicit broadcast gives it (unchanged outside one).

    **Arguments:** the ``cotangents`` and the ``primals`` (pytrees of one structure; ``None``
    cotangents kept).

    **Returns:** the cotangents, each typed as its primal varies.
    """

    def one(ct, primal):
        if ct is None:
            return None
        extra = jax.typeof(ct).manual_axis_type.varying
        extra = tuple(sorted(extra - jax.typeof(primal).manual_axis_type.varying))
        return jax.lax.psum(ct, extra) if extra else ct

    return jax.tree.map(one, cotangents, primals, is_leaf=lambda x: x is None)
