"""Checkpoints in the released layouts, and every way a checkpoint folder can be wrong.

The fixtures rebuild the layouts DeepSeek ships, with tiny sizes:

- V4 (DeepSeek-V4-Flash): DeepSeek's native tensor names (``layers.{i}.attn.wq_a.weight``),
  the dense projections (``wq_a``, ``wq_b``, ``wkv``, ``wo_b``, ``indexer.wq_b``) as
  ``F8_E4M3`` with ``F8_E8M0`` scales, one per 128 x 128 tile (``.scale``), the output
  LoRA ``wo_a``, norms and compressor / indexer projections in BF16, ``attn_sink`` / ``ape``
  in F32; DeepSeek's inference ``config.json`` keys (``dim``, ``n_heads``, ``window_size``,
  ``compress_ratios`` with the MTP slot, ``original_seq_len`` / ``rope_factor``) or the Hub's
  HF keys; several shards with ``model.safetensors.index.json``.
- V3.2 (DeepSeek-V3.2-Exp): HF names (``model.layers.{i}.self_attn.kv_a_proj_with_mqa``)
  with ``F8_E4M3`` weights and float32 power-of-two ``weight_scale_inv`` tiles and the HF
  config, or ``convert.py``'s names (``layers.{i}.attn.wkv_a``, ``.scale``) with the inference
  config.

Files are written by the ``safetensors`` package (torch side: it writes ``F8_E8M0``); broken
files are made by hand. The reference is transformers' own layer holding the weights
dequantised here by a plain numpy formula.
"""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from csa_eqx import V4AttentionConfig, YaRNScaling
from csa_eqx.hf import (
    SafetensorsError,
    load_v4_attention_from_safetensors,
    load_v32_attention_from_safetensors,
    read_safetensors,
)
from csa_eqx.presets import COMPRESS_RATES, TINY_HCA_RATE, tiny_v4, tiny_v32
from csa_eqx.testing import (
    hf_v4_config,
    hf_v32_config,
    random_hf_v4_layer,
    random_hf_v32_layer,
    run_hf_v4,
    run_hf_v32,
)

TILE = 128
# hidden 160 and 6 x 32 heads make ragged last tiles (160 = 128 + 32, 192 = 128 + 64)
V4_OVERRIDES = dict(  # the tiny preset's other sizes
    hidden_size=160,
    num_heads=6,
    q_lora_rank=48,
    sliding_window=8,
    index_topk=4,
    rope_scaling=YaRNScaling(factor=4.0, original_max_position_embeddings=32),
)
V4_KINDS = ["sliding", "csa", "hca"]
V4_RATES = [COMPRESS_RATES["sliding"], COMPRESS_RATES["csa"], TINY_HCA_RATE]
V4_INFERENCE_CONFIG = {  # DeepSeek's inference/config.json keys
    "vocab_size": 64,
    "dim": 160,
    "n_layers": 3,
    "n_heads": 6,
    "head_dim": 32,
    "rope_head_dim": 8,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "window_size": 8,
    "compress_ratios": [*V4_RATES, 0],  # the last entry is the MTP layer's
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "original_seq_len": 32,
    "rope_factor": 4,
    "beta_fast": 32,
    "beta_slow": 1,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 4,
    "norm_eps": 1e-6,
    "dtype": "fp8",
    "scale_fmt": "ue8m0",
}
V4_HUB_CONFIG = {  # the Hub's config.json: HF keys, compress_ratios, FP8 quantization_config
    "model_type": "deepseek_v4",
    "hidden_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_ratios": [*V4_RATES, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 4,
    "rms_norm_eps": 1e-6,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [TILE, TILE],
    },
}
# DeepSeek's native name (after ``layers.{i}.attn.``) -> (HF name, storage), from DeepSeek's
# inference model: Linear layers default to FP8 (+ E8M0 ``.scale``); wo_a, the compressors and
# the indexer's head weights are BF16; the sink and the positional biases F32.
V4_NATIVE = {
    "attn_sink": ("sinks", "f32"),
    "wq_a.weight": ("q_a_proj.weight", "fp8"),
    "q_norm.weight": ("q_a_norm.weight", "bf16"),
    "wq_b.weight": ("q_b_proj.weight", "fp8"),
    "wkv.weight": ("kv_proj.weight", "fp8"),
    "kv_norm.weight": ("kv_norm.weight", "bf16"),
    "wo_a.weight": ("o_a_proj.weight", "bf16"),
    "wo_b.weight": ("o_b_proj.weight", "fp8"),
}
V4_COMPRESSOR = {
    "compressor.wkv.weight": ("compressor.kv_proj.weight", "bf16"),
    "compressor.wgate.weight": ("compressor.gate_proj.weight", "bf16"),
    "compressor.ape": ("compressor.position_bias", "f32"),
    "compressor.norm.weight": ("compressor.kv_norm.weight", "bf16"),
}
V4_INDEXER = {
    "indexer.wq_b.weight": ("compressor.indexer.q_b_proj.weight", "fp8"),
    "indexer.weights_proj.weight": ("compressor.indexer.scorer.weights_proj.weight", "bf16"),
    "indexer.compressor.wkv.weight": ("compressor.indexer.kv_proj.weight", "bf16"),
    "indexer.compressor.wgate.weight": ("compressor.indexer.gate_proj.weight", "bf16"),
    "indexer.compressor.ape": ("compressor.indexer.position_bias", "f32"),
    "indexer.compressor.norm.weight": ("compressor.indexer.kv_norm.weight", "bf16"),
}

