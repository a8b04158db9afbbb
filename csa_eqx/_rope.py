"""Rotary position embeddings with explicit positions.

Two channel layouts are used by the DeepSeek family: *interleaved* pairs ``(x0,x1),(x2,x3)…``
(V4 everywhere, V3.2 MLA) and *half-split* pairs ``(x_i, x_{i+r/2})`` (V3.2 indexer). Tables
are computed in numpy at trace time and the rotation runs in (at least) float32, its result
rounded to the input's dtype (``round_to``). The interleaved pairs' swap is a reversed size-2
axis, on a TPU a matmul with the 0/1 pair permutation (``swap_pairs_mxu``), chosen when the
program is lowered.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._config import YaRNScaling
from ._ops import round_to, upcast

__all__ = [
    "Rope",
    "rope_inv_freq",
    "yarn_mscale",
    "yarn_attention_factor",
    "yarn_table",
    "apply_rope_interleaved",
    "apply_rope_half_split",
]


def rope_inv_freq(rope_dim: int, theta: float, scaling: YaRNScaling | None = None) -> np.ndarray:
    """Inverse frequencies ``[rope_dim // 2]`` (default RoPE, or YaRN-scaled when given)."""
    base = theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    inv_freq = 1.0 / base
    if scaling is None:
        return inv_freq.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp  # 1 = extrapolate (high frequency), 0 = interpolate
    scaled = inv_freq / scaling.factor * ramp + inv_freq * keep
    return scaled.astype(np.float32)


class Rope(NamedTuple):
    """A RoPE table, as a module's static field holds it.

    **Arguments:** the rotated channels ``dim``, the base ``theta`` and the YaRN ``scaling``
    (``None``: plain RoPE).
    """

    dim: int
    theta: float
    scaling: YaRNScaling | None = None

    def inv_freq(self) -> np.ndarray:
        """**Returns:** the inverse frequencies ``[dim // 2]`` (``rope_inv_freq``)."""
        return rope_inv_freq(self.dim, self.theta, self.scaling)

    def interleaved(self, x: Array, positions: Array) -> Array:
        """**Arguments:** ``x [..., d]`` and integer ``positions`` broadcastable to ``x[..., 0]``.

        **Returns:** ``x`` with its last ``dim`` channels rotated (``apply_rope_interleaved``)."""
        return apply_rope_interleaved(x, positions, self.inv_freq())


def yarn_mscale(scaling: YaRNScaling | None) -> float:
    """YaRN's softmax magnitude factor ``0.1·mscale_all_dim·ln(factor) + 1`` (V3.2); 1 if off."""
    if scaling is None or scaling.factor <= 1 or not scaling.mscale_all_dim:
        return 1.0
    return 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0


def _cos_sin(positions: Int[Array, "*pos"], inv_freq: np.ndarray, dtype):
    angles = positions.astype(dtype)[..., None] * jnp.asarray(inv_freq, dtype)
    return jnp.cos(angles), jnp.sin(angles)


def yarn_attention_factor(scaling: YaRNScaling | None) -> float:
    """YaRN's magnitude factor on the rotated channels (HF folds it into cos/sin; V3.2); 1 if
    off."""
    if scaling is None or scaling.factor <= 1:
        return 1.0

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale(1.0)


def yarn_table(rope_dim: int, theta: float, scaling: YaRNScaling | None):
    """**Returns:** ``(inverse frequencies, magnitude factor)`` of V3.2's RoPE (its MLA's and
    its indexer's): ``rope_inv_freq`` and ``yarn_attention_factor``."""
    return rope_inv_freq(rope_dim, theta, scaling), yarn_attention_factor(scaling)


def apply_rope_interleaved(
    x: Float[Array, "*batch dim"],
    positions: Int[Array, "*#batch"],
    inv_freq: np.ndarray,
) -> Float[Array, "*batch dim"]:
    """Rotate the **last** ``2·len(inv_freq)`` channels of ``x`` as interleaved pairs.

    ``positions`` broadcasts against ``x.shape[:-1]`` (pass ``positions[..., None]`` for a
    head axis). Negative positions rotate backwards (V4's output de-rotation).

    Only the rotated channels are computed (in float32, rounded back to ``x``'s dtype, as
    DeepSeek's code does); the others pass through unchanged, so no float32 copy of the whole
    ``x`` is made, forward or backward (on a TPU that copy of V4's ``[B, S, H, 512]`` queries,
    of which 64 channels rotate, was the larger cost). The rotated channels are concatenated
    after the others: written over ``x``'s in place instead (``x.at[..., -r:].set``), XLA
    copied less (V4-Flash CSA's fwd+bwd at 32k, compiled for a TPU: 97.3 GiB accessed, not
    108.1) but the CPU's compiled decode steps of the layer then parted from its full forward
    (docs/memory.md). Each pair's partner comes from ``swap_pairs_mxu`` where the program is
    lowered for a TPU, from a reversed size-2 axis elsewhere (``jax.lax.platform_dependent``):
    the same values.
    """
    r, d = 2 * inv_freq.shape[0], x.shape[-1]
    if (d - r) % 2:
        raise ValueError(f"interleaved RoPE of {r} of {d} channels: {d - r} unrotated is odd")
    if r < d:
        tail = apply_rope_interleaved(x[..., d - r :], positions, inv_freq)
        return jnp.concatenate([x[..., : d - r], tail], axis=-1)
    xf = upcast(x)
    cos, sin = _cos_sin(positions, np.repeat(inv_freq, 2), xf.dtype)
    sin = sin * jnp.asarray(np.tile([-1.0, 1.0], r // 2), xf.dtype)  # -sin / +sin in each pair
    swapped = jax.lax.platform_dependent(  # pairs (b, a)
        xf, tpu=functools.partial(swap_pairs_mxu, exact_in=x.dtype), default=_swap_pairs
    )
    return round_to(xf * cos + swapped * sin, x.dtype)


def _swap_pairs(x: Array) -> Array:
    """``x`` with each interleaved pair of its last axis swapped, as a reversed size-2 axis."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)[..., ::-1].reshape(x.shape)


def _pair_permutation(d: int, dtype) -> Array:
    """The ``[d, d]`` 0/1 matrix ``P[j ^ 1, j] = 1``: ``x @ P`` swaps each pair of ``x``."""
    j = np.arange(d)
    return jnp.asarray((j[:, None] ^ 1) == j[None, :], dtype)


def _swap_exactly(x: Array) -> Array:
    """``x @ P`` at ``HIGHEST`` precision: every float32 (or float64) value passes exactly."""
    return jnp.matmul(x, _pair_permutation(x.shape[-1], x.dtype), precision="highest")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def swap_pairs_mxu(xf: Float[Array, "*batch dim"], exact_in) -> Float[Array, "*batch dim"]:
    """``xf`` with each interleaved pair of its last axis swapped, by a matmul with the 0/1 pair
    permutation (``P[j ^ 1, j] = 1``): the TPU's form of ``_swap_pairs``.

    A TPU tiles an array's last two axes; reversing a size-2 last axis made XLA transpose the
    whole float32 tensor to and from a layout that has one (measured: several 248 MiB copies per
    7936 indexer query rows, docs/kernels.md), where a matmul on the MXU reads and writes the
    array once in its own layout. Every value passes exactly (one product by 1, the others by
    0), so the result is bitwise the reversed axis's, but for two things: a ``-0.0`` may come
    out ``+0.0``, and a non-finite channel makes its whole vector along the last axis NaN
    (``inf · 0``), not only its pair: the vector of one token and head, which a non-finite
    input already spoils (non-finite values stay inside their token's document, DESIGN.md).

    **Arguments:** float32 (or float64) ``xf [..., d]`` and ``exact_in``: a dtype that holds
    every value of ``xf`` (the dtype it was upcast from). Where that is bfloat16 the forward is
    one bf16 MXU pass (exact: a bf16 value times 1, accumulated in float32); otherwise, and for
    the float32 cotangent, the matmul runs at ``HIGHEST`` precision (exact for float32's
    normal values).

    **Returns:** the swapped ``xf`` (its dtype and shape).
    """
    if jnp.dtype(exact_in) != jnp.bfloat16:
        return _swap_exactly(xf)
    pairs = _pair_permutation(xf.shape[-1], jnp.bfloat16)
    return jnp.matmul(xf.astype(jnp.bfloat16), pairs, preferred_element_type=xf.dtype)


def _swap_pairs_fwd(xf, exact_in):
    return swap_pairs_mxu(xf, exact_in), None


def _swap_pairs_bwd(exact_in, _, cotangent):
    return (_swap_exactly(cotangent),)  # the permutation is its own transpose


swap_pairs_mxu.defvjp(_swap_pairs_fwd, _swap_pairs_bwd)


def apply_rope_half_split(
    x: Float[Array, "*batch dim"],
    positions: Int[Array, "*#batch"],
    inv_freq: np.ndarray,
) -> Float[Array, "*batch dim"]:
    """Rotate the **first** ``2·len(inv_freq)`` channels of ``x`` as half-split pairs."""
    half = inv_freq.shape[0]
    rot = upcast(x[..., : 2 * half])
    cos, sin = _cos_sin(positions, inv_freq, rot.dtype)
    a, b = rot[..., :half], rot[..., half:]
    out = round_to(jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1), x.dtype)
    return jnp.concatenate([out, x[..., 2 * half :]], axis=-1)
