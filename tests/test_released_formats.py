"""What each released checkpoint layout says about its FP8 arithmetic (issue 57): the activation
scale format (``scale_fmt``) every loader reads from every layout — DeepSeek's native
``inference/config.json`` of V3.2, V4 and V4.1, transformers' spelling with and without
``quantization_config.scale_fmt`` — into ``numerics="deepseek"``, and FP8 weight tiles that are
not square (``weight_block_size`` such as [24, 48]) through DeepSeek's GEMM (``fp8_product``)
and the V4 and V4.1 loaders, against numpy.

Inputs tell a wrong version apart: the two scale formats are different numerics objects
(``DeepSeekInference(scale_fmt=None)`` quantises with amax scales); the tiles' scales are not
powers of two and differ from tile to tile, 24 x 48 tiles over a 40 x 96 weight leave a ragged
last row tile, so transposing the tile or its grid changes the product.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conformance import fp8_product

import csa_eqx as ce
from csa_eqx.hf import _config as hf_config
from csa_eqx.hf import _v41

E4M3 = ml_dtypes.float8_e4m3fn
R = np.random.default_rng(5701)

# (layout, config) -> the scale format DeepSeek's code (or transformers' config) implies
V4_NATIVE = {"dim": 64, "n_heads": 2}  # DeepSeek's V4 keys (the rest: ModelArgs' defaults)
V32_NATIVE = {"dim": 64, "n_heads": 2}
HF = {"hidden_size": 64, "num_attention_heads": 2}
UE8M0 = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
NO_FMT = {"quant_method": "fp8", "weight_block_size": [128, 128]}  # transformers' FP8 config
V4_LAYOUTS = [
    ({**V4_NATIVE}, "ue8m0"),  # scale_dtype "fp8" (the default): ue8m0 whatever scale_fmt
    ({**V4_NATIVE, "scale_dtype": "fp8", "scale_fmt": None}, "ue8m0"),
    ({**V4_NATIVE, "scale_dtype": "bf16", "scale_fmt": None}, None),
    ({**V4_NATIVE, "scale_dtype": "bf16", "scale_fmt": "ue8m0"}, "ue8m0"),
    ({**HF, "quantization_config": UE8M0}, "ue8m0"),
    ({**HF, "quantization_config": NO_FMT}, None),  # no scale_fmt: amax scales
    ({**HF}, None),  # no quantization_config at all
]
V32_LAYOUTS = [
    ({**V32_NATIVE}, None),  # V3.2's ModelArgs default
    ({**V32_NATIVE, "scale_fmt": "ue8m0"}, "ue8m0"),  # config_671B_v3.2.json's
    ({**HF, "quantization_config": UE8M0}, "ue8m0"),
    ({**HF, "quantization_config": NO_FMT}, None),
]
V41_NATIVE = {"dim": 64, "n_layers": 2, "dtype": "fp8"}  # no scale_fmt key in V4.1's ModelArgs
V41_HF_TEXT = {"hidden_size": 64, "num_hidden_layers": 2}
V41_LAYOUTS = [
    ({**V41_NATIVE}, "ue8m0"),  # the code's module constant
    ({"model_type": "deepseek_v41", "text_config": V41_HF_TEXT, "quantization_config": UE8M0},
     "ue8m0"),
    ({"model_type": "deepseek_v41", "text_config": V41_HF_TEXT, "quantization_config": NO_FMT},
     None),
    ({"model_type": "deepseek_v41", "text_config": {**V41_HF_TEXT, "quantization_config": UE8M0}},
     "ue8m0"),
    ({**V41_HF_TEXT, "quantization_config": NO_FMT}, None),  # the text config itself
]  # fmt: skip


@pytest.mark.parametrize("config, want", V4_LAYOUTS)
def test_v4_scale_format_of_each_layout(config, want):
    assert hf_config.v4_scale_fmt(config, "config") == want


@pytest.mark.parametrize("config, want", V32_LAYOUTS)
def test_v32_scale_format_of_each_layout(config, want):
    assert hf_config.v32_scale_fmt(config, "config") == want


@pytest.mark.parametrize("config, want", V41_LAYOUTS)
def test_v41_scale_format_of_each_layout(config, want):
    """V4.1's loaders read it as V4's do (they took ``"ue8m0"`` whatever the config said)."""
    assert _v41.v41_scale_fmt(config) == want


@pytest.mark.parametrize("want", ["ue8m0", None])
def test_the_loaders_numerics_take_it(want):
    """``numerics="deepseek"`` becomes the family's DeepSeek numerics with that format (V4 /
    V3.2 through ``split_options``, V4.1 through ``loader_execution`` as its loaders call it)."""
    _, execution = hf_config_split({"numerics": "deepseek"}, want)
    assert execution.numerics == ce.DeepSeekInference(scale_fmt=want)
    execution = _v41.loader_execution(None, {"numerics": "deepseek"}, want, _v41.V41_FORMATS)
    assert execution.numerics == ce.DeepSeekV41Inference(scale_fmt=want)


def hf_config_split(options, scale_fmt):
    from csa_eqx.hf._options import split_options

    return split_options(options, scale_fmt)


# --- non-square FP8 tiles ----------------------------------------------------------------------

BLOCK = (24, 48)  # rows x input columns, as weight_block_size [24, 48]
OUT, IN = 40, 96  # two row tiles (the second ragged: 16 rows), two column tiles


def _weight():
    """Small integers (exact in E4M3) and per-tile scales that are not powers of two."""
    values = R.integers(-16, 17, (OUT, IN)).astype(np.float32)
    scale = np.array([[0.0371, 0.0593], [0.0819, 0.0247]], np.float32)
    return values, scale


def _dequantized_np(values, scale, block):
    rows = np.arange(values.shape[0])[:, None] // block[0]
    cols = np.arange(values.shape[1])[None, :] // block[1]
    return values * scale[rows, cols]


def test_fp8_product_with_non_square_tiles():
    """DeepSeek's ``fp8_gemm`` over 24 x 48 tiles: per 48-column tile, the FP8 products summed
    (exact), times the activation block's scale times that tile's weight scale (the row tile
    of each output), accumulated in float32 — numpy's loop; and the weight's
    dequantisation is the values times their own tile's scale."""
    values, scale = _weight()
    weight = ce.Fp8Weight(jnp.asarray(values.astype(E4M3)), jnp.asarray(scale), BLOCK)
    q = R.integers(-8, 9, (3, IN)).astype(np.float32)
    q_scale = np.array([[0.0113, 0.0291], [0.0437, 0.0071], [0.0203, 0.0157]], np.float32)
    got = np.asarray(fp8_product(jnp.asarray(q.astype(E4M3)), jnp.asarray(q_scale), weight))
    want = np.zeros((3, OUT), np.float32)
    w_scale = np.repeat(scale, BLOCK[0], axis=0)[:OUT]  # [OUT, column tiles]
    for k in range(IN // BLOCK[1]):
        cols = slice(k * BLOCK[1], (k + 1) * BLOCK[1])
        part = q[:, cols].astype(np.float64) @ values[:, cols].T.astype(np.float64)
        assert np.array_equal(part.astype(np.float32), part)  # exact tile sums
        product = (q_scale[:, k, None] * w_scale[None, :, k]).astype(np.float32)
        want = want + part.astype(np.float32) * product
    # within float32 rounding: XLA may fuse the accumulation into a multiply-add
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(
        np.asarray(weight.dequantize()), _dequantized_np(values, scale, BLOCK)
    )
    # the inputs tell a transposed tile apart: rows in tiles of 48 take other scales
    assert not np.array_equal(np.repeat(scale, BLOCK[1], axis=0)[:OUT], w_scale)


def test_v41_loader_keeps_non_square_tiles():
    """``load_v41_attention(block=(24, 8))`` (the tiny stack's widest projection, ``wq_b``
    ``[64, 16]``: three row tiles, the last ragged, two column tiles): the values times their
    own tile's scale, as numpy says."""
    import jax
    from test_v41_layers import CONFIG

    from csa_eqx.hf import load_v41_attention, v41_parameter_names

    block = (24, 8)
    layer = ce.V41Attention(CONFIG, 0, key=jax.random.key(0))
    names = v41_parameter_names(layer)
    tensors = {f"layers.0.attn.{n}": np.asarray(_get(layer, p), np.float32)
               for p, n in names.items()}  # fmt: skip
    path, name = next((p, n) for p, n in names.items() if n == "wq_b.weight")
    values = R.integers(-16, 17, (64, 16)).astype(np.float32)
    scale = R.uniform(0.01, 0.1, (3, 2)).astype(np.float32)  # not powers of two
    tensors["layers.0.attn.wq_b.weight"] = values.astype(E4M3)
    tensors["layers.0.attn.wq_b.scale"] = scale
    loaded = load_v41_attention(CONFIG, 0, tensors, block=block)
    np.testing.assert_array_equal(
        np.asarray(_get(loaded, path)), _dequantized_np(values, scale, block)
    )


def _get(module, path):
    for part in path.split("."):
        module = getattr(module, part)
    return module
