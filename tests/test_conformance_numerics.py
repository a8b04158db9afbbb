"""The numerics family's conformance suite: every ``AbstractNumerics`` through the same checks,
for every layer family's formats, against numpy models of the arithmetic they claim (issue 43;
docs/testing.md, "Conformance suites"; docs/numerics.md).

``ExactNumerics`` claims the exact computation (every hook the identity, projections in the
input's dtype); ``DeepSeekInference`` claims DeepSeek's inference code, so each hook is checked
against numpy written from that code's arithmetic (the FP8 / FP4 round trips through
``test_formats``' numpy reference of the formats, decoded from their bit patterns): the
projections with an array weight (bf16 out, one rounding) and with an ``Fp8Weight``
(``act_quant`` with power-of-two or ``amax / 448`` scales, the FP8 product with both block
scales, bf16 out), the KV round trip (FP8, or through bf16 for V4-Flash), the compressed
entries, the indexer's rotation and quantisation, the per-head query norm, the softmax's
maximum and weights, and what the layers ask (score dtype, compressor dtype on both sides of
``compressor_float32_ratio``, ...); the gradients pass straight through every round trip.

Inputs tell right from wrong: non-power-of-two block scales (a power-of-two scale makes
``amax`` and power-of-two scales, or two scales applied in turn and their product, agree),
values near the FP8 grid's rounding midpoints, bf16 operands that bf16 must round. Both
released scale formats run every FP8 path (``deepseek`` is ``scale_fmt="ue8m0"``,
``deepseek-amax`` ``scale_fmt=None``).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conformance import V4_FORMATS, V32_FORMATS, V41_FORMATS, bf16, fp8_product, member_results
from test_formats import FP8, _fwht, _reference, _reference_quant

import csa_eqx as ce

# each member's results come from one program (``member_results``): its tests run in one half
# of `make test` (tests/conftest.py, ``_unit``)
DEALT_TOGETHER = ("name",)
MEMBERS = {
    "exact": ce.ExactNumerics(),
    "deepseek": ce.DeepSeekInference(),  # scale_fmt "ue8m0", V4-Flash's KV through bf16
    "deepseek-amax": ce.DeepSeekInference(scale_fmt=None),
    "deepseek-kv-fp8": ce.DeepSeekInference(kv_fp8=True),  # V4-Pro's KV through FP8
    "deepseek-v41": ce.DeepSeekV41Inference(),
}
FORMATS = {"v32": V32_FORMATS, "v4": V4_FORMATS, "v41": V41_FORMATS}
_V41_ONLY = (
    "DeepSeekV41Inference is the numerics of V4.1 layers: a V3.2 or V4 layer refuses it when "
    "built (its check raises: test_v41_numerics_refuses_other_families)"
)
# (member, formats) -> why the member never runs with those formats
EXCEPTIONS = {("deepseek-v41", "v32"): _V41_ONLY, ("deepseek-v41", "v4"): _V41_ONLY}
ROPE = 16
WIDTH = {"v32": 128 + ROPE, "v4": 128 + ROPE, "v41": 160}  # the KV round trip's blocks fit
R = np.random.default_rng(4302)
E4M3 = ml_dtypes.float8_e4m3fn


def _five_bits(n):
    """``n`` bf16 scales of five significant bits, not powers of two."""
    mantissa = R.integers(17, 32, n) / 16  # 1.0625 .. 1.9375
    return (mantissa * 2.0 ** R.integers(-6, 4, n)).astype(np.float32)


def near_midpoints(rows: int, width: int, block: int) -> np.ndarray:
    """bf16 values in blocks of ``block``: each led by ``448·c`` (``c`` not a power of two, so
    its ``amax / 448`` scale is not one either), the others the FP8 grid's midpoints times
    that scale, rounded to bf16: quotients near a rounding midpoint of the format."""
    grid = FP8[0]
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.zeros((rows, width // block, block), np.float32)
    c = _five_bits(x.shape[:2])
    scale = (448 * c) * np.float32(1 / 448)
    picks = R.choice(mids[mids > 0.05], x.shape) * R.choice([-1, 1], x.shape)
    x[...] = picks * scale[..., None]
    x[..., 0] = 448 * c
    return bf16(x.reshape(rows, width))


def cast_through_bf16(x, block, pow2):
    """V4-Flash's KV round trip: the FP8 scale, the quotient clamped and cast to bf16."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    _, scale = _reference_quant(x, block, "fp8_pow2" if pow2 else "fp8_amax")
    quotient = np.clip(xb / scale, -448, 448).astype(np.float32)
    return (bf16(quotient) * scale).reshape(x.shape)


