"""Config values that used to pass validation and fail later: each is now rejected (or, for a
``rope_scaling`` dict, converted) when the config is built, naming the field."""

import math

import jax
import jax.numpy as jnp
import pytest

from csa_eqx import V4Attention, V32Attention, YaRNScaling
from csa_eqx.presets import tiny_v4, tiny_v32


@pytest.mark.parametrize(
    "field, value",
    [("head_dim", 33), ("index_head_dim", 17)],
)
def test_odd_unrotated_channels_are_rejected(field, value):
    """Interleaved RoPE pairs channels: an odd unrotated part used to fail only at call time."""
    with pytest.raises(ValueError, match=rf"^{field} minus rope_dim=8 .* even .*\(got {value}\)"):
        tiny_v4("csa", **{field: value})


def test_odd_v32_dims_are_fine():
    """V3.2 rotates a separate slice (MLA) / the first channels (indexer): no parity rule."""
    cfg = tiny_v32(index_head_dim=17, qk_nope_head_dim=15, v_head_dim=15)
    y = V32Attention(cfg, key=jax.random.key(0))(jnp.ones((1, 12, cfg.hidden_size)))
    assert y.shape == (1, 12, cfg.hidden_size) and bool(jnp.isfinite(y).all())


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0])
@pytest.mark.parametrize("field", ["rms_norm_eps", "rope_theta", "compress_rope_theta"])
def test_float_fields_must_be_finite_and_positive(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number > 0"):
        tiny_v4("hca", **{field: value})


@pytest.mark.parametrize("field", ["rms_norm_eps", "rope_theta"])
def test_v32_float_fields_must_be_finite(field):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number > 0"):
        tiny_v32(**{field: math.inf})


@pytest.mark.parametrize("field", ["factor", "beta_fast", "mscale"])
def test_yarn_fields_must_be_finite(field):
    fields = {"factor": 4.0, "original_max_position_embeddings": 64, field: math.nan}
    with pytest.raises(ValueError, match=rf"rope_scaling.{field} must be a finite number"):
        YaRNScaling(**fields)


def test_rope_scaling_dict_becomes_yarn():
    params = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 16}
    cfg = tiny_v4("csa", rope_scaling=params)
    assert cfg.rope_scaling == YaRNScaling(factor=4.0, original_max_position_embeddings=16)
    hash(cfg)  # still a valid static field
    layer = V4Attention(cfg, key=jax.random.key(0))
    assert layer(jnp.ones((1, 20, cfg.hidden_size))).shape == (1, 20, cfg.hidden_size)
    assert tiny_v32(rope_scaling=params).rope_scaling.factor == 4.0


@pytest.mark.parametrize(
    "value, message",
    [
        ({"factor": 4.0}, r"lacks the key\(s\) \['original_max_position_embeddings'\]"),
        ({"factor": 4.0, "original_max_position_embeddings": 8, "scale": 1}, r"\['scale'\]"),
        ({"type": "linear", "factor": 2.0}, r"given as a dict must be YaRN \(got 'linear'\)"),
    ],
)
def test_bad_rope_scaling_is_named(value, message):
    with pytest.raises(ValueError, match=rf"^rope_scaling .*{message}"):
        tiny_v4("csa", rope_scaling=value)


# --- unknown keys in a loaded config (csa_eqx.hf) --------------------------------------------


def _hf_v4_dict(kind="csa") -> dict:
    from csa_eqx.hf._to_hf import v4_hf_fields

    return dict(model_type="deepseek_v4", **v4_hf_fields([tiny_v4(kind)]))


def test_unknown_hf_keys_warn_with_the_closest_known_key():
    """A misspelt optional key would load its default silently: each unknown key is named, with
    the closest known key where one is close, in one warning; the config is the one without
    them."""
    from csa_eqx.hf import v4_config_from_hf, v32_config_from_hf
    from csa_eqx.hf._to_hf import v32_hf_fields

    clean = _hf_v4_dict()
    with pytest.warns(UserWarning) as record:
        got = v4_config_from_hf({**clean, "rope_thta": 1.0, "rms_eps": 1.0, "zzz": 1}, 0)
    assert got == v4_config_from_hf(clean, 0) == tiny_v4("csa")
    assert len(record) == 1
    message = str(record[0].message)
    assert "'rope_thta' (did you mean 'rope_theta'?)" in message
    assert "'rms_eps' (did you mean 'rms_norm_eps'?)" in message
    assert "'zzz', " not in message and "'zzz' are not keys of a DeepSeek-V4 config" in message
    v32 = dict(model_type="deepseek_v32", **v32_hf_fields(tiny_v32()))
    with pytest.warns(UserWarning, match=r"'kv_lora_rnk' \(did you mean 'kv_lora_rank'\?\) is"):
        assert v32_config_from_hf({**v32, "kv_lora_rnk": 8}) == tiny_v32()


def test_unknown_hf_keys_are_errors_when_strict(tmp_path):
    """``strict=True`` raises instead, from the config functions and the loaders (before any
    tensor is read); a config with only known keys loads without a warning."""
    import json
    import warnings

    from csa_eqx import hf

    with pytest.raises(ValueError, match=r"^config: 'o_grups' \(did you mean 'o_groups'\?\)"):
        hf.v4_config_from_hf({**_hf_v4_dict(), "o_grups": 2}, 0, strict=True)
    layer = V4Attention(tiny_v4("hca"), key=jax.random.key(0))
    folder = hf.save_v4_checkpoint(tmp_path / "ckpt", [layer])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.load_v4_attention_from_safetensors(folder, 0, strict=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_windw": 4}))
    with pytest.raises(ValueError, match=r"config.json: 'sliding_windw' \(did you mean"):
        hf.load_v4_attention_from_safetensors(folder, 0, strict=True)
    with pytest.warns(UserWarning, match="'sliding_windw'") as record:
        hf.load_v4_attention_from_safetensors(folder, 0)
    assert len(record) == 1


def test_unknown_native_keys_suggest_the_closest():
    """DeepSeek's inference keys are refused as its ``ModelArgs`` refuses them; the error now
    suggests the closest key too."""
    from csa_eqx.hf import v4_config_from_hf

    native = {"dim": 64, "n_heads": 4, "head_dim": 32, "windw_size": 8}
    with pytest.raises(ValueError, match=r"\['windw_size'\] .*'windw_size' \(did you mean 'window"):
        v4_config_from_hf(native, 0)
