"""The FP8 / FP4 round trips, ``act_quant``, ``round_to`` and the Hadamard rotation against a
plain numpy reference, eager and under ``jit`` (what users run).

The reference decodes every bit pattern of FP8 E4M3 (``fn``: no infinities, one NaN per sign)
and FP4 E2M1 by the formats' definitions, rounds to the nearest representable value with ties
to the even pattern, divides with numpy's correctly rounded float32 division and applies
DeepSeek's block-scale rules with ``np.frexp`` instead of the float32 bit manipulation the
library uses. Every format and scale format is checked on quotients that land exactly on a
midpoint (ties to even), and the formats whose block scales are not powers of two on values a
few float32 steps beside a midpoint times the scale, each picked where the exact quotient and
a multiplication by the rounded reciprocal (what XLA makes of a division by a broadcast) round
to different values: on exact multiples of the scale the two mostly agree.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from csa_eqx._numerics.formats import (
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    act_quant,
    exact_divide,
    fp4_e2m1_round_trip,
    fp8_e4m3_round_trip,
    hadamard,
    pow2_scale,
)
from csa_eqx._ops import round_to


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


# format name -> (grid, largest value, amax floor, scale rule)
FORMATS = {
    "fp8_pow2": (FP8, FP8_E4M3_MAX, 1e-4, "pow2"),
    "fp8_amax": (FP8, FP8_E4M3_MAX, 1e-4, "amax"),
    "fp4_e8m0": (FP4, FP4_E2M1_MAX, 6.0 * 2.0**-126, "pow2"),
    "fp4_e4m3": (FP4, FP4_E2M1_MAX, 6.0 * 2.0**-9, "e4m3"),
}


def _reference_quant(x, block, fmt):
    """Quantised blocks ``[..., nb, block]`` (float32 grid values), scales ``[..., nb, 1]``."""
    table, fmt_max, floor, rule = FORMATS[fmt]
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(floor))
    if rule == "e4m3":  # amax / 6 rounded to the nearest E4M3 value (saturated at 448)
        scale = _round_to(np.minimum(amax / np.float32(fmt_max), np.float32(448.0)), FP8)
        scale = scale.astype(np.float32)
    else:
        scaled = (amax * np.float32(1.0 / fmt_max)).astype(np.float32)
        scale = _pow2_ceil(scaled) if rule == "pow2" else scaled
    q = _round_to(np.clip(xb / scale, -fmt_max, fmt_max).astype(np.float32), table)
    return q.astype(np.float32), scale


def _reference(x, block, fmt):
    q, scale = _reference_quant(x, block, fmt)
    return (q * scale).reshape(x.shape)


def _round_trip(fmt, x, block, mode):
    """``fmt``'s round trip of ``x`` (numpy), eager or jitted."""
    fn = {
        "fp8_pow2": lambda x: fp8_e4m3_round_trip(x, block, True),
        "fp8_amax": lambda x: fp8_e4m3_round_trip(x, block, False),
        "fp4_e8m0": lambda x: fp4_e2m1_round_trip(x, block),
        "fp4_e4m3": lambda x: fp4_e2m1_round_trip(x, block, "e4m3"),
    }[fmt]
    return np.asarray((jax.jit(fn) if mode == "jit" else fn)(jnp.asarray(x)))


MODES = ["eager", "jit"]
# jaxlib 0.10.2's CPU loop emitters (the 3.11 half of `make test` compiles with them,
# docs/testing.md, "Code generation") round these e4m3-scaled FP4 blocks otherwise than XLA's
# default emitters: `make test` runs them in the 3.12 half (tests/conftest.py)
FUSION_EMITTERS = pytest.mark.xla_fusion_emitters


