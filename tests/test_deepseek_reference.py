"""Native DeepSeek configs and weights against DeepSeek's own inference code.

The fixtures in ``tests/fixtures/deepseek/`` hold what DeepSeek's ``inference/model.py``
(V3.2-Exp with its 2025-11-17 indexer-RoPE fix, V4-Flash) computed on the CPU, with exact
plain-torch stand-ins for its GPU kernels: the config dict it was given (``ModelArgs(**config)``,
as its ``generate.py`` does), the layer's weights under DeepSeek's names, the input, the output
and the indexer's selection and scores. ``tests/fixtures/deepseek/README.md`` says how they
were made. Each test writes the weights and the config as a native checkpoint folder and loads
it with csa_eqx's loader, so the native key translation (defaults, YaRN switching, ``mscale``,
``compress_rope_theta``) is what is under test.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from csa_eqx.hf import (
    load_v4_attention_from_safetensors,
    load_v32_attention_from_safetensors,
    v32_config_from_hf,
)

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek"
V32_CASES = ["v32_671b_keys", "v32_no_mscale", "v32_yarn_off", "v32_all_keys"]
V4_LAYERS = [0, 1, 2]  # sliding, CSA (m = 4), HCA (m = 8) of one native config


def _fixture(name: str) -> dict:
    with np.load(FIXTURES / f"{name}.npz") as f:
        return {k: f[k] for k in f.files}


def _native_folder(tmp_path, fx: dict, layer_idx: int) -> Path:
    """DeepSeek's layout: ``layers.{i}.attn.<name>`` tensors + the inference ``config.json``."""
    tensors = {
        f"layers.{layer_idx}.attn.{k[2:]}": torch.tensor(v)
        for k, v in fx.items()
        if k.startswith("w:")
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(str(fx["config_json"]))
    return tmp_path


def _untied(scores: np.ndarray, k: int) -> np.ndarray:
    """``[B, S]``: rows whose k-th and (k+1)-th largest reference scores differ (with fewer
    than k + 1 visible entries a row has no boundary and is untied)."""
    s = -np.sort(-np.where(np.isfinite(scores), scores, -np.inf), axis=-1)
    if s.shape[-1] <= k:
        return np.ones(s.shape[:-1], bool)
    last, nxt = s[..., k - 1], s[..., k]
    with np.errstate(invalid="ignore"):  # -inf - -inf on rows with no boundary
        return ~np.isfinite(nxt) | (np.abs(last - nxt) > 1e-6 * np.abs(last))


def _check(layer, fx):
    """Outputs within 1e-5 and equal selections (as sets of visible entries), on untied rows."""
    y, aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, fx["x"])
    y, want, ref = np.asarray(y), fx["out"], fx["selection"]
    rows = np.ones(want.shape[:2], bool)
    if ref.shape[-1]:
        rows = _untied(fx["index_score"], ref.shape[-1])
        assert rows.mean() > 0.8  # the comparison covers most rows
        ours = np.asarray(aux["selection"])
        for b, t in zip(*np.nonzero(rows), strict=True):
            assert set(ours[b, t][ours[b, t] >= 0]) == set(ref[b, t][ref[b, t] >= 0]), (b, t)
    np.testing.assert_allclose(y[rows], want[rows], rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("case", V32_CASES)
def test_v32_native_config_matches_deepseek(tmp_path, case):
    fx = _fixture(case)
    layer = load_v32_attention_from_safetensors(_native_folder(tmp_path, fx, 0), 0)
    _check(layer, fx)


@pytest.mark.parametrize("layer_idx", V4_LAYERS)
def test_v4_native_config_matches_deepseek(tmp_path, layer_idx):
    fx = _fixture(f"v4_native_layer{layer_idx}")
    assert "compress_rope_theta" not in json.loads(str(fx["config_json"]))  # the default is read
    layer = load_v4_attention_from_safetensors(_native_folder(tmp_path, fx, layer_idx), layer_idx)
    _check(layer, fx)


def test_v32_native_keys_deepseek_cannot_build_are_refused():
    config = json.loads(str(_fixture("v32_671b_keys")["config_json"]))
    with pytest.raises(ValueError, match=r"\['head_dim'\] are not keys of DeepSeek's V3.2"):
        v32_config_from_hf(dict(config, head_dim=32))  # a V4 key
    with pytest.raises(ValueError, match=r"'mscale' must be > 0 when YaRN is on"):
        v32_config_from_hf(dict(config, mscale=0.0))
    assert v32_config_from_hf(dict(config, mscale=0.0, max_seq_len=4096)).rope_scaling is None
