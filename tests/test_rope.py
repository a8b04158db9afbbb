"""Interleaved RoPE: the rotation and its cotangent against a numpy reference, and its TPU
form of the pair swap (a matmul with the 0/1 pair permutation, ``swap_pairs_mxu``) bitwise
equal to the reversed size-2 axis the other platforms take, values and gradients, run here on
the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import tpu_lowering

from csa_eqx._ops import upcast
from csa_eqx._rope import _swap_pairs, apply_rope_interleaved, rope_inv_freq, swap_pairs_mxu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _inputs(dtype, shape=(2, 5, 3, 40)):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * 4
    x = x.at[0, 0, 0, :4].set(jnp.array([0.0, -0.0, 3e4, -1e-30]))  # zeros, large, tiny
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotation_matches_numpy(dtype):
    """The last 32 of 40 channels rotate as complex numbers ``(x0 + i x1) e^{i p f}``; the
    first 8 pass unchanged."""
    x = _inputs(dtype)
    positions = jnp.arange(5)[None, :, None] * 37 - 20  # negative ones rotate backwards
    inv_freq = rope_inv_freq(32, 10000.0)
    got = np.asarray(apply_rope_interleaved(x, positions, inv_freq).astype(jnp.float32))
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    angle = np.asarray(positions, np.float64)[..., None] * inv_freq.astype(np.float64)
    pairs = (xs[..., 8::2] + 1j * xs[..., 9::2]) * np.exp(1j * angle)
    want = xs.copy()
    want[..., 8::2], want[..., 9::2] = pairs.real, pairs.imag
    tol = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)
    np.testing.assert_array_equal(got[..., :8], xs[..., :8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cotangent_rotates_backwards(dtype):
    """The partial rotation's cotangent (its last 32 channels rotated at ``-positions``, the
    first 8 passed through) against numpy's transposed rotation."""
    x, w = _inputs(dtype), _inputs(dtype)[::-1] * 0.5
    positions = jnp.arange(5)[None, :, None] * 37 - 20
    inv_freq = rope_inv_freq(32, 10000.0)
    _, vjp = jax.vjp(lambda x: apply_rope_interleaved(x, positions, inv_freq), x)
    (got,) = vjp(w)
    ws = np.asarray(w.astype(jnp.float32), np.float64)
    angle = np.asarray(positions, np.float64)[..., None] * inv_freq.astype(np.float64)
    pairs = (ws[..., 8::2] + 1j * ws[..., 9::2]) * np.exp(-1j * angle)
    want = ws.copy()
    want[..., 8::2], want[..., 9::2] = pairs.real, pairs.imag
    tol = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
    got = np.asarray(got.astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)
    np.testing.assert_array_equal(got[..., :8], ws[..., :8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxu_swap_is_the_reversed_axis_bitwise(dtype):
    """Values (each pair's channels exchanged, against numpy's slicing too), and the input's
    cotangent where the swap and a second use of the same upcast meet (as in the rotation: in
    float32, rounded to the input's dtype once). Sums only: how a compiler contracts the
    rotation's products into FMAs is not the swap's business."""
    x = _inputs(dtype)

    def both(swap):
        def f(x):
            xf = upcast(x)
            return xf, swap(xf)

        return jax.jit(f)

    got, got_vjp = jax.vjp(both(lambda xf: swap_pairs_mxu(xf, x.dtype)), x)
    want, want_vjp = jax.vjp(both(_swap_pairs), x)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    xs, swapped = np.asarray(got[0]), np.asarray(got[1])
    np.testing.assert_array_equal(swapped[..., 0::2], xs[..., 1::2])
    np.testing.assert_array_equal(swapped[..., 1::2], xs[..., 0::2])
    ct = tuple(jax.random.normal(jax.random.key(i), x.shape) * 1e3 for i in (1, 2))
    np.testing.assert_array_equal(
        np.asarray(got_vjp(ct)[0].astype(jnp.float32)),
        np.asarray(want_vjp(ct)[0].astype(jnp.float32)),
    )


def test_mxu_swap_keeps_a_non_finite_value_in_its_vector():
    """A NaN channel spoils its own vector along the last axis (``0 * NaN``), no other."""
    x = _inputs(jnp.bfloat16).at[1, 2, 1, 7].set(jnp.nan)
    swapped = np.asarray(jax.jit(lambda x: swap_pairs_mxu(upcast(x), x.dtype))(x))
    bad = np.zeros(swapped.shape[:-1], bool)
    bad[1, 2, 1] = True
    assert np.isnan(swapped[bad]).all()
    assert np.isfinite(swapped[~bad]).all()


def test_a_tpu_swaps_by_matmul_and_the_cpu_by_reversal():
    """Lowered for a TPU (forward and gradient) the rotation has a ``dot_general`` and no
    ``reverse`` (the size-2 axis TPU layouts transpose whole tensors for); for the CPU the
    reverse."""
    x = jnp.ones((1, 16, 4, 64), jnp.bfloat16)
    positions = jnp.arange(16)[None, :, None]
    inv_freq = rope_inv_freq(64, 10000.0)

    def loss(x):
        return jnp.sum(apply_rope_interleaved(x, positions, inv_freq).astype(jnp.float32))

    for fn in (loss, jax.grad(loss)):
        tpu = tpu_lowering(fn, x).as_text()
        assert "stablehlo.dot_general" in tpu and "stablehlo.reverse" not in tpu
        cpu = jax.jit(fn).lower(x).as_text()
        assert "stablehlo.reverse" in cpu and "stablehlo.dot_general" not in cpu
