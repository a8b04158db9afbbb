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