V32_CONFIG = tiny_v32(
    hidden_size=160,
    q_lora_rank=48,
    rope_scaling=YaRNScaling(
        factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0
    ),
)
V32_INFERENCE_CONFIG = {  # DeepSeek-V3.2's inference config keys
    "dim": 160,
    "n_layers": 2,
    "n_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "rope_theta": 10000.0,
    "original_seq_len": 32,
    "rope_factor": 4,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "dtype": "fp8",
    "scale_fmt": "ue8m0",
}
# HF name -> (convert.py's name, storage) of a V3.2 attention tensor
V32_NAMES = {
    "q_a_proj.weight": ("wq_a.weight", "fp8"),
    "q_a_layernorm.weight": ("q_norm.weight", "bf16"),
    "q_b_proj.weight": ("wq_b.weight", "fp8"),
    "kv_a_proj_with_mqa.weight": ("wkv_a.weight", "fp8"),
    "kv_a_layernorm.weight": ("kv_norm.weight", "bf16"),
    "kv_b_proj.weight": ("wkv_b.weight", "fp8"),
    "o_proj.weight": ("wo.weight", "fp8"),
    "indexer.wq_b.weight": ("indexer.wq_b.weight", "fp8"),
    "indexer.wk.weight": ("indexer.wk.weight", "fp8"),
    "indexer.k_norm.weight": ("indexer.k_norm.weight", "bf16"),
    "indexer.k_norm.bias": ("indexer.k_norm.bias", "bf16"),
    "indexer.weights_proj.weight": ("indexer.weights_proj.weight", "bf16"),
}


# --- writing the layouts -------------------------------------------------------------------


def quantize(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """FP8 E4M3 bytes and E8M0 exponent bytes (one per 128 x 128 tile) of ``w``; each tile's
    exponent is its amax's plus a random shift, so a wrong tile assignment shows."""
    rows, cols = -(-w.shape[0] // TILE), -(-w.shape[1] // TILE)
    exps = np.zeros((rows, cols), np.int32)
    q = np.zeros(w.shape, np.float32)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * TILE : (i + 1) * TILE, j * TILE : (j + 1) * TILE]
            e = int(np.ceil(np.log2(np.abs(tile).max() / 448.0))) + int(rng.integers(0, 3))
            exps[i, j] = e
            q[i * TILE : (i + 1) * TILE, j * TILE : (j + 1) * TILE] = tile / 2.0**e
    return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), (exps + 127).astype(np.uint8)


def dequantize(fp8: np.ndarray, e8m0: np.ndarray) -> np.ndarray:
    """The plain formula: value(FP8) x 2**(exponent byte - 127) of the tile each entry is in."""
    rows = np.arange(fp8.shape[0])[:, None] // TILE
    cols = np.arange(fp8.shape[1])[None, :] // TILE
    scale = 2.0 ** (e8m0.astype(np.float64) - 127)
    return (fp8.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale[rows, cols]).astype(
        np.float32
    )


