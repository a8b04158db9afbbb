"""DeepSeek's FP8 projections (``csa_eqx._fp8_linear``) and the numerics' ``linear`` seam
against a numpy reference of DeepSeek's ``act_quant`` + ``fp8_gemm`` arithmetic.

The reference quantises the activations as ``kernel.act_quant`` (numpy's exact division,
``np.frexp`` power-of-two scales), then follows ``fp8_gemm_kernel``: per tile of input columns,
the sum of the FP8 products (exact in float64: each product has at most 8 significant bits),
times the activation's scale times the weight tile's scale, added to a float32 accumulator.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import csa_eqx as ce
from csa_eqx._numerics.fp8_linear import fp8_linear, fp8_product

E4M3 = ml_dtypes.float8_e4m3fn


def _weight(out, inp, block, seed):
    """A random ``Fp8Weight`` quantised as DeepSeek's checkpoints are (power-of-two scale per
    tile), with ragged edge tiles when ``out`` is not a multiple of the tile."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(out, inp)) * rng.choice([1e-3, 1e-1, 3.0], (out, 1))
    grid = (-(-out // block), -(-inp // block))
    scale = np.zeros(grid, np.float32)
    values = np.zeros((out, inp), np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = 2.0 ** np.ceil(np.log2(np.abs(tile).max() / 448))
            scale[i, j] = s
            values[i * block : (i + 1) * block, j * block : (j + 1) * block] = tile / s
    q = values.astype(E4M3)
    return ce.Fp8Weight(jnp.asarray(q), jnp.asarray(scale), (block, block)), q, scale


def _act_quant(x, block, pow2):
    """``act_quant`` in numpy: (FP8 values as float64, float32 scales ``[..., nb]``)."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(1e-4))
    scaled = (amax * np.float32(1 / 448)).astype(np.float32)
    if pow2:
        m, e = np.frexp(scaled.astype(np.float64))
        scaled = np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(np.float32)
    q = np.clip(xb / scaled, -448, 448).astype(E4M3).astype(np.float64)
    return q.reshape(x.shape), scaled[..., 0]


def _gemm(q, q_scale, values, scale, block):
    """``fp8_gemm_kernel``'s arithmetic: float32 ``[M, out]``."""
    out, inp = values.shape
    a = q.reshape(-1, inp)
    w = values.astype(np.float64)
    w_scale = np.repeat(scale, block, axis=0)[:out]  # [out, tiles]
    acc = np.zeros((a.shape[0], out), np.float32)
    for k in range(inp // block):
        cols = slice(k * block, (k + 1) * block)
        part = (a[:, cols] @ w[:, cols].T).astype(np.float32)  # exact sums, then float32
        tile_scale = (q_scale.reshape(-1, inp // block)[:, k, None] * w_scale[None, :, k]).astype(
            np.float32
        )
        acc = (acc + (part * tile_scale).astype(np.float32)).astype(np.float32)
    return acc


@pytest.mark.parametrize("block, out, inp", [(128, 200, 256), (32, 72, 96)])
def test_fp8_product_is_deepseeks_gemm(block, out, inp):
    """The FP8 x FP8 product with both block scales equals the kernel's arithmetic to float32
    rounding of its tile sums (here exact); ragged output tiles; V4.1's 32-tiles."""
    weight, values, scale = _weight(out, inp, block, block + out)
    x = np.random.default_rng(1).standard_t(3, size=(2, 5, inp)).astype(ml_dtypes.bfloat16)
    q, q_scale = _act_quant(x.astype(np.float32), block, True)
    want = _gemm(q, q_scale, values, scale, block).reshape(2, 5, out)
    got = jax.jit(fp8_product)(jnp.asarray(q.astype(E4M3)), jnp.asarray(q_scale), weight)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-30)
    assert (np.asarray(got) == want).mean() > 0.99


@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_linear_quantises_the_input_and_rounds_to_bf16(pow2):
    """``fp8_linear`` = ``act_quant`` (power-of-two or ``amax / 448`` scales) + the product,
    rounded to bf16: bit for bit the reference on almost every output, within one bf16 step on
    the rest; eager and jitted alike."""
    weight, values, scale = _weight(136, 256, 128, 3)
    x = (np.random.default_rng(2).normal(size=(3, 7, 256)) * 5).astype(ml_dtypes.bfloat16)
    q, q_scale = _act_quant(x.astype(np.float32), 128, pow2)
    want = _gemm(q, q_scale, values, scale, 128).reshape(3, 7, 136)
    eager = fp8_linear(jnp.asarray(x), weight, pow2)
    jitted = jax.jit(fp8_linear, static_argnums=2)(jnp.asarray(x), weight, pow2)
    assert eager.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
    got = np.asarray(eager, np.float32)
    rounded = want.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert (got == rounded).mean() > 0.99
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)


def test_fp8_linear_trains_straight_through():
    """The gradient reaches the input as through ``x · dequantize(W)ᵀ``; the FP8 weight gets
    none."""
    weight, _, _ = _weight(64, 128, 128, 4)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 128)), jnp.bfloat16)
    g = np.random.default_rng(6).normal(size=(4, 64)).astype(ml_dtypes.bfloat16)

    def loss(x, weight):
        return jnp.sum(fp8_linear(x, weight, True) * g)

    dx, dw = jax.grad(loss, argnums=(0, 1))(x, weight)
    want = g.astype(np.float32) @ np.asarray(weight.dequantize())
    np.testing.assert_array_equal(
        np.asarray(dx, np.float32), want.astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    assert not np.asarray(dw.values.astype(jnp.float32)).any() and not np.asarray(dw.scale).any()


def test_fp8_weight_checks_and_dequantizes():
    weight, values, scale = _weight(200, 256, 128, 7)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200]
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), values.astype(np.float32) * full)
    assert weight.shape == (200, 256)
    with pytest.raises(ValueError, match=r"scale has shape \(1, 2\), expected \(2, 2\)"):
        ce.Fp8Weight(weight.values, weight.scale[:1], (128, 128))
    with pytest.raises((TypeError, ValueError)):  # jaxtyping's check, or the module's own
        ce.Fp8Weight(weight.values.astype(jnp.float32), weight.scale, (128, 128))


def test_numerics_linear_seam():
    """``ExactNumerics.linear`` multiplies by the dequantised FP8 weight in the input's dtype;
    ``DeepSeekInference.linear`` runs DeepSeek's FP8 product for an ``Fp8Weight`` and the bf16
    product, rounded to bf16 under ``jit`` too, otherwise."""
    weight, _, _ = _weight(64, 128, 128, 8)
    x = jnp.asarray(np.random.default_rng(9).normal(size=(2, 3, 128)), jnp.float32)
    exact = ce.ExactNumerics().linear(x, weight)
    np.testing.assert_allclose(
        np.asarray(exact), np.asarray(x) @ np.asarray(weight.dequantize()).T, rtol=1e-5
    )
    deepseek = ce.DeepSeekInference()
    np.testing.assert_array_equal(
        np.asarray(jax.jit(deepseek.linear)(x, weight)), np.asarray(fp8_linear(x, weight, True))
    )
    plain = weight.dequantize()
    xb = x.astype(jnp.bfloat16)
    got = jax.jit(lambda x, w: deepseek.linear(x, w).astype(jnp.float32))(xb, plain)
    want = (np.asarray(xb, np.float32) @ np.asarray(plain).T).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))
    assert deepseek.linear(x, plain).dtype == jnp.float32  # DeepSeek's float32 projections
