"""Loading HF V4 weights: safetensors checkpoints (sharded, bf16, fp8) and bad state dicts."""

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
    read_safetensors,
    v4_config_from_hf,
)
from csa_eqx.presets import tiny_v4
from csa_eqx.testing import TINY_YARN, hf_v4_config, random_hf_v4_layer, run_hf_v4, state_dict_numpy


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
    assert layer.q_a_proj.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(layer.q_a_proj), want.numpy())


def _sd(cfg):
    return state_dict_numpy(random_hf_v4_layer(cfg))


def test_fp8_with_block_scale_dequantises():
    cfg = hf_v4_config(tiny_v4("csa"))
    sd = _sd(cfg)
    w = sd["q_a_proj.weight"]  # [32, 64]
    scale = np.array([[0.5, 2.0], [4.0, 1.0]], np.float32)  # 2x2 blocks of 16x32
    sd["q_a_proj.weight"] = w.astype(ml_dtypes.float8_e4m3fn)
    sd["q_a_proj.weight_scale_inv"] = scale
    layer = load_v4_attention(sd, cfg, 0)
    expect = sd["q_a_proj.weight"].astype(np.float32) * np.kron(scale, np.ones((16, 32)))
    np.testing.assert_array_equal(np.asarray(layer.q_a_proj), expect)


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
    c = v4_config_from_hf(as_json, 0, qk_head_chunk_size=2)
    assert c.qk_head_chunk_size == 2 and c.compress_rate == 4 and c.rope_dim == 8
    assert c.rope_scaling is not None and c.rope_scaling.factor == 16.0
    with pytest.raises(ValueError, match="qk_head_chunk_size"):
        v4_config_from_hf(as_json, 0, qk_head_chunk_size=3)
    legacy = {k: v for k, v in as_json.items() if k not in ("layer_types", "compress_rates")}
    legacy["compress_ratios"] = [128]
    assert v4_config_from_hf(legacy, 0).compress_rate == 128
