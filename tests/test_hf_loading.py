"""Loading HF V4 / V3.2 weights: safetensors checkpoints (sharded, bf16, fp8), bad state dicts
and bad configs (every error names the tensor or key)."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from csa_eqx.hf import (
    load_v4_attention,
    load_v4_attention_from_safetensors,
    load_v32_attention,
    read_safetensors,
    v4_config_from_hf,
)
from csa_eqx.hf._safetensors_io import decode_e8m0
from csa_eqx.presets import tiny_v4, tiny_v32
from csa_eqx.testing import (
    TINY_YARN,
    hf_v4_config,
    hf_v32_config,
    random_hf_v4_layer,
    random_hf_v32_layer,
    run_hf_v4,
    state_dict_numpy,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-layer (sliding, CSA, HCA) HF model saved as sharded safetensors."""
    cfg = hf_v4_config(
        tiny_v4("csa"),
        num_hidden_layers=3,
        mlp_layer_types=["moe"] * 3,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
    )
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]) + (p.ndim == 1))
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path, max_shard_size="100KB")
    return model, cfg, path


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_safetensors_round_trip(checkpoint, layer_idx):
    model, cfg, path = checkpoint
    assert len(list(path.glob("*.safetensors"))) > 1, "expected a sharded checkpoint"
    hf_layer = model.model.layers[layer_idx].self_attn
    x = np.random.default_rng(layer_idx).normal(size=(2, 17, cfg.hidden_size)).astype(np.float32)
    want, _, _ = run_hf_v4(hf_layer, cfg, x)
    layer = load_v4_attention_from_safetensors(path, layer_idx)
    assert layer.config.layer_type == ["sliding", "csa", "hca"][layer_idx]
    got = np.asarray(jax.jit(lambda m, x: m(x))(layer, x))
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_reads_only_the_requested_layer(checkpoint):
    _, _, path = checkpoint
    files = sorted(path.glob("*.safetensors"))
    seen = {}
    for f in files:
        seen.update(read_safetensors(f, keep=lambda n: n.startswith("model.layers.1.attn.")))
    assert seen and all(k.startswith("model.layers.1.attn.") for k in seen)
    assert "model.layers.1.attn.indexer.wq_b.weight" in seen


def test_hf_named_safetensors(checkpoint, tmp_path):
    """A folder whose tensors carry the HF module names loads too."""
    from safetensors.numpy import save_file

    model, cfg, path = checkpoint
    hf_layer = model.model.layers[1].self_attn
    sd = {f"model.layers.1.self_attn.{k}": v for k, v in state_dict_numpy(hf_layer).items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    layer = load_v4_attention_from_safetensors(tmp_path, 1)
    np.testing.assert_array_equal(
        np.asarray(layer.indexer.q_b_proj),
        sd["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"],
    )


def test_bf16_checkpoint_upcasts(checkpoint, tmp_path):
    model, cfg, _ = checkpoint
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.to(torch.float32)
    layer = load_v4_attention_from_safetensors(tmp_path, 1)
    want = model.model.layers[1].self_attn.q_a_proj.weight.detach().to(torch.bfloat16).float()
    assert layer.block.q_a_proj.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(layer.block.q_a_proj), want.numpy())


def _sd(cfg):
    return state_dict_numpy(random_hf_v4_layer(cfg))


def test_fp8_with_block_scale_dequantises():
    """The tile comes from ``quantization_config.weight_block_size``; last tiles are ragged."""
    hf_cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(hf_cfg)
    cfg = dict(hf_cfg.to_dict(), quantization_config={"weight_block_size": [24, 48]})
    w = sd["q_a_proj.weight"]  # [32, 64]: tiles of 24 x 48, the last row / column ragged
    scale = np.array([[0.5, 2.0], [4.0, 0.25]], np.float32)
    sd["q_a_proj.weight"] = w.astype(ml_dtypes.float8_e4m3fn)
    sd["q_a_proj.weight_scale_inv"] = scale
    layer = load_v4_attention(sd, cfg, 0)
    rows, cols = np.arange(32)[:, None] // 24, np.arange(64)[None, :] // 48
    expect = sd["q_a_proj.weight"].astype(np.float32) * scale[rows, cols]
    np.testing.assert_array_equal(np.asarray(layer.block.q_a_proj), expect)