def kv_np(numerics, kv, formats):
    """What the KV round trip of ``numerics`` gives (float32 values of the bf16 result)."""
    if isinstance(numerics, ce.ExactNumerics):
        return kv
    pow2 = numerics.scale_fmt is not None
    nope, rope = (
        (kv, kv[..., :0]) if formats.kv_channels == "all" else (kv[..., :-ROPE], kv[..., -ROPE:])
    )
    fp8 = numerics.kv_fp8 if formats.kv_fp8 is None else formats.kv_fp8
    if fp8:
        nope = _reference(nope, formats.kv_block, "fp8_pow2" if pow2 else "fp8_amax")
    else:
        nope = cast_through_bf16(nope, formats.kv_block, pow2)
    return np.concatenate([bf16(nope), rope], axis=-1)


def entries_np(numerics, entries, formats):
    if isinstance(numerics, ce.ExactNumerics) or formats.entries is None:
        return kv_np(numerics, entries, formats)
    return bf16(_reference(entries, formats.entry_block, "fp4_e4m3"))


def indexer_np(numerics, v, formats):
    if isinstance(numerics, ce.ExactNumerics):
        return v
    rotated = bf16(_fwht(v)) if formats.hadamard else v
    if formats.indexer == "fp8_e4m3":
        return _reference(
            rotated, formats.indexer_block, "fp8_pow2" if numerics.scale_fmt else "fp8_amax"
        )
    return _reference(rotated, formats.indexer_block, "fp4_e8m0")


# --- the FP8 projection: exact tile sums, so the reference's float32 steps are the product's --


