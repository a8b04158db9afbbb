"""V4.1 stack configs: role resolution and the build-time wiring errors (docs/v41.md)."""

import numpy as np
import pytest

import csa_eqx as ce

# the tiny V4.1 sizes of the V4.1 tests
SIZES = dict(
    hidden_size=32, num_heads=4, head_dim=16, rope_dim=8, q_lora_rank=16, o_groups=2,
    o_lora_rank=8, sliding_window=4, index_n_heads=2, index_head_dim=16, index_topk=4,
)  # fmt: skip


def config(**kw):
    base = dict(
        compress_ratios=(0, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 5),
        candidate_source_layer=3,
        candidate_topk_blocks=2,
        candidate_block_size=4,
    )
    return ce.V41AttentionConfig(**{**SIZES, **base, **kw})


def test_roles_and_sources():
    c = config()
    assert [c.role(i) for i in range(c.num_layers)] == [
        "sliding",
        "full",
        "reuse",
        "full",
        "reuse",
        "reindex",
        "reuse",
    ]
    assert [c.kv_source(i) for i in range(7)] == [None, 1, 1, 3, 3, 3, 3]
    assert [c.index_source(i) for i in range(7)] == [None, 1, 1, 3, 3, 5, 5]
    assert [c.uses_candidates(i) for i in range(7)] == [False] * 5 + [True, False]
    assert c.is_candidate_source(3) and not c.is_candidate_source(5)


def test_released_schedule_resolves():
    c = ce.V41AttentionConfig(
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20,
        kv_source_layers=[2, 8, 14, 20],
        index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36],
        candidate_source_layer=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
    )
    roles = [c.role(i) for i in range(40)]
    assert roles[:3] == ["sliding", "sliding", "full"] and roles[20] == "full"
    assert roles.count("reindex") == 4 and roles.count("full") == 4
    assert c.index_source(27) == 24 and c.kv_source(39) == 20
    assert [i for i in range(40) if c.uses_candidates(i)] == [24, 28, 32, 36]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_source_layers=(3,), index_source_layers=(3, 5)), "layer 1 .* no KV source"),
        (dict(kv_source_layers=(1,), index_source_layers=(1, 5)), "ratio 1 but reads .* ratio 2"),
        (dict(index_source_layers=(1, 5)), "layer 3 is a KV source but not an index source"),
        (dict(candidate_source_layer=4), "candidate_source_layer 4 is not an index source"),
        (dict(candidate_topk_blocks=1, candidate_block_size=3), "at least index_topk"),
        (dict(candidate_block_size=0), "candidate_block_size must be > 0"),
        (dict(kv_source_layers=(0, 1, 3)), "layer 0 has compress ratio 0"),
        (dict(index_source_layers=(1, 3, 9)), "layer 9 is not in the stack"),
        (dict(index_source_layers=(1, 3, 3)), "increasing distinct"),
        (dict(candidate_source_layer=1, candidate_topk_blocks=4), "index source 3 uses"),
    ],
)
def test_wiring_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_wiring_error_type():
    with pytest.raises(ce.V41WiringError):
        config(kv_source_layers=(3,), index_source_layers=(3, 5))


def test_no_candidates_needs_no_blocks():
    c = config(candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=0)
    assert not any(c.uses_candidates(i) for i in range(7))


# the attention keys of the released configs (DeepSeek's inference/config.json; transformers'
# config.json text_config), as spec'd in their sources
_RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
_NATIVE = {
    "dim": 5120, "n_layers": 40, "n_mtp_layers": 3, "n_heads": 64, "q_lora_rank": 1280,
    "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "compress_ratios": _RELEASED_RATIOS, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "compress_rope_theta": 160000,
    "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32,
    "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
}  # fmt: skip
_HF_TEXT = {
    "model_type": "deepseek_v41_text", "hidden_size": 5120, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1280,
    "qk_rope_head_dim": 64, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "sliding_window": 128, "compress_ratios": _RELEASED_RATIOS,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "o_groups": 8, "o_lora_rank": 1024,
    "rms_norm_eps": 1e-20, "num_nextn_predict_layers": 3,
}  # fmt: skip


def test_both_config_spellings_agree():
    from csa_eqx.hf import v41_config_from_hf

    native = v41_config_from_hf(_NATIVE)
    hf = v41_config_from_hf({"model_type": "deepseek_v41", "text_config": _HF_TEXT})
    assert native == hf  # HF's unset candidate_source_layer_id is its last KV source (20)
    assert native.num_layers == 40 and native.candidate_source_layer == 20
    assert native.rope_scaling.factor == 16.0
    # DeepSeek's default is no pre-filter
    off = {k: v for k, v in _NATIVE.items() if not k.startswith("candidate")}
    assert v41_config_from_hf(off).candidate_source_layer == -1
    with pytest.raises(ValueError, match="lacks the key 'kv_source_layer_ids'"):
        v41_config_from_hf({k: v for k, v in _HF_TEXT.items() if k != "kv_source_layer_ids"})


