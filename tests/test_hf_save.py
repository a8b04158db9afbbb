"""``csa_eqx.hf.save_v4_checkpoint`` / ``save_v32_checkpoint`` write a checkpoint folder that the
loaders read back to the same layers (every array bitwise, the same config), without torch; the
safetensors writer's files are what the format says (checked against the ``safetensors``
package's own reader) and what our reader reads."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import csa_eqx as ce
from csa_eqx import hf, presets


def arrays(layer) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(layer, eqx.is_array))]


def assert_same_layer(got, want) -> None:
    assert got.config == want.config
    a, b = arrays(got), arrays(want)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def test_v4_layers_round_trip(tmp_path):
    """A sliding, a CSA and an HCA layer as layers 0..2 of one model: each loads back as itself
    (its kind from ``layer_types`` / ``compress_rates``), and gives the same outputs."""
    keys = jax.random.split(jax.random.key(0), 3)
    kinds = ("sliding", "csa", "hca")
    scaling = ce.YaRNScaling(factor=4.0, original_max_position_embeddings=64)
    layers = [
        ce.V4Attention(presets.tiny_v4(kind, rope_scaling=scaling), key=k)
        for kind, k in zip(kinds, keys, strict=True)
    ]
    folder = hf.save_v4_checkpoint(tmp_path / "v4", layers)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    x = jax.random.normal(jax.random.key(1), (1, 24, layers[0].config.hidden_size))
    for i, layer in enumerate(layers):
        back = hf.load_v4_attention_from_safetensors(folder, layer_idx=i)
        assert_same_layer(back, layer)
        np.testing.assert_array_equal(eqx.filter_jit(back)(x), eqx.filter_jit(layer)(x))


def test_v32_layer_round_trip_in_bf16(tmp_path):
    """bf16 parameters are written as BF16 (norms as float32) and load back with
    ``dtype=jnp.bfloat16`` as the same arrays; the YaRN config survives."""
    scaling = ce.YaRNScaling(factor=4.0, original_max_position_embeddings=64, mscale=1.0)
    config = presets.tiny_v32(rope_scaling=scaling)
    layer = ce.V32Attention(config, key=jax.random.key(2), dtype=jnp.bfloat16)
    folder = hf.save_v32_checkpoint(tmp_path / "v32", [layer, layer])
    stored = load_file(folder / "model.safetensors")  # the safetensors package's own reader
    assert stored["model.layers.1.self_attn.q_a_proj.weight"].dtype == ml_dtypes.bfloat16
    assert stored["model.layers.1.self_attn.q_a_layernorm.weight"].dtype == np.float32
    back = hf.load_v32_attention_from_safetensors(folder, layer_idx=1, dtype=jnp.bfloat16)
    assert_same_layer(back, layer)


def test_safetensors_writer_matches_the_format(tmp_path):
    """Every dtype the reader knows round-trips through our writer and our reader, the
    ``safetensors`` package reads the same bytes, and the data starts 8-byte aligned."""
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "c.i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "d.u8": np.arange(7, dtype=np.uint8),
        "e.empty": np.zeros((0, 3), np.float32),
    }
    path = tmp_path / "t.safetensors"
    hf.write_safetensors(path, tensors)
    ours, theirs = hf.read_safetensors(path), load_file(path)
    for name, want in tensors.items():
        for got in (ours[name], theirs[name]):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0
    with pytest.raises(TypeError, match="'z' has dtype complex64"):
        hf.write_safetensors(path, {"z": np.zeros(2, np.complex64)})


def test_savers_refuse_what_one_checkpoint_cannot_hold(tmp_path):
    base = presets.tiny_v4("csa")
    other = ce.V4Attention(presets.tiny_v4("csa", index_topk=4), key=jax.random.key(0))
    layer = ce.V4Attention(base, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"layers\[1\]'s config differs"):
        hf.save_v4_checkpoint(tmp_path, [layer, other])
    hca = [
        ce.V4Attention(presets.tiny_v4("hca", compress_rate=m), key=jax.random.key(0))
        for m in (8, 16)
    ]
    with pytest.raises(ValueError, match="HCA layers' compress_rate differ"):
        hf.save_v4_checkpoint(tmp_path, hca)
    with pytest.raises(TypeError, match="V32Attention"):
        hf.save_v32_checkpoint(tmp_path, [layer])