def test_e8m0_bytes_are_powers_of_two():
    raw = np.array([0, 1, 126, 127, 128, 200, 254, 255], np.uint8)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**73, 2.0**127, np.nan]
    np.testing.assert_array_equal(decode_e8m0(raw), np.array(want, np.float32))
    np.testing.assert_array_equal(decode_e8m0(raw.view(ml_dtypes.float8_e8m0fnu)), want)


def test_fp8_with_e8m0_scale_from_a_state_dict():
    """E8M0 scales work from numpy (ml_dtypes) and torch; default tile 128 x 128."""
    cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(cfg)
    w8 = (sd["q_b_proj.weight"] * 8).astype(ml_dtypes.float8_e4m3fn)  # [128, 32]: one tile
    sd["q_b_proj.weight"] = w8
    for scale in (
        np.array([[124]], np.uint8).view(ml_dtypes.float8_e8m0fnu),
        torch.tensor([[124]], dtype=torch.uint8).view(torch.float8_e8m0fnu),
    ):
        sd["q_b_proj.weight_scale_inv"] = scale
        layer = load_v4_attention(sd, cfg, 0)
        np.testing.assert_array_equal(np.asarray(layer.block.q_b_proj), w8.astype(np.float32) / 8)


def test_scale_without_fp8_weight_is_an_error():
    cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(cfg)
    sd["kv_proj.weight_scale_inv"] = np.ones((1, 1), np.float32)
    with pytest.raises(ValueError, match=r"'kv_proj.weight_scale_inv' is a block scale.*float32"):
        load_v4_attention(sd, cfg, 0)


def test_non_finite_weight_is_named():
    cfg = hf_v4_config(tiny_v4("sliding"))
    sd = _sd(cfg)
    sd["o_b_proj.weight"][3, 4] = np.inf
    with pytest.raises(ValueError, match=r"'o_b_proj.weight' has 1 non-finite"):
        load_v4_attention(sd, cfg, 0)


def test_fp8_without_scale_is_a_clear_error():
    cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(cfg)
    sd["kv_proj.weight"] = sd["kv_proj.weight"].astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_proj.weight.*FP8"):
        load_v4_attention(sd, cfg, 0)


def test_missing_tensor_is_named():
    cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(cfg)
    del sd["compressor.indexer.scorer.weights_proj.weight"]
    with pytest.raises(ValueError, match="compressor.indexer.scorer.weights_proj.weight"):
        load_v4_attention(sd, cfg, 0)


def test_misshaped_tensor_is_named():
    cfg = hf_v4_config(tiny_v4("hca"))
    sd = _sd(cfg)
    sd["compressor.position_bias"] = sd["compressor.position_bias"][:-1]
    with pytest.raises(ValueError, match="compressor.position_bias.*shape"):
        load_v4_attention(sd, cfg, 0)


def test_options_and_dict_config():
    cfg = hf_v4_config(tiny_v4("csa", rope_scaling=TINY_YARN))
    as_json = json.loads(cfg.to_json_string())
    c = v4_config_from_hf(as_json, 0, index_topk=5)
    assert c.index_topk == 5 and c.compress_rate == 4 and c.rope_dim == 8
    assert c.rope_scaling is not None and c.rope_scaling.factor == 16.0
    with pytest.raises(ValueError, match="qk_head_chunk_size"):
        load_v4_attention(_sd(cfg), as_json, 0, qk_head_chunk_size=3)
    with pytest.raises(TypeError, match="qk_head_chunk"):
        load_v4_attention(_sd(cfg), as_json, 0, qk_head_chunk=2)  # a typo is not ignored
    layer = load_v4_attention(_sd(cfg), as_json, 0, qk_head_chunk_size=2)
    assert layer.execution.qk_head_chunk_size == 2
    legacy = {k: v for k, v in as_json.items() if k not in ("layer_types", "compress_rates")}
    legacy["compress_ratios"] = [128]
    assert v4_config_from_hf(legacy, 0).compress_rate == 128