def encode(value: np.ndarray, storage: str, rng, scale_dtype="e8m0"):
    """Checkpoint tensors of one parameter -> (stored tensors, the exact float32 it stands for)."""
    if storage == "f32":
        return {"": torch.tensor(value)}, value
    if storage == "bf16":
        t = torch.tensor(value).to(torch.bfloat16)
        return {"": t}, t.float().numpy()
    q, e = quantize(value, rng)
    weight = torch.from_numpy(q).view(torch.float8_e4m3fn)
    if scale_dtype == "e8m0":
        scale = torch.from_numpy(e).view(torch.float8_e8m0fnu)
    else:  # V3.2: float32 power-of-two scales
        scale = torch.tensor(2.0 ** (e.astype(np.float64) - 127), dtype=torch.float32)
    return {"": weight, "scale": scale}, dequantize(q, e)


def write_shards(folder, tensors: dict, n_shards: int, config: dict, index=True):
    """Tensors spread round-robin over ``n_shards`` files (a layer spans several), plus
    ``config.json`` and (optionally) the index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    files = [f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors" for k in range(n_shards)]
    weight_map = {name: files[i % n_shards] for i, name in enumerate(names)}
    for file in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(folder / file))
    if index:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def v4_layer_config(layer_idx: int) -> V4AttentionConfig:
    return tiny_v4(V4_KINDS[layer_idx], **V4_OVERRIDES)


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory):
    """A 3-layer V4 checkpoint in the released layout; returns the folder, the HF reference
    layers (holding the dequantised weights) and the native names of every tensor."""
    rng = np.random.default_rng(0)
    tensors, references = {}, []
    for i in range(3):
        cfg = v4_layer_config(i)
        hf_cfg = hf_v4_config(cfg)
        hf_layer = random_hf_v4_layer(hf_cfg, seed=i)
        sd = {k: v.detach().numpy() for k, v in hf_layer.state_dict().items()}
        table = dict(V4_NATIVE)
        if cfg.layer_type != "sliding":
            table.update(V4_COMPRESSOR)
        if cfg.layer_type == "csa":
            table.update(V4_INDEXER)
        assert {hf for hf, _ in table.values()} == set(sd), "fixture table out of date"
        exact = {}
        for native, (hf, storage) in table.items():
            stored, exact[hf] = encode(sd[hf], storage, rng)
            base = native[: -len(".weight")] if native.endswith(".weight") else native
            for suffix, t in stored.items():
                key = f"layers.{i}.attn.{native}" if not suffix else f"layers.{i}.attn.{base}.scale"
                tensors[key] = t
        hf_layer.load_state_dict({k: torch.tensor(v) for k, v in exact.items()})
        references.append((hf_layer, hf_cfg, exact))
    tensors["embed.weight"] = torch.zeros(64, 160, dtype=torch.bfloat16)  # not attention
    folder = write_shards(tmp_path_factory.mktemp("v4") / "ckpt", tensors, 3, V4_INFERENCE_CONFIG)
    return folder, references, tensors


def test_v4_fixture_is_the_released_layout(v4_release):
    folder, _, _ = v4_release
    header = {}
    for f in sorted(folder.glob("*.safetensors")):
        n = int.from_bytes(f.read_bytes()[:8], "little")
        header.update(json.loads(f.read_bytes()[8 : 8 + n]))
    assert header["layers.1.attn.wq_b.weight"]["dtype"] == "F8_E4M3"
    assert header["layers.1.attn.wq_b.scale"] == {
        "dtype": "F8_E8M0",
        "shape": [2, 1],  # 192 x 48 weight: a full and a ragged (64-row) tile
        "data_offsets": header["layers.1.attn.wq_b.scale"]["data_offsets"],
    }
    assert header["layers.1.attn.indexer.compressor.wkv.weight"]["dtype"] == "BF16"
    assert header["layers.1.attn.attn_sink"]["dtype"] == "F32"
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({index[k] for k in index if k.startswith("layers.1.")}) == 3  # spans 3 shards


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_v4_release_matches_the_dequantised_layer(v4_release, layer_idx):
    folder, references, _ = v4_release
    hf_layer, hf_cfg, exact = references[layer_idx]
    layer = load_v4_attention_from_safetensors(folder, layer_idx)
    assert layer.config == v4_layer_config(layer_idx)  # native keys read as intended
    # FP8 x E8M0 tiles are applied exactly (powers of two): bitwise equal to the formula
    np.testing.assert_array_equal(np.asarray(layer.block.q_b_proj), exact["q_b_proj.weight"])
    np.testing.assert_array_equal(np.asarray(layer.block.o_b_proj), exact["o_b_proj.weight"])
    x = np.random.default_rng(layer_idx).normal(size=(2, 40, 160)).astype(np.float32)
    want = run_hf_v4(hf_layer, hf_cfg, x)[0]
    got = np.asarray(jax.jit(lambda m, x: m(x))(layer, x))
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def test_v4_hub_config_keys_give_the_same_layers(v4_release, tmp_path):
    folder, _, _ = v4_release
    hub = _variant(folder, tmp_path, V4_HUB_CONFIG)
    for i in range(3):
        assert load_v4_attention_from_safetensors(hub, i).config == v4_layer_config(i)


@pytest.fixture(scope="module")
def v32_release(tmp_path_factory):
    """A 2-layer V3.2 checkpoint twice: the Hub layout (HF names, float32 scales, HF config)
    and convert.py's (native names, ``.scale``, inference config)."""
    rng = np.random.default_rng(1)
    hf_cfg = hf_v32_config(V32_CONFIG, num_hidden_layers=2)
    hub, native, references = {}, {}, []
    for i in range(2):
        hf_layer = random_hf_v32_layer(hf_cfg, seed=i)
        sd = {k: v.detach().numpy() for k, v in hf_layer.state_dict().items()}
        assert set(V32_NAMES) == set(sd), "fixture table out of date"
        exact = {}
        for hf, (nat, storage) in V32_NAMES.items():
            stored, exact[hf] = encode(sd[hf], storage, rng, scale_dtype="f32")
            hub[f"model.layers.{i}.self_attn.{hf}"] = stored[""]
            native[f"layers.{i}.attn.{nat}"] = stored[""]
            if "scale" in stored:
                hub[f"model.layers.{i}.self_attn.{hf}_scale_inv"] = stored["scale"]
                native[f"layers.{i}.attn.{nat[: -len('.weight')]}.scale"] = stored["scale"]
        hf_layer.load_state_dict({k: torch.tensor(v) for k, v in exact.items()})
        references.append((hf_layer, exact))
    hub_config = dict(hf_cfg.to_dict(), quantization_config={"weight_block_size": [TILE, TILE]})
    root = tmp_path_factory.mktemp("v32")
    folders = {
        "hub": write_shards(root / "hub", hub, 2, hub_config),
        "native": write_shards(root / "native", native, 2, V32_INFERENCE_CONFIG),
    }
    return folders, references, hf_cfg