def test_tables_are_the_formats():
    assert FP8[0].max() == FP8_E4M3_MAX and len(FP8[0]) == 127
    assert FP8[0][1] == 2.0**-9  # the smallest subnormal
    np.testing.assert_array_equal(FP4[0], [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    # the reference's grid is the one ml_dtypes casts to
    for (grid, _), dtype in ((FP8, ml_dtypes.float8_e4m3fn), (FP4, ml_dtypes.float4_e2m1fn)):
        np.testing.assert_array_equal(grid.astype(dtype).astype(np.float64), grid)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_every_representable_value_round_trips_to_itself(fmt, mode):
    """Blocks whose amax is the format's largest value (scale 1), then scaled by 2^e: every
    finite value, with both signs, comes back bit for bit."""
    grid, fmt_max = (FP8[0], FP8_E4M3_MAX) if fmt == "fp8" else (FP4[0], FP4_E2M1_MAX)
    block = len(grid)
    values = np.concatenate([grid, -grid])[None].reshape(2, block)
    values[:, -1] = fmt_max  # each block's amax
    name = "fp8_pow2" if fmt == "fp8" else "fp4_e8m0"
    for e in (-20, -3, 0, 5):
        x = (values * 2.0**e).astype(np.float32)
        np.testing.assert_array_equal(_round_trip(name, x, block, mode), x)


def _random_blocks(fmt, seed):
    """Heavy-tailed blocks over many magnitudes, an all-zero block (amax floored), and for the
    E4M3-scaled format a scale that rounds down (the block's largest values clamp at ±6) and a
    saturated scale."""
    block = 16 if fmt == "fp4_e4m3" else 32
    rng = np.random.default_rng(seed)
    mags = [1e-4, 1e-2, 1, 50, 3000] if fmt == "fp4_e4m3" else [1e-6, 1e-2, 1, 300]
    x = rng.standard_t(3, size=(10, 4 * block)) * rng.choice(mags, (10, 1))
    x[0, :block] = 0.0
    if fmt == "fp4_e4m3":
        x[1, :block] = np.linspace(-6, 6, block) * 2.0**-7
        x[2, :block] = 1e5
    return x.astype(np.float32), block


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "fmt", [pytest.param(f, marks=FUSION_EMITTERS) if f == "fp4_e4m3" else f for f in FORMATS]
)
def test_round_trips_match_the_numpy_reference(fmt, mode):
    x, block = _random_blocks(fmt, len(fmt))
    got = _round_trip(fmt, x, block, mode)
    np.testing.assert_array_equal(got, _reference(x, block, fmt))
    if fmt == "fp4_e4m3":
        assert got[2, 0] == 6 * 448.0  # saturated: 6 x the largest scale
        scale = np.float32(np.abs(x[3, :16]).max() / 6.0)
        # not a power of two: the E4M3 scale keeps 3 mantissa bits of amax / 6
        assert np.abs(got[3, :16]).max() <= 6 * scale * 1.0625


# per format: block scales whose quotients x / s are exact (s has few significant bits) but
# whose reciprocals are not all exact: powers of two, and 1.25 / 1.3125 / 0.46875 / 3·2^-9 ...
MIDPOINT_SCALES = {
    "fp8_pow2": [2.0**-7, 1.0, 2.0**5],
    "fp8_amax": [1.25 * 2.0**-3, 1.3125 * 2.0**4],
    "fp4_e8m0": [2.0**-10, 2.0**3],
    "fp4_e4m3": [0.46875, 1.125, 3 * 2.0**-9, 208.0],
}


def _blocks_led_by(lead, values, block: int) -> np.ndarray:
    """``values`` in blocks of ``block``, each block led by ``lead`` (zeros fill the last)."""
    body = np.zeros(-(-len(values) // (block - 1)) * (block - 1))
    body[: len(values)] = values
    return np.concatenate(
        [np.full((len(body) // (block - 1), 1), lead), body.reshape(-1, block - 1)], 1
    )


def _midpoint_blocks(fmt, scale, block):
    """Blocks holding every midpoint between neighbouring values of the grid (both signs) times
    ``scale``, each block led by ``fmt_max · scale`` so that its scale is ``scale``; and what
    round-to-nearest-even makes of them (the even bit pattern)."""
    (grid, pats), fmt_max = FORMATS[fmt][:2]
    mids = (grid[1:] + grid[:-1]) / 2
    even = np.where(pats[:-1] % 2 == 0, grid[:-1], grid[1:])
    vals, want = np.concatenate([mids, -mids]), np.concatenate([even, -even])
    x, expect = _blocks_led_by(fmt_max, vals, block), _blocks_led_by(fmt_max, want, block)
    assert np.isin(mids, np.abs(x)).all()  # every midpoint is in the blocks
    x, expect = x * scale, expect * scale
    assert np.array_equal(x.astype(np.float32), x)  # the midpoints are exact float32 values
    return x.astype(np.float32), expect.astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_midpoints_round_to_even(fmt, mode):
    """Quotients exactly halfway between two values of the format go to the even pattern, for
    every format and scale format, eager and jitted. (These values are exact multiples of
    their scale, where a multiplication by the rounded reciprocal moves only some quotients
    off the midpoint, none for the ``amax / 448`` scales here:
    ``test_quotients_beside_midpoints_are_the_exact_ones`` tells the two apart for every
    scale rule that is not a power of two.)"""
    block = 16 if fmt.startswith("fp4") else 32
    for scale in MIDPOINT_SCALES[fmt]:
        x, want = _midpoint_blocks(fmt, scale, block)
        _, scales = _reference_quant(x, block, fmt)
        assert (scales == np.float32(scale)).all()  # each block has the intended scale
        got = _round_trip(fmt, x, block, mode)
        np.testing.assert_array_equal(got, want, f"scale {scale}")
        np.testing.assert_array_equal(got, _reference(x, block, fmt))


@pytest.mark.parametrize("mode", MODES)
def test_e4m3_scales_round_to_even_at_their_midpoints(mode):
    """``amax / 6`` exactly halfway between two E4M3 values rounds to the even one. (On these
    exact multiples of 6 a multiplication by ``fl(1/6)`` gives the same scales, since
    ``6 · fl(1/6)`` is within ``2^-24`` of 1:
    ``test_e4m3_scales_beside_their_midpoints_are_exact_quotients`` tells the two apart.)"""
    grid, pats = FP8
    mids = (grid[1:] + grid[:-1]) / 2
    even = np.where(pats[:-1] % 2 == 0, grid[:-1], grid[1:])
    keep = mids >= 2.0**-9  # the amax floor is 6 · 2^-9
    x = np.zeros((int(keep.sum()), 16), np.float32)
    x[:, 0] = (6 * mids[keep]).astype(np.float32)
    assert np.array_equal(x[:, 0].astype(np.float64), 6 * mids[keep])
    _, scales = _reference_quant(x, 16, "fp4_e4m3")
    np.testing.assert_array_equal(scales[:, 0, 0], even[keep].astype(np.float32))
    got = _round_trip("fp4_e4m3", x, 16, mode)
    np.testing.assert_array_equal(got, _reference(x, 16, "fp4_e4m3"))


def _beside_midpoints(fmt, amax, block, rng):
    """Blocks led by ``amax`` (so each has the scale ``s`` that ``amax`` gives, by the
    reference) holding values a few float32 steps from ``mid · s`` for the grid's midpoints
    ``mid``: not exact multiples, picked where the exact quotient and a multiplication by the
    rounded reciprocal ``x · fl(1 / s)`` round to different values of the format."""
    (grid, pats), fmt_max = FORMATS[fmt][:2]
    lead = np.zeros((1, block), np.float32)
    lead[0, 0] = amax
    s = _reference_quant(lead, block, fmt)[1][0, 0, 0]
    mids = (grid[1:] + grid[:-1]) / 2
    near = (np.concatenate([mids, -mids]) * np.float64(s)).astype(np.float32)
    for _ in range(3):
        near = np.concatenate([near, np.nextafter(near, np.inf), np.nextafter(near, -np.inf)])
    near = np.unique(near[np.abs(near) < amax])
    exact = _round_to(np.clip(near / s, -fmt_max, fmt_max), (grid, pats))
    recip = _round_to(np.clip(near * (np.float32(1) / s), -fmt_max, fmt_max), (grid, pats))
    tells = near[exact != recip]
    assert len(tells) >= 4, (fmt, amax)
    x = _blocks_led_by(amax, rng.permutation(tells), block).astype(np.float32)
    assert np.isin(tells, x).all()
    return x, s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp8_amax", pytest.param("fp4_e4m3", marks=FUSION_EMITTERS)])
def test_quotients_beside_midpoints_are_the_exact_ones(fmt, mode):
    """Block scales that are not powers of two, values a few float32 steps from a midpoint of
    the format times the scale (not exact multiples: ``test_midpoints_round_to_even``'s are,
    and there the exact quotient and ``x · fl(1 / scale)`` agree): the round trip is the
    numpy reference's with the exact quotient, on values each picked where a quotient by the
    rounded reciprocal rounds otherwise."""
    block = 16 if fmt.startswith("fp4") else 32
    rng = np.random.default_rng(12)
    amaxes = [83.12991333007812, 3184.989990234375] if fmt == "fp8_amax" else [2.8125, 5.625]
    for amax in amaxes:
        x, s = _beside_midpoints(fmt, amax, block, rng)
        assert np.log2(s) % 1  # not a power of two
        got = _round_trip(fmt, x, block, mode)
        np.testing.assert_array_equal(got, _reference(x, block, fmt), f"amax {amax}")


@pytest.mark.parametrize("mode", MODES)
def test_e4m3_scales_beside_their_midpoints_are_exact_quotients(mode):
    """``amax`` a few float32 steps from ``6 · m`` for the E4M3 midpoints ``m`` (not exact
    multiples of 6), picked where ``amax / 6`` and ``amax · fl(1 / 6)`` round to different E4M3
    scales: the scale, hence the block, is the reference's (the exact quotient's)."""
    grid, pats = FP8
    mids = (grid[1:] + grid[:-1]) / 2
    mids = mids[(mids >= 2.0**-9) & (mids < 448)]
    base = (6 * mids).astype(np.float32)
    near = np.concatenate([base] + [np.nextafter(base, base * d) for d in (0.5, 2.0)])
    for _ in range(3):
        near = np.concatenate([near, np.nextafter(near, np.inf), np.nextafter(near, -np.inf)])
    near = np.unique(near)
    exact = _round_to(near / np.float32(6), FP8)
    recip = _round_to(near * (np.float32(1) / np.float32(6)), FP8)
    amax = near[exact != recip]
    assert len(amax) >= 4
    x = np.zeros((len(amax), 16), np.float32)
    x[:, 0] = amax
    x[:, 1:] = amax[:, None] * np.linspace(-0.9, 0.9, 15, dtype=np.float32)
    _, scales = _reference_quant(x, 16, "fp4_e4m3")
    np.testing.assert_array_equal(scales[:, 0, 0], exact[exact != recip])
    got = _round_trip("fp4_e4m3", x, 16, mode)
    np.testing.assert_array_equal(got, _reference(x, 16, "fp4_e4m3"))


@pytest.mark.parametrize("mode", MODES)
def test_the_issues_fp4_block(mode):
    """The block of issue 33: with E4M3 scale 0.46875, -0.5859375 / s = -1.25 and 1.171875 / s
    = 2.5 are midpoints that round to even (-1, 2), 2.34375 / s = 5 rounds to 4."""
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = [2.8125, -0.5859375, 1.171875, 2.34375]
    got = _round_trip("fp4_e4m3", x, 16, mode)
    np.testing.assert_array_equal(got[0, :4], [2.8125, -0.46875, 0.9375, 1.875])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pow2", [True, False])
def test_act_quant_matches_the_numpy_reference(pow2, mode):
    """``act_quant`` on bf16-representable inputs: FP8 values and scales bit for bit, including
    an all-zero block and tiny ones (amax floored at 1e-4). An unfloored block's largest value
    lands on 448 exactly with ``amax / 448`` scales, in [224, 448] with power-of-two ones,
    never past 448 (``fl(1/448) > 1/448``, so ``amax / scale <= 448``: the clamp saturates
    nothing finite)."""
    fmt = "fp8_pow2" if pow2 else "fp8_amax"
    rng = np.random.default_rng(7 + pow2)
    x = rng.standard_t(3, size=(4, 8, 256)) * rng.choice([1e-5, 1, 200], (4, 8, 1))
    x[0, 0, :128] = 0.0
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    fn = lambda x: act_quant(x.astype(jnp.bfloat16), 128, pow2)  # noqa: E731
    q, scale = (jax.jit(fn) if mode == "jit" else fn)(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    want_q, want_scale = _reference_quant(x, 128, fmt)
    np.testing.assert_array_equal(np.asarray(scale), want_scale[..., 0])
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), want_q.reshape(x.shape))
    top = np.abs(want_q).max(-1)
    unfloored = np.abs(x).reshape(4, 8, 2, 128).max(-1) > 1e-4
    assert (top <= FP8_E4M3_MAX).all() and (top[~unfloored] < 224).any()
    assert (top[unfloored] >= (448 if not pow2 else 224)).all()


@pytest.mark.parametrize("mode", MODES)
def test_exact_divide_is_correctly_rounded(mode):
    rng = np.random.default_rng(3)
    a = rng.uniform(1e-3, 1e3, (64, 32)).astype(np.float32)
    b = rng.uniform(0.1, 10, (64, 1)).astype(np.float32)
    for divisor, want in ((jnp.asarray(b), a / b), (6.0, a / np.float32(6.0))):
        fn = lambda a, d=divisor: exact_divide(a, d)  # noqa: E731
        got = np.asarray((jax.jit(fn) if mode == "jit" else fn)(jnp.asarray(a)))
        np.testing.assert_array_equal(got, want)


def test_round_to_rounds_under_jit():
    """A bf16 rounding whose result is upcast into a reduction is kept under ``jit`` (a plain
    ``astype`` pair is dropped by XLA there)."""
    x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 4096)).astype(np.float32))
    rounded = np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
    want = np.sqrt(np.mean(rounded**2, -1))
    rms = lambda x: jnp.sqrt(jnp.mean(round_to(x, jnp.bfloat16).astype(jnp.float32) ** 2, -1))  # noqa: E731
    got = jax.jit(rms)(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-7)
    assert round_to(x, jnp.bfloat16).dtype == jnp.bfloat16
    assert round_to(x.astype(jnp.bfloat16), jnp.float32).dtype == jnp.float32
    with pytest.raises(ValueError, match="round_to rounds to"):
        round_to(x, jnp.float8_e4m3fn)


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