def test_unexpected_tensor_is_named():
    cfg = hf_v4_config(tiny_v4("hca"))
    sd = _sd(cfg)
    sd["compressor.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) for this layer: .*extra.weight"):
        load_v4_attention(sd, cfg, 0)


def test_prefix_ignores_other_layers():
    """A whole model's state dict loads one layer with ``prefix=``; other keys are not errors."""
    cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(cfg)
    full = {f"model.layers.0.self_attn.{k}": v for k, v in sd.items()}
    full["model.layers.1.self_attn.q_a_proj.weight"] = np.zeros(3, np.float32)
    full["model.embed_tokens.weight"] = np.zeros(3, np.float32)
    layer = load_v4_attention(full, cfg, 0, prefix="model.layers.0.self_attn.")
    np.testing.assert_array_equal(np.asarray(layer.block.q_a_proj), sd["q_a_proj.weight"])
    full["model.layers.0.self_attn.stray"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"unexpected.*model.layers.0.self_attn.stray"):
        load_v4_attention(full, cfg, 0, prefix="model.layers.0.self_attn.")


@pytest.mark.parametrize(
    "weights, config, message",
    [
        ("csa", "sliding", r"a 'sliding' layer \(compress_rate=0\), but its tensors are a 'csa'"),
        ("csa", "hca", r"a 'hca' layer .* but its tensors are a 'csa'"),
        ("hca", "csa", r"a 'csa' layer .* but its tensors are a 'hca'"),
        ("sliding", "csa", r"a 'csa' layer .* but its tensors are a 'sliding'"),
    ],
)
def test_layer_kind_must_match_the_tensors(weights, config, message):
    """CSA weights with a config that makes the layer sliding are not silently truncated."""
    sd = _sd(hf_v4_config(tiny_v4(weights)))
    with pytest.raises(ValueError, match=message):
        load_v4_attention(sd, hf_v4_config(tiny_v4(config)), 0)


def _dict_config(kind="csa", **changes):
    d = json.loads(hf_v4_config(tiny_v4(kind)).to_json_string())
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("layer_idx", [-1, 1, 5])
def test_layer_idx_range(layer_idx):
    with pytest.raises(ValueError, match=rf"layer_idx must be an int in \[0, 1\).*got {layer_idx}"):
        v4_config_from_hf(_dict_config(), layer_idx)
    legacy = _dict_config(layer_types=None, compress_rates=None, num_hidden_layers=2)
    legacy["compress_ratios"] = [4, 0, 0]  # + the MTP layer's entry
    assert v4_config_from_hf(legacy, 1).compress_rate == 0
    if layer_idx != 1:
        with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\)"):
            v4_config_from_hf(legacy, layer_idx)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"config lacks the key 'head_dim'"):
        v4_config_from_hf(_dict_config(head_dim=None), 0)
    with pytest.raises(ValueError, match=r"layer_types\[0\] = 'full_attention'"):
        v4_config_from_hf(_dict_config(layer_types=["full_attention"]), 0)
    with pytest.raises(ValueError, match=r"neither 'layer_types' nor 'compress_ratios'"):
        v4_config_from_hf(_dict_config(layer_types=None), 0)
    bad_rate = _dict_config(layer_types=None)
    bad_rate["compress_ratios"] = [2]
    with pytest.raises(ValueError, match=r"compression rate \(compress_ratios\) is 2"):
        v4_config_from_hf(bad_rate, 0)
    linear = _dict_config(rope_parameters={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope type 'linear' is not supported"):
        v4_config_from_hf(linear, 0)
    no_factor = _dict_config(
        rope_parameters={"type": "yarn", "original_max_position_embeddings": 8}
    )
    with pytest.raises(ValueError, match=r"lacks the key 'factor'"):
        v4_config_from_hf(no_factor, 0)


def test_v32_state_dict_checks():
    cfg = hf_v32_config(tiny_v32(), num_hidden_layers=2)
    sd = state_dict_numpy(random_hf_v32_layer(cfg))
    assert load_v32_attention(sd, cfg, 1).config == tiny_v32()
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\)"):
        load_v32_attention(sd, cfg, 2)
    sd["indexer.extra"] = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r"unexpected.*indexer.extra"):
        load_v32_attention(sd, cfg, 0)
