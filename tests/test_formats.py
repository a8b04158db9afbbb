"""The FP8 / FP4 round trips and the Hadamard rotation against a plain numpy reference.

The reference decodes every bit pattern of FP8 E4M3 (``fn``: no infinities, one NaN per sign)
and FP4 E2M1 by the formats' definitions, rounds to the nearest representable value with ties
to the even pattern, and applies DeepSeek's block-scale rule with ``np.frexp`` instead of the
float32 bit manipulation the library uses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa_eqx._formats import (
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    fp4_e2m1_round_trip,
    fp8_e4m3_round_trip,
    hadamard,
    pow2_scale,
)


def _decode(bits: int, exp_bits: int, man_bits: int, bias: int) -> float:
    sign = -1.0 if bits >> (exp_bits + man_bits) else 1.0
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = bits & ((1 << man_bits) - 1)
    if e == 0:  # subnormal
        return sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


def _table(exp_bits, man_bits, bias, nan_pattern=None):
    """(values, patterns) of every finite non-negative value of the format."""
    n = 1 << (exp_bits + man_bits)  # non-negative patterns
    pats = [p for p in range(n) if p != nan_pattern]
    return np.array([_decode(p, exp_bits, man_bits, bias) for p in pats]), np.array(pats)


FP8 = _table(4, 3, 7, nan_pattern=0x7F)  # E4M3fn: 0x7F is NaN, the largest value is 448
FP4 = _table(2, 1, 1)  # E2M1: 0 ... 6


def _round_to(values: np.ndarray, table) -> np.ndarray:
    """Nearest representable magnitude, ties to the even bit pattern (inputs already clamped)."""
    grid, pats = table
    mag = np.abs(values)[..., None]
    dist = np.abs(mag - grid)
    best = dist.min(-1, keepdims=True)
    tied = dist == best
    even = tied & (pats % 2 == 0)
    choice = np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))
    return np.sign(values) * grid[choice]


def _pow2_ceil(v: np.ndarray) -> np.ndarray:
    m, e = np.frexp(v.astype(np.float64))  # v = m 2^e, m in [0.5, 1)
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(np.float32)


def _reference(x, block, table, fmt_max, floor, pow2):
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(floor))
    scaled = (amax * np.float32(1.0 / fmt_max)).astype(np.float32)
    scale = _pow2_ceil(scaled) if pow2 else scaled
    q = _round_to(np.clip(xb / scale, -fmt_max, fmt_max).astype(np.float32), table)
    return (q.astype(np.float32) * scale).reshape(x.shape)


def test_tables_are_the_formats():
    assert FP8[0].max() == FP8_E4M3_MAX and len(FP8[0]) == 127
    assert FP8[0][1] == 2.0**-9  # the smallest subnormal
    np.testing.assert_array_equal(FP4[0], [0, 0.5, 1, 1.5, 2, 3, 4, 6])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_every_representable_value_round_trips_to_itself(fmt):
    """Blocks whose amax is the format's largest value (scale 1), then scaled by 2^e: every
    finite value, with both signs, comes back bit for bit."""
    grid, fmt_max = (FP8[0], FP8_E4M3_MAX) if fmt == "fp8" else (FP4[0], FP4_E2M1_MAX)
    block = len(grid)
    values = np.concatenate([grid, -grid])[None].reshape(2, block)
    values[:, -1] = fmt_max  # each block's amax
    for e in (-20, -3, 0, 5):
        x = (values * 2.0**e).astype(np.float32)
        if fmt == "fp8":
            got = fp8_e4m3_round_trip(jnp.asarray(x), block, True)
        else:
            got = fp4_e2m1_round_trip(jnp.asarray(x), block)
        np.testing.assert_array_equal(np.asarray(got), x)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_matches_the_numpy_reference(pow2, block):
    rng = np.random.default_rng(block + pow2)
    x = rng.standard_t(3, size=(6, 4 * block)) * rng.choice([1e-6, 1e-2, 1, 300], (6, 1))
    x[0, :block] = 0.0  # an all-zero block: amax floored at 1e-4
    x = x.astype(np.float32)
    want = _reference(x, block, FP8, FP8_E4M3_MAX, 1e-4, pow2)
    got = np.asarray(fp8_e4m3_round_trip(jnp.asarray(x), block, pow2))
    np.testing.assert_array_equal(got, want)


def test_fp8_midpoints_round_to_even():
    """Values exactly between two FP8 neighbours go to the even pattern (RNE)."""
    grid, pats = FP8
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([mids, [FP8_E4M3_MAX]]).astype(np.float32)  # amax 448: scale 1
    x = np.pad(x, (0, 128 - len(x) % 128 if len(x) % 128 else 0), constant_values=0)
    got = np.asarray(fp8_e4m3_round_trip(jnp.asarray(x[None]), 128, True))[0][: len(mids)]
    lo, hi = grid[:-1], grid[1:]
    want = np.where(pats[:-1] % 2 == 0, lo, hi)
    np.testing.assert_array_equal(got, want)


def test_fp4_matches_the_numpy_reference():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 4 * 32)) * rng.choice([1e-30, 1e-3, 1, 1e4], (8, 1))
    x[1, 32:64] = 0.0
    x[2, :32] = np.linspace(-6, 6, 32) * 0.999  # midpoints between the grid values
    x = x.astype(np.float32)
    want = _reference(x, 32, FP4, FP4_E2M1_MAX, 6.0 * 2.0**-126, True)
    np.testing.assert_array_equal(np.asarray(fp4_e2m1_round_trip(jnp.asarray(x), 32)), want)


def _reference_e4m3_scales(x, block):
    """FP4 E2M1 with E4M3 scales (DeepSeek-V4.1's compressed entries): the scale is
    ``amax / 6`` (``amax`` floored at ``6·2^-9``, saturated at 448) rounded to the nearest FP8
    value of the table, ties to the even pattern."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(6.0 * 2.0**-9))
    scale = _round_to(np.minimum(amax / np.float32(6.0), np.float32(448.0)), FP8)
    scale = scale.astype(np.float32)
    q = _round_to(np.clip(xb / scale, -6.0, 6.0).astype(np.float32), FP4)
    return (q.astype(np.float32) * scale).reshape(x.shape)


def test_fp4_with_e4m3_scales_round_trips_every_representable_pair():
    """Every FP4 value (both signs) times every positive finite E4M3 scale, subnormal scales
    included: a block of 16 holding the whole FP4 grid has ``amax = 6 s``, so its scale is
    ``s`` and every value comes back bit for bit."""
    grid, pats = FP8
    scales = grid[grid > 0]
    assert len(scales) == 126
    block = np.concatenate([FP4[0], -FP4[0]]).astype(np.float32)  # 16 values, amax 6
    x = (block[None, :] * scales[:, None].astype(np.float32)).astype(np.float32)
    got = np.asarray(fp4_e2m1_round_trip(jnp.asarray(x), 16, "e4m3"))
    np.testing.assert_array_equal(got, x)


def test_fp4_with_e4m3_scales_matches_the_numpy_reference():
    rng = np.random.default_rng(16)
    x = rng.standard_t(3, size=(12, 8 * 16)) * rng.choice([1e-4, 1e-2, 1, 50, 3000], (12, 1))
    x[0, :16] = 0.0  # amax floored at 6·2^-9: the smallest subnormal scale
    x[1, :16] = np.linspace(-6, 6, 16) * 2.0**-7  # an amax whose scale rounds down: clamps
    x[2, :16] = 1e5  # amax / 6 beyond 448: the scale saturates
    x = x.astype(np.float32)
    want = _reference_e4m3_scales(x, 16)
    got = np.asarray(fp4_e2m1_round_trip(jnp.asarray(x), 16, "e4m3"))
    np.testing.assert_array_equal(got, want)
    assert got[2, 0] == 6 * 448.0  # saturated: 6 x the largest scale
    scale = np.float32(np.abs(x[3, :16]).max() / 6.0)
    # not a power of two: the E4M3 scale keeps 3 mantissa bits of amax / 6
    assert np.abs(got[3, :16]).max() <= 6 * scale * 1.0625
    with pytest.raises(ValueError, match="scales must be 'e8m0' or 'e4m3'"):
        fp4_e2m1_round_trip(jnp.asarray(x), 16, "ue8m0")


def test_pow2_scale_matches_frexp():
    rng = np.random.default_rng(0)
    v = np.concatenate([np.exp(rng.uniform(-80, 80, 1000)), 2.0 ** np.arange(-120, 120)]).astype(
        np.float32
    )
    np.testing.assert_array_equal(np.asarray(pow2_scale(jnp.asarray(v))), _pow2_ceil(v))


def test_round_trips_pass_gradients_straight_through():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32))
    g8 = jax.grad(lambda x: jnp.sum(fp8_e4m3_round_trip(x, 32, True) * 3.0))(x)
    g4 = jax.grad(lambda x: jnp.sum(fp4_e2m1_round_trip(x, 32) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g8), 3.0)
    np.testing.assert_array_equal(np.asarray(g4), 3.0)


def _fwht(x: np.ndarray) -> np.ndarray:
    """The textbook in-place fast Walsh-Hadamard butterflies, then the 1/sqrt(n) scale."""
    y = x.astype(np.float64).copy()
    n, h = y.shape[-1], 1
    while h < n:
        y = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        y = y.reshape(*y.shape[:-3], n)
        h *= 2
    return y / np.sqrt(n)


def test_hadamard_is_the_orthonormal_walsh_hadamard_rotation():
    x = np.random.default_rng(2).normal(size=(2, 5, 128)).astype(np.float32)
    got = np.asarray(hadamard(jnp.asarray(x)))
    np.testing.assert_allclose(got, _fwht(x), rtol=1e-5, atol=1e-5)
    assert hadamard(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(jnp.zeros((2, 48)))