@pytest.mark.parametrize("layout", ["hub", "native"])
def test_v32_release_matches_the_dequantised_layer(v32_release, layout):
    folders, references, hf_cfg = v32_release
    hf_layer, exact = references[1]
    layer = load_v32_attention_from_safetensors(folders[layout], 1)
    assert layer.config == V32_CONFIG
    np.testing.assert_array_equal(np.asarray(layer.o_proj), exact["o_proj.weight"])
    x = np.random.default_rng(5).normal(size=(1, 24, 160)).astype(np.float32)
    want = run_hf_v32(hf_layer, hf_cfg, x)[0]
    got = np.asarray(jax.jit(lambda m, x: m(x))(layer, x))
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


# --- what a wrong folder gets ----------------------------------------------------------------


def _variant(folder, tmp_path, config=None, *, index=True, skip=()):
    """A copy of ``folder`` (shards linked) with another config.json / without the index."""
    out = tmp_path / "variant"
    out.mkdir()
    for f in folder.iterdir():
        if f.name in skip or (f.name == "model.safetensors.index.json" and not index):
            continue
        if f.name == "config.json" and config is not None:
            (out / f.name).write_text(json.dumps(config))
        else:
            (out / f.name).symlink_to(f)
    return out


def test_config_schedule_that_does_not_match_the_weights(v4_release, tmp_path):
    folder, _, _ = v4_release
    swapped = dict(V4_INFERENCE_CONFIG, compress_ratios=[4, 0, 8, 0])
    bad = _variant(folder, tmp_path, swapped)
    with pytest.raises(ValueError, match=r"layer 1 a 'sliding' layer.*a 'csa' layer's"):
        load_v4_attention_from_safetensors(bad, 1)  # CSA weights, config says sliding
    with pytest.raises(ValueError, match=r"layer 0 a 'csa' layer.*a 'sliding' layer's"):
        load_v4_attention_from_safetensors(bad, 0)