def fp8_weight(out: int, inp: int, block: int):
    """An ``Fp8Weight`` of small integers (exact in E4M3) with scales that are not powers of
    two, and its numpy values and scales."""
    values = R.integers(-16, 17, (out, inp)).astype(np.float32)
    scale = R.uniform(0.01, 0.1, (-(-out // block), -(-inp // block))).astype(np.float32)
    weight = ce.Fp8Weight(jnp.asarray(values.astype(E4M3)), jnp.asarray(scale), (block, block))
    return weight, values, scale


def gemm_np(q, q_scale, values, scale, block):
    """DeepSeek's ``fp8_gemm``: per tile of input columns, in order, the tile's FP8 products
    summed (exact here: asserted), times the activation's scale times the weight tile's (one
    float32 product), added to a float32 accumulator."""
    out, inp = values.shape
    a = q.reshape(-1, inp).astype(np.float64)
    w_scale = np.repeat(scale, block, axis=0)[:out]
    acc = np.zeros((a.shape[0], out), np.float32)
    for k in range(inp // block):
        cols = slice(k * block, (k + 1) * block)
        part = a[:, cols] @ values[:, cols].T.astype(np.float64)
        assert np.array_equal(part.astype(np.float32), part), "tile sums must be exact"
        product = q_scale.reshape(-1, inp // block)[:, k, None] * w_scale[None, :, k]
        acc = acc + part.astype(np.float32) * product.astype(np.float32)
    return acc.reshape(*q.shape[:-1], out)


def fp8_activations(lead, width, block):
    """bf16 activations whose ``act_quant`` quotients are integers under ``amax / 448`` scales
    (and exact tile sums under power-of-two ones): per block ``k·c``, ``k`` a small integer and
    ``448`` for the block's first value, ``c`` of five significant bits, not a power of two."""
    c = _five_bits(lead + (width // block,))
    k = R.integers(-8, 9, lead + (width // block, block)).astype(np.float32)
    k[..., 0] = 448
    x = (k * c[..., None]).reshape(*lead, width)
    assert np.array_equal(bf16(x), x)
    return x


# one column tile (bitwise checks: no float32 accumulation across tiles, which XLA's default
# code generation may fuse into a multiply-add), ragged row tiles (40 = 32 + 8)
WEIGHT, W_VALUES, W_SCALE = fp8_weight(40, 32, 32)
FP8_X = fp8_activations((2, 3), 32, 32)
LIN_X = R.integers(-8, 9, (2, 3, 64)).astype(np.float32)  # bf16 operands, exact sums
LIN_W = (R.choice([-1, 1], (40, 64)) * R.integers(2048, 4096, (40, 64)) / 2048).astype(np.float32)
G = R.normal(size=(2, 3, 40)).astype(np.float32)


def linear_np(numerics, x, weight):
    """``numerics.linear(x, weight)`` in numpy, for an array or the FP8 weight above."""
    if isinstance(numerics, ce.ExactNumerics):
        w = (
            W_VALUES * np.repeat(np.repeat(W_SCALE, 32, 0), 32, 1)[:40]
            if weight is WEIGHT
            else weight
        )
        return x @ w.T
    if weight is not WEIGHT:  # bf16 product, float32 sums (exact here), one rounding
        return bf16(x.astype(np.float64) @ bf16(weight).T.astype(np.float64))
    q, q_scale = _reference_quant(bf16(x), 32, "fp8_pow2" if numerics.scale_fmt else "fp8_amax")
    return bf16(gemm_np(q.reshape(x.shape), q_scale[..., 0], W_VALUES, W_SCALE, 32))


def kv_input(formats):
    """bf16 KV rows: the round trip's channels near the FP8 grid's midpoints in its blocks,
    the RoPE channels (left alone) random."""
    f = FORMATS[formats]
    rope = 0 if f.kv_channels == "all" else ROPE
    nope = near_midpoints(6, WIDTH[formats] - rope, f.kv_block)
    return np.concatenate([nope, bf16(R.normal(size=(6, rope)))], -1).reshape(2, 3, -1)


KV = {name: kv_input(name) for name in FORMATS}
INDEXER_V = bf16(R.standard_t(3, size=(2, 3, 128)) * R.choice([1e-2, 1, 40], (2, 3, 1)))
HEAD_Q = bf16(R.normal(size=(3, 5, 80)) * 3)
P = np.exp(-R.uniform(0, 5, (2, 7))).astype(np.float32)
DENOM = P.sum(-1) + 0.25
PEAK, SINK = R.normal(size=(2, 7)).astype(np.float32), R.normal(size=(2, 7)).astype(np.float32)


@eqx.filter_jit
def outputs(numerics, formats: tuple[str, ...]):
    out = {}
    for name in formats:
        f = FORMATS[name]
        kv = jnp.asarray(KV[name], jnp.bfloat16)
        out[f"kv-{name}"] = numerics.kv(kv, ROPE, f).astype(jnp.float32)
        out[f"entries-{name}"] = numerics.entries(kv, ROPE, f).astype(jnp.float32)
        out[f"indexer-{name}"] = numerics.indexer(jnp.asarray(INDEXER_V, jnp.bfloat16), f).astype(
            jnp.float32
        )
        x32, v32 = jnp.asarray(KV[name], jnp.float32), jnp.asarray(INDEXER_V, jnp.float32)
        for hook in ("kv", "entries"):

            def weighted(x, hook=hook, f=f, g=x32 * 0.5 + 1.0):
                return jnp.sum(getattr(numerics, hook)(x, ROPE, f) * g)

            out[f"grad-{hook}-{name}"] = jax.grad(weighted)(x32)

        def weighted_indexer(x, f=f, g=v32 + 2.0):
            return jnp.sum(numerics.indexer(x, f) * g)

        out[f"grad-indexer-{name}"] = jax.grad(weighted_indexer)(v32)
        out[f"score_dtype-{name}"] = numerics.score_dtype(f)
        out[f"expanded-{name}"] = numerics.expanded_attention(f)
        for ratio in (1, 2, 4):
            x = numerics.compressor_input(jnp.asarray(KV[name], jnp.bfloat16), ratio, f)
            out[f"compressor-{name}-{ratio}"] = x.dtype
    x_lin = jnp.asarray(LIN_X, jnp.bfloat16)
    out["linear-bf16"] = numerics.linear(x_lin, jnp.asarray(LIN_W)).astype(jnp.float32)
    out["linear-f32"] = numerics.linear(jnp.asarray(LIN_X) * 0.37, jnp.asarray(LIN_W))
    x8 = jnp.asarray(FP8_X, jnp.bfloat16)
    out["fp8"] = numerics.linear(x8, WEIGHT).astype(jnp.float32)
    out["fp8-dtype"] = numerics.linear(x8, WEIGHT).dtype
    x8f = jnp.asarray(FP8_X)
    out["fp8-f32"] = numerics.linear(x8f, WEIGHT).astype(jnp.float32)
    out["grad-fp8"] = jax.grad(
        lambda x: jnp.sum(numerics.linear(x, WEIGHT).astype(jnp.float32) * G)
    )(x8f)
    out["head_norm"] = numerics.head_norm(jnp.asarray(HEAD_Q, jnp.bfloat16), 1e-6).astype(
        jnp.float32
    )
    out["max"] = numerics.attention_max(jnp.asarray(PEAK), jnp.asarray(SINK))
    weights, divisor = numerics.attention_weights(jnp.asarray(P), jnp.asarray(DENOM))
    out["weights"], out["divisor"] = weights.astype(jnp.float32), divisor
    out["layer_input"] = numerics.layer_input(jnp.asarray(LIN_W[:2] * 0.37))
    out["entry_dtype"] = numerics.entry_dtype(x8)
    out["compressor-none"] = numerics.compressor_input(x8).dtype
    return out


@pytest.fixture(scope="module")
def results():
    def run(name: str) -> dict:
        allowed = tuple(f for f in FORMATS if (name, f) not in EXCEPTIONS)
        return jax.device_get(outputs(MEMBERS[name], allowed))

    return member_results(EXCEPTIONS, run)


def test_the_inputs_tell_right_from_wrong():
    """Non-power-of-two scales give other values under ``amax`` and power-of-two scale rules,
    for the KV, the indexer and the FP8 projection; the FP8 projection's activation scales
    are not powers of two and its quantised activations are integers either way."""
    for name, f in FORMATS.items():
        nope = KV[name][..., : 128 if f.kv_channels != "all" else None]
        a = _reference(nope, f.kv_block, "fp8_amax")
        assert (a != _reference(nope, f.kv_block, "fp8_pow2")).mean() > 0.3, name
    q, scale = _reference_quant(FP8_X, 32, "fp8_amax")
    assert (np.log2(scale) % 1 != 0).all() and (q == np.round(q)).all()
    want = {
        rule: linear_np(MEMBERS[m], FP8_X, WEIGHT)
        for rule, m in (("a", "deepseek-amax"), ("p", "deepseek"))
    }
    assert (want["a"] != want["p"]).mean() > 0.3
    assert (bf16(LIN_W) != LIN_W).mean() > 0.9  # the projection's weights round to bf16


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("name", MEMBERS)
def test_kv_round_trip(results, name, formats):
    out = results(name, formats)
    want = kv_np(MEMBERS[name], KV[formats], FORMATS[formats])
    np.testing.assert_array_equal(out[f"kv-{formats}"], want)


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("name", MEMBERS)
def test_compressed_entries(results, name, formats):
    out = results(name, formats)
    want = entries_np(MEMBERS[name], KV[formats], FORMATS[formats])
    np.testing.assert_array_equal(out[f"entries-{formats}"], want)


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("name", MEMBERS)
def test_indexer_quantisation(results, name, formats):
    out = results(name, formats)
    want = indexer_np(MEMBERS[name], INDEXER_V, FORMATS[formats])
    np.testing.assert_array_equal(out[f"indexer-{formats}"], want)


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("name", MEMBERS)
def test_round_trips_pass_gradients_straight_through(results, name, formats):
    """The KV and entries round trips' gradient is the identity; the indexer's is the
    rotation's transpose (the Walsh-Hadamard matrix is symmetric) where it rotates."""
    out, f = results(name, formats), FORMATS[formats]
    g = KV[formats] * 0.5 + 1.0
    np.testing.assert_array_equal(out[f"grad-kv-{formats}"], g)
    np.testing.assert_array_equal(out[f"grad-entries-{formats}"], g)
    gi = INDEXER_V + 2.0
    rotates = f.hadamard and not isinstance(MEMBERS[name], ce.ExactNumerics)
    want = _fwht(gi) if rotates else gi
    np.testing.assert_allclose(
        out[f"grad-indexer-{formats}"], want, rtol=0, atol=1e-6 * np.abs(want).max()
    )


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("name", MEMBERS)
def test_what_the_layers_ask(results, name, formats):
    """The score dtype, whether V3.2 attends expanded, and the compressor's dtype on both sides
    of ``compressor_float32_ratio`` (V4.1's ratio-1 compressor stays bf16)."""
    out, f, numerics = results(name, formats), FORMATS[formats], MEMBERS[name]
    exact = isinstance(numerics, ce.ExactNumerics)
    assert out[f"score_dtype-{formats}"] == (None if exact else f.score_dtype)
    assert out[f"expanded-{formats}"] == (False if exact else f.expanded_prefill)
    for ratio in (1, 2, 4):
        bf16_kept = exact or ratio < f.compressor_float32_ratio
        assert out[f"compressor-{formats}-{ratio}"] == (jnp.bfloat16 if bf16_kept else jnp.float32)


@pytest.mark.parametrize("name", MEMBERS)
def test_projections(results, name):
    """An array weight: in the input's dtype (DeepSeek: float32 sums, one bf16 rounding, the
    weight rounded to bf16 first); an ``Fp8Weight``: DeepSeek's ``act_quant`` with the
    member's scale rule and the FP8 product, bf16 out (exact: the dequantised product)."""
    out, numerics = results(name), MEMBERS[name]
    exact = isinstance(numerics, ce.ExactNumerics)
    x32 = LIN_X * np.float32(0.37)
    np.testing.assert_allclose(out["linear-f32"], x32 @ LIN_W.T, rtol=1e-6, atol=1e-5)
    if not exact:
        np.testing.assert_array_equal(out["linear-bf16"], linear_np(numerics, LIN_X, LIN_W))
    want = linear_np(numerics, FP8_X, WEIGHT)
    if exact:  # in the input's dtype: float32
        np.testing.assert_allclose(out["fp8-f32"], want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:  # bf16 out, from a bf16 or a float32 input alike
        assert out["fp8-dtype"] == jnp.bfloat16
        np.testing.assert_array_equal(out["fp8"], want)
        np.testing.assert_array_equal(out["fp8-f32"], want)


@pytest.mark.parametrize("name", MEMBERS)
def test_fp8_projection_trains_straight_through(results, name):
    """The input's gradient is that of ``x · dequantize(W)ᵀ`` (DeepSeek: the bf16 output's
    cotangent in, bf16 out)."""
    w = (W_VALUES * np.repeat(np.repeat(W_SCALE, 32, 0), 32, 1)[:40]).astype(np.float64)
    got = np.asarray(results(name)["grad-fp8"], np.float32)
    if isinstance(MEMBERS[name], ce.ExactNumerics):
        want = G.astype(np.float64) @ w
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    else:
        want = bf16(bf16(G).astype(np.float64) @ w)
        np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
        assert (got == want).mean() > 0.95


@pytest.mark.parametrize("name", MEMBERS)
def test_head_norm_and_softmax(results, name):
    """The per-head query norm (DeepSeek: torch's bf16 ops, each rounded; exact: float32 then
    one rounding), the softmax's maximum (DeepSeek: without the sink) and its weights
    (DeepSeek: bf16 probabilities, divided after ``P·V``)."""
    out, exact = results(name), isinstance(MEMBERS[name], ce.ExactNumerics)
    q = HEAD_Q
    if exact:
        want = bf16(q / np.sqrt((q.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6))
    else:
        mean = bf16(bf16(q * q).mean(-1, keepdims=True))
        want = bf16(q * bf16(1 / np.sqrt(bf16(mean + np.float32(1e-6)))))
    np.testing.assert_allclose(out["head_norm"], want, rtol=2**-8)
    assert (out["head_norm"] == want).mean() > 0.99
    np.testing.assert_array_equal(out["max"], np.maximum(PEAK, SINK) if exact else PEAK)
    if exact:
        np.testing.assert_allclose(out["weights"], P / DENOM[:, None], rtol=1e-7)
        assert out["divisor"] is None
    else:
        np.testing.assert_array_equal(out["weights"], bf16(P))
        np.testing.assert_array_equal(out["divisor"], DENOM)


@pytest.mark.parametrize("name", MEMBERS)
def test_activations(results, name):
    """The layer's input (DeepSeek: rounded to bf16) and the entries' dtype before their norm."""
    out, exact = results(name), isinstance(MEMBERS[name], ce.ExactNumerics)
    x = LIN_W[:2] * np.float32(0.37)
    if exact:
        np.testing.assert_array_equal(out["layer_input"], x)
        assert out["entry_dtype"] is None and out["compressor-none"] == jnp.bfloat16
    else:
        assert out["layer_input"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out["layer_input"], np.float32), bf16(x))
        assert out["entry_dtype"] == jnp.bfloat16 and out["compressor-none"] == jnp.float32


def test_v41_numerics_refuses_other_families():
    config = ce.V4AttentionConfig(index_head_dim=128)
    for formats in (V32_FORMATS, V4_FORMATS):
        with pytest.raises(ValueError, match="DeepSeekV41Inference is the numerics of V4.1"):
            ce.DeepSeekV41Inference().check(formats, config)


def test_fp8_gemm_applies_the_product_of_its_two_scales():
    """DeepSeek's ``fp8_gemm`` multiplies each tile's sum by one float32 scale, the product of
    the activation's and the weight tile's: with scales that are not powers of two, applying
    them one after the other gives other bits (the numpy reference shows it here); the
    product of an exact tile sum is the reference's bit for bit. Over two column tiles, whose
    float32 accumulation XLA's default code generation may fuse into a multiply-add (one
    rounding where the kernel's arithmetic has two), within a few float32 steps of the largest."""
    q = R.integers(-16, 17, (2, 5, 32)).astype(np.float32)
    q_scale = R.uniform(1e-3, 1e-2, (2, 5, 1)).astype(np.float32)
    want = gemm_np(q, q_scale, W_VALUES, W_SCALE, 32)
    got = jax.jit(fp8_product)(jnp.asarray(q.astype(E4M3)), jnp.asarray(q_scale), WEIGHT)
    np.testing.assert_array_equal(np.asarray(got), want)
    part = q.reshape(-1, 32) @ W_VALUES.T
    in_turn = (part * q_scale.reshape(-1, 1)) * np.repeat(W_SCALE, 32, axis=0)[:40, 0]
    assert (in_turn.reshape(want.shape) != want).mean() > 0.05
    two, values, scale = fp8_weight(40, 64, 32)
    q = R.integers(-16, 17, (2, 5, 64)).astype(np.float32)
    q_scale = R.uniform(1e-3, 1e-2, (2, 5, 2)).astype(np.float32)
    want = gemm_np(q, q_scale, values, scale, 32)
    got = jax.jit(fp8_product)(jnp.asarray(q.astype(E4M3)), jnp.asarray(q_scale), two)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2**-22 * np.abs(want).max())


def test_fp8_weight_checks_and_dequantizes():
    """``values · scale`` tile by tile (the ragged last row tile included); a scale grid that
    does not fit the tiles, or values that are not E4M3, are refused."""
    full = np.repeat(np.repeat(W_SCALE, 32, 0), 32, 1)[:40]
    np.testing.assert_array_equal(np.asarray(WEIGHT.dequantize()), W_VALUES * full)
    assert WEIGHT.shape == (40, 32)
    with pytest.raises(ValueError, match=r"scale has shape \(1, 1\), expected \(2, 1\)"):
        ce.Fp8Weight(WEIGHT.values, WEIGHT.scale[:1], (32, 32))
    with pytest.raises((TypeError, ValueError)):  # jaxtyping's check, or the module's own
        ce.Fp8Weight(WEIGHT.values.astype(jnp.float32), WEIGHT.scale, (32, 32))