def test_loader_names_and_errors():
    import jax

    from csa_eqx.hf import load_v41_attention, v41_parameter_names

    c = config()
    names = [v41_parameter_names(ce.V41Attention(c, i, key=jax.random.key(0))) for i in (1, 3, 5)]
    assert (
        names[0]["entry_source.compressor.key_proj"] == "indexer.wk.weight"
        and "entry_source.compressor.gate_proj" in names[0]
    )
    assert "entry_source.compressor.gate_proj" not in names[1]  # ratio 1 has no gate
    assert set(names[2]) == {
        "block.q_a_proj", "block.q_a_norm", "block.q_b_proj", "block.kv_proj", "block.kv_norm",
        "block.o_a_proj", "block.o_b_proj", "block.sinks", "selection_source.indexer.q_b_proj",
        "selection_source.indexer.weights_proj",
    }  # fmt: skip
    layer = ce.V41Attention(c, 5, key=jax.random.key(1))
    tensors = {f"layers.5.attn.{n}": _get(layer, p) for p, n in names[2].items()}
    loaded = load_v41_attention(c, 5, tensors)
    assert (loaded.indexer.q_b_proj == layer.indexer.q_b_proj).all()
    with pytest.raises(ValueError, match=r"layer 5 \(reindex\) holds no tensors \['indexer.wk"):
        load_v41_attention(c, 5, {**tensors, "layers.5.attn.indexer.wk.weight": 0})
    del tensors["layers.5.attn.attn_sink"]
    with pytest.raises(ValueError, match=r"lacks the tensors \['attn_sink'\]"):
        load_v41_attention(c, 5, tensors)


def _get(module, path):
    for p in path.split("."):
        module = getattr(module, p)
    return module


# a small stack's keys that DeepSeek's ModelArgs has no default for in csa_eqx's reading
_NATIVE_SMALL = {
    "dim": 64, "n_layers": 4, "n_heads": 2, "q_lora_rank": 32, "head_dim": 64,
    "rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 16, "window_size": 8,
    "compress_ratios": [0, 2, 1, 1, 0], "kv_source_layers": [1, 2],
    "index_source_layers": [1, 2, 3], "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4,
}  # fmt: skip
_HF_SMALL = {
    "model_type": "deepseek_v41_text", "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 2, "q_lora_rank": 32, "head_dim": 64, "qk_rope_head_dim": 16,
    "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8, "compress_ratios": [0, 2, 1, 1, 0],
    "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2, 3], "index_n_heads": 2,
    "index_head_dim": 32, "index_topk": 4,
}  # fmt: skip


def _hf_defaults(**fields) -> dict:
    """``_HF_SMALL`` with ModelArgs' defaults spelt out as transformers writes them, and
    ``fields``."""
    defaults = dict(
        rope_theta=10000,
        rms_norm_eps=1e-20,
        candidate_source_layer_id=-1,
        candidate_topk_blocks=0,
        candidate_block_size=0,
    )
    return {**_HF_SMALL, **defaults, **fields}


def test_native_config_takes_modelargs_defaults():
    """DeepSeek's ``inference/config.json`` may omit the keys its ``ModelArgs`` defaults:
    ``compress_rope_theta`` 40000, ``rope_theta`` 10000, ``norm_eps`` 1e-20, no YaRN
    (``original_seq_len`` 0), no candidate pre-filter; transformers' spelling of the same model
    (every key given) is the same stack."""
    from csa_eqx.hf import v41_config_from_hf

    native = v41_config_from_hf(_NATIVE_SMALL)
    assert native.rope_scaling is None and native.compress_rope_theta == 40000.0
    assert (native.rope_theta, native.rms_norm_eps, native.candidate_source_layer) == (
        10000.0,
        1e-20,
        -1,
    )
    hf = _hf_defaults(compress_rope_theta=40000)
    assert v41_config_from_hf(hf) == native
    assert v41_config_from_hf({"model_type": "deepseek_v41", "text_config": hf}) == native


def test_both_spellings_read_non_default_yarn_betas():
    """YaRN with ``beta_fast`` 24 and ``beta_slow`` 2 (not the defaults 32 / 1): DeepSeek's
    ``original_seq_len`` / ``rope_factor`` / ``beta_*`` keys and transformers' ``rope_scaling``
    give the same config, and the compressed layers' RoPE frequencies differ from the default
    betas' (the keys are read, not dropped)."""
    from csa_eqx._rope import rope_inv_freq
    from csa_eqx.hf import v41_config_from_hf

    yarn = {"original_seq_len": 4096, "rope_factor": 8, "beta_fast": 24, "beta_slow": 2}
    native = v41_config_from_hf({**_NATIVE_SMALL, **yarn, "compress_rope_theta": 160000})
    scaling = {
        "rope_type": "yarn",
        "factor": 8,
        "original_max_position_embeddings": 4096,
        "beta_fast": 24,
        "beta_slow": 2,
    }
    hf = _hf_defaults(compress_rope_theta=160000, rope_scaling=scaling)
    assert v41_config_from_hf(hf) == native
    s = native.rope_scaling
    assert (s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow) == (
        8.0,
        4096,
        24.0,
        2.0,
    )
    default = v41_config_from_hf({**_NATIVE_SMALL, **yarn, "beta_fast": 32, "beta_slow": 1})
    freqs = [rope_inv_freq(16, 160000.0, c.rope_scaling) for c in (native, default)]
    assert not np.array_equal(*freqs)