@pytest.mark.parametrize("layer_idx", [-1, 3, True])
def test_layer_idx_out_of_range(v4_release, layer_idx):
    folder, _, _ = v4_release
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 3\).*config.json"):
        load_v4_attention_from_safetensors(folder, layer_idx)


def test_missing_config_key_is_named(v4_release, tmp_path):
    folder, _, _ = v4_release
    config = {k: v for k, v in V4_HUB_CONFIG.items() if k != "head_dim"}
    bad = _variant(folder, tmp_path, config)
    with pytest.raises(ValueError, match=r"config.json lacks the key 'head_dim'"):
        load_v4_attention_from_safetensors(bad, 0)


def test_unknown_layer_kind_is_named(v4_release, tmp_path):
    folder, _, _ = v4_release
    types = ["sliding_attention", "full_attention", "heavily_compressed_attention"]
    config = dict(V4_HUB_CONFIG, layer_types=types)
    with pytest.raises(ValueError, match=r"layer_types\[1\] = 'full_attention'"):
        load_v4_attention_from_safetensors(_variant(folder, tmp_path, config), 1)


def test_folder_without_config(v4_release, tmp_path):
    folder, _, _ = v4_release
    with pytest.raises(ValueError, match=r"has no config.json"):
        load_v4_attention_from_safetensors(_variant(folder, tmp_path, skip={"config.json"}), 0)
    with pytest.raises(ValueError, match=r"does not exist"):
        load_v4_attention_from_safetensors(tmp_path / "nowhere", 0)


def test_corrupt_config_json(v4_release, tmp_path):
    folder, _, _ = v4_release
    bad = _variant(folder, tmp_path, skip={"config.json"})
    (bad / "config.json").write_text('{"dim": 160,')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_v4_attention_from_safetensors(bad, 0)


def _copy(folder, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def _shard_of(folder, name):
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return folder / index[name]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:5], r"truncated safetensors file \(5 bytes"),
        (lambda b: b"", r"truncated safetensors file \(0 bytes"),
        (lambda b: b[:-4], r"run past the end of the data"),
        (lambda b: b[:8] + b"#" + b[9:], r"corrupt safetensors header \(not JSON"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], r"header length 1000000000 bytes"),
    ],
    ids=["truncated-header", "empty", "truncated-data", "corrupt-header", "bad-length"],
)
def test_damaged_shard_is_named(v4_release, tmp_path, damage, message):
    folder, _, _ = v4_release
    bad = _copy(folder, tmp_path)
    shard = _shard_of(bad, "layers.1.attn.wq_a.weight")
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(SafetensorsError, match=message) as info:
        load_v4_attention_from_safetensors(bad, 1)
    assert str(shard) in str(info.value)


def _raw_file(path, header: dict, data: bytes):
    """A .safetensors file written byte by byte (for entries the package refuses to write)."""
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def test_entry_whose_bytes_do_not_match_its_shape(tmp_path):
    _raw_file(
        tmp_path / "x.safetensors",
        {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}},
        bytes(20),
    )
    with pytest.raises(SafetensorsError, match=r"x.safetensors: tensor 'w'.*needs 24"):
        read_safetensors(tmp_path / "x.safetensors")


def test_unsupported_dtype_is_named(tmp_path):
    _raw_file(
        tmp_path / "x.safetensors",
        {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
        bytes(1),
    )
    with pytest.raises(SafetensorsError, match=r"x.safetensors: tensor 'w'.*dtype 'F4'"):
        read_safetensors(tmp_path / "x.safetensors")


def test_stray_shard_without_index_is_an_error(v4_release, tmp_path):
    """Without an index a second copy of a tensor must not silently win."""
    folder, _, tensors = v4_release
    bad = _variant(folder, tmp_path, index=False)
    # without the stray copy, the index-less folder loads (every tensor is stored once)
    load_v4_attention_from_safetensors(bad, 2)
    stale = {"layers.1.attn.wq_a.weight": tensors["layers.1.attn.wq_a.weight"]}
    save_file(stale, str(bad / "model-old.safetensors"))
    with pytest.raises(ValueError, match=r"stored more than once.*'q_a_proj.weight'.*model-old"):
        load_v4_attention_from_safetensors(bad, 1)


def test_index_naming_a_missing_shard(v4_release, tmp_path):
    folder, _, _ = v4_release
    shard = _shard_of(folder, "layers.1.attn.wq_a.weight")
    bad = _variant(folder, tmp_path, skip={shard.name})
    with pytest.raises(ValueError, match=rf"maps tensors to {shard.name}, which is missing"):
        load_v4_attention_from_safetensors(bad, 1)


def test_index_that_disagrees_with_the_shards(v4_release, tmp_path):
    folder, _, _ = v4_release
    bad = _copy(folder, tmp_path)
    index_file = bad / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    right = index["weight_map"]["layers.1.attn.wq_a.weight"]
    wrong = next(f for f in set(index["weight_map"].values()) if f != right)
    index["weight_map"]["layers.1.attn.wq_a.weight"] = wrong
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"assigns 'layers.1.attn.wq_a.weight' to {wrong}"):
        load_v4_attention_from_safetensors(bad, 1)
    index_file.write_text('{"weight_map": ')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not valid JSON"):
        load_v4_attention_from_safetensors(bad, 1)
    index_file.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index.json lacks a 'weight_map'"):
        load_v4_attention_from_safetensors(bad, 1)


def test_inference_config_takes_deepseeks_defaults_and_refuses_unknown_keys(v4_release, tmp_path):
    """As DeepSeek's ``ModelArgs(**config)``: an omitted key takes its default, an unknown key
    is refused (here named, with the known keys)."""
    folder, _, _ = v4_release
    config = {k: v for k, v in V4_INFERENCE_CONFIG.items() if k != "window_size"}
    layer = load_v4_attention_from_safetensors(_variant(folder, tmp_path, config), 0)
    assert layer.config.sliding_window == 128  # ModelArgs.window_size
    (tmp_path / "typo").mkdir()
    (tmp_path / "v32").mkdir()
    config = dict(V4_INFERENCE_CONFIG, windw_size=8)
    with pytest.raises(ValueError, match=r"\['windw_size'\] are not keys of DeepSeek's V4"):
        load_v4_attention_from_safetensors(_variant(folder, tmp_path / "typo", config), 0)
    with pytest.raises(ValueError, match=r"'kv_lora_rank'.* are not keys of DeepSeek's V4"):
        load_v4_attention_from_safetensors(
            _variant(folder, tmp_path / "v32", V32_INFERENCE_CONFIG), 0
        )


def test_extra_tensor_of_the_layer_is_named(v4_release, tmp_path):
    folder, _, _ = v4_release
    bad = _copy(folder, tmp_path)
    save_file({"layers.1.attn.wq_c.weight": torch.zeros(2, 2)}, str(bad / "extra.safetensors"))
    index_file = bad / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["layers.1.attn.wq_c.weight"] = "extra.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"unexpected tensor.*extra.safetensors: layers.1.attn.wq_c"
    ):
        load_v4_attention_from_safetensors(bad, 1)


def _rewrite(folder, name, value):
    """Replace one tensor in its shard (of a copy of the checkpoint)."""
    shard = _shard_of(folder, name)
    tensors = load_file(str(shard))
    tensors[name] = value
    save_file(tensors, str(shard))


def test_nan_e8m0_scale_is_named(v4_release, tmp_path):
    folder, _, tensors = v4_release
    bad = _copy(folder, tmp_path)
    scale = tensors["layers.1.attn.wkv.scale"].view(torch.uint8).clone()
    scale[0, 0] = 0xFF  # E8M0 NaN
    _rewrite(bad, "layers.1.attn.wkv.scale", scale.view(torch.float8_e8m0fnu))
    with pytest.raises(ValueError, match=r"layers.1.attn.wkv.scale.*1 non-finite"):
        load_v4_attention_from_safetensors(bad, 1)


def test_scale_grid_of_the_wrong_shape_is_named(v4_release, tmp_path):
    folder, _, _ = v4_release
    bad = _copy(folder, tmp_path)
    wrong = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _rewrite(bad, "layers.1.attn.wq_b.scale", wrong)
    with pytest.raises(ValueError, match=r"wq_b.scale.*shape \(1, 1\), expected \(2, 1\)"):
        load_v4_attention_from_safetensors(bad, 1)
