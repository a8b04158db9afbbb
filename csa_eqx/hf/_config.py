"""Model configs -> layer configs: HF ``config.json`` keys or DeepSeek's inference keys.

Private to ``csa_eqx.hf``. Every missing or invalid key is a ``ValueError`` naming the source
(``config`` or the ``config.json`` path) and the key.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._config import V4AttentionConfig, V32AttentionConfig, YaRNScaling

_LAYER_KINDS = {  # HF layer type -> csa_eqx layer kind
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
# DeepSeek's inference config.json keys (``inference/config.json``) -> the HF config's keys
_NATIVE_KEYS = {
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_layers": "num_hidden_layers",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "norm_eps": "rms_norm_eps",
}
DEFAULT_BLOCK = (128, 128)  # DeepSeek's FP8 tile (``quantization_config.weight_block_size``)

# Every field of DeepSeek's ``ModelArgs`` (``inference/model.py``) with its default, per family.
# DeepSeek's ``generate.py`` builds ``ModelArgs(**config)``: a key the config omits takes the
# default, any other key is refused. The keys of the rest of the model (MoE, vocabulary,
# hyper-connections) and the storage / inference-numerics keys (``dtype``, ``scale_fmt``, ...)
# do not change the exact attention layer; they are checked as keys and not read further.
_V32_MODEL_ARGS = {  # DeepSeek-V3.2-Exp
    "max_batch_size": 8, "max_seq_len": 4096 * 4, "dtype": "bf16", "scale_fmt": None,
    "vocab_size": 102400, "dim": 2048, "inter_dim": 10944, "moe_inter_dim": 1408,
    "n_layers": 27, "n_dense_layers": 1, "n_heads": 16, "n_routed_experts": 64,
    "n_shared_experts": 2, "n_activated_experts": 6, "n_expert_groups": 1,
    "n_limited_groups": 1, "score_func": "softmax", "route_scale": 1.0, "q_lora_rank": 0,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "original_seq_len": 4096, "rope_theta": 10000.0, "rope_factor": 40, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 2048,
}  # fmt: skip
_V4_MODEL_ARGS = {  # DeepSeek-V4-Flash and V4-Pro
    "max_batch_size": 4, "max_seq_len": 4096, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": None, "scale_dtype": "fp8", "vocab_size": 129280, "dim": 4096,
    "moe_inter_dim": 4096, "n_layers": 7, "n_hash_layers": 0, "n_mtp_layers": 1,
    "n_heads": 64, "n_routed_experts": 8, "n_shared_experts": 1, "n_activated_experts": 2,
    "score_func": "sqrtsoftplus", "route_scale": 1.0, "swiglu_limit": 0.0,
    "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64, "norm_eps": 1e-6,
    "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0], "compress_rope_theta": 40000.0,
    "original_seq_len": 0, "rope_theta": 10000.0, "rope_factor": 40, "beta_fast": 32,
    "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
}  # fmt: skip


# The keys an HF config may hold (besides those the loaders read): transformers' own
# ``PretrainedConfig`` fields (those of recent and of older releases) and the rest of the model
# (MoE, vocabulary, generation) in transformers' ``DeepseekV32Config`` / ``DeepseekV4Config``
# and in DeepSeek's released ``config.json`` files. They do not change the attention layer.
_HF_COMMON_KEYS = frozenset((
    "_attn_implementation_autoset", "_commit_hash", "_name_or_path", "add_cross_attention",
    "architectures", "attention_bias", "attention_dropout", "auto_map", "bad_words_ids",
    "begin_suppress_tokens", "bos_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample",
    "dtype", "early_stopping", "encoder_no_repeat_ngram_size", "eos_token_id",
    "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "hidden_act", "hidden_size", "id2label", "index_head_dim",
    "index_n_heads", "index_topk", "initializer_range", "intermediate_size", "is_decoder",
    "is_encoder_decoder", "label2id", "layer_types", "length_penalty", "max_length",
    "max_position_embeddings", "min_length", "mlp_bias", "mlp_layer_types", "model_type",
    "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "no_repeat_ngram_size",
    "norm_topk_prob", "num_attention_heads", "num_beam_groups", "num_beams",
    "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
    "num_nextn_predict_layers", "num_return_sequences", "output_attentions",
    "output_hidden_states", "output_router_logits", "output_scores", "pad_token_id", "prefix",
    "pretraining_tp", "problem_type", "pruned_heads", "q_lora_rank", "qk_rope_head_dim",
    "quantization_config", "remove_invalid_values", "repetition_penalty", "return_dict",
    "return_dict_in_generate", "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta",
    "routed_scaling_factor", "scoring_func", "sep_token_id", "suppress_tokens",
    "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder",
    "tie_word_embeddings", "tokenizer_class", "top_k", "top_p", "torch_dtype", "torchscript",
    "transformers_version", "typical_p", "use_bfloat16", "use_cache", "vocab_size"
))  # fmt: skip
_HF_KNOWN_KEYS = {
    "V4": _HF_COMMON_KEYS | frozenset((
        "compress_rate_csa", "compress_rate_hca", "compress_rates", "compress_ratios",
        "compress_rope_theta", "hc_eps", "hc_mult", "hc_sinkhorn_iters", "head_dim",
        "o_groups", "o_lora_rank", "partial_rotary_factor", "router_aux_loss_coef",
        "router_jitter_noise", "sliding_window", "swiglu_limit"
    )),
    "V3.2": _HF_COMMON_KEYS | frozenset((
        "aux_loss_alpha", "ep_size", "first_k_dense_replace", "head_dim", "kv_lora_rank",
        "moe_layer_freq", "n_group", "qk_head_dim", "qk_nope_head_dim", "seq_aux",
        "topk_group", "topk_method", "v_head_dim"
    )),
}  # fmt: skip


def _closest(key: str, known) -> str:
    """`` (did you mean 'x'?)`` for the known key closest to ``key`` (``difflib``), or ``""``."""
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_known_keys(d: Mapping, family: str, source: str, strict: bool) -> None:
    """Name every key of the HF config ``d`` that no ``family`` ("V4" / "V3.2") config holds,
    each with the closest known key: a misspelt optional key (``rope_thta``) would otherwise
    load its default silently. DeepSeek's inference keys are checked by ``_model_args``.

    **Arguments:** the config dict ``d``, its ``family``, the ``source`` errors name, and
    ``strict``: raise a ``ValueError`` instead of warning (``UserWarning``).

    **Returns:** ``None``.
    """
    known = _HF_KNOWN_KEYS[family]
    unknown = sorted(set(d) - known)
    if not unknown:
        return
    message = (
        f"{source}: {', '.join(repr(k) + _closest(k, known) for k in unknown)} "
        f"{'is not a key' if len(unknown) == 1 else 'are not keys'} of a DeepSeek-{family} "
        f"config; csa_eqx does not read {'it' if len(unknown) == 1 else 'them'}"
    )
    if strict:
        raise ValueError(message)
    warnings.warn(message + " (strict=True makes this an error)", stacklevel=2)


def as_dict(config: Any) -> dict:
    """A transformers config object or a mapping as a plain dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers config or a dict, got {type(config).__name__}")


def _is_native(d: dict) -> bool:
    """DeepSeek's inference keys (``dim``, ``n_heads``, ...) rather than HF's (``hidden_size``)."""
    return "dim" in d and "hidden_size" not in d


def _model_args(d: dict, defaults: dict, family: str, source: str) -> dict:
    """``d`` completed with DeepSeek's ``ModelArgs`` defaults; an unknown key is an error."""
    unknown = sorted(set(d) - set(defaults))
    if unknown:
        hints = "".join(f"; {k!r}{_closest(k, defaults)}" for k in unknown if _closest(k, defaults))
        raise ValueError(
            f"{source}: {unknown} are not keys of DeepSeek's {family} inference config "
            f"(its ModelArgs refuses them too{hints}); known keys: {sorted(defaults)}"
        )
    return {**defaults, **d}


def _native_yarn(args: dict, mscale: float | None) -> dict:
    """The HF ``rope_scaling`` entry that DeepSeek's ``precompute_freqs_cis`` amounts to."""
    return {
        "type": "yarn",
        "factor": args["rope_factor"],
        "original_max_position_embeddings": args["original_seq_len"],
        "beta_fast": args["beta_fast"],
        "beta_slow": args["beta_slow"],
        # V3.2: softmax factor (0.1·mscale·ln(factor) + 1)², nothing on cos / sin (equal mscales)
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


def _hf_view(args: dict, rope_scaling: dict | None) -> dict:
    out = {_NATIVE_KEYS.get(k, k): v for k, v in args.items()}
    if rope_scaling is not None:
        out["rope_scaling"] = rope_scaling
    return out


def _from_native_v4(d: dict, source: str) -> dict:
    """HF-keyed view of a V4 config. DeepSeek's inference keys are completed with V4's
    ``ModelArgs`` defaults (``compress_rope_theta`` 40000, ``original_seq_len`` 0, ...); YaRN
    is on when ``original_seq_len > 0`` (on the compressed layers, as in DeepSeek's code). An
    HF config is returned unchanged."""
    if not _is_native(d):
        return d
    args = _model_args(d, _V4_MODEL_ARGS, "V4", source)
    on = _int(args, "original_seq_len", source) > 0
    return _hf_view(args, _native_yarn(args, None) if on else None)


def _from_native_v32(d: dict, source: str) -> dict:
    """HF-keyed view of a V3.2 config. DeepSeek's inference keys are completed with V3.2's
    ``ModelArgs`` defaults (``max_seq_len`` 16384, ``original_seq_len`` 4096, ``rope_factor``
    40, ``mscale`` 1, ...); YaRN is on when ``max_seq_len > original_seq_len``, and then the
    softmax scale carries ``mscale``. An HF config is returned unchanged."""
    if not _is_native(d):
        return d
    args = _model_args(d, _V32_MODEL_ARGS, "V3.2", source)
    on = _int(args, "max_seq_len", source) > _int(args, "original_seq_len", source)
    mscale = _float(args, "mscale", source)
    if on and mscale <= 0:  # HF's YaRN reads a zero mscale as "unset": not the same model
        raise ValueError(f"{source}: 'mscale' must be > 0 when YaRN is on (got {mscale!r})")
    return _hf_view(args, _native_yarn(args, mscale) if on else None)


def v4_scale_fmt(d: dict, source: str) -> str | None:
    """The activation scale format of DeepSeek's V4 inference for this config: DeepSeek's
    rule (``"ue8m0"`` when ``scale_dtype`` is ``"fp8"``, its default, else ``scale_fmt``) for
    its own keys, ``quantization_config.scale_fmt`` for an HF config."""
    if not _is_native(d):
        return (d.get("quantization_config") or {}).get("scale_fmt")
    args = _model_args(d, _V4_MODEL_ARGS, "V4", source)
    return "ue8m0" if args["scale_dtype"] == "fp8" else args["scale_fmt"]


def v32_scale_fmt(d: dict, source: str) -> str | None:
    """As ``v4_scale_fmt`` for V3.2 (DeepSeek's ``scale_fmt``, default ``None``)."""
    if not _is_native(d):
        return (d.get("quantization_config") or {}).get("scale_fmt")
    return _model_args(d, _V32_MODEL_ARGS, "V3.2", source)["scale_fmt"]


def _need(d: Mapping, key: str, source: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{source} lacks the key {key!r}, needed to build the layer")
    return d[key]


def _int(d: Mapping, key: str, source: str) -> int:
    v = _need(d, key, source)
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v):
        raise ValueError(f"{source}: {key!r} must be an int (got {v!r})")
    return int(v)


def _float(d: Mapping, key: str, source: str, default: float | None = None) -> float:
    v = d.get(key, default) if default is not None else _need(d, key, source)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{source}: {key!r} must be a number (got {v!r})")
    return float(v)


def _yarn(params: Mapping | None, source: str) -> YaRNScaling | None:
    """``YaRNScaling`` of an HF ``rope_scaling`` / ``rope_parameters`` entry; None if default."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"{source}: rope type {kind!r} is not supported (only 'default', 'yarn')")
    if params.get("attention_factor") not in (None, 1.0):
        raise ValueError(f"{source}: an explicit YaRN attention_factor is not supported")
    where = f"{source} (rope scaling)"
    return YaRNScaling(
        factor=_float(params, "factor", where),
        original_max_position_embeddings=_int(params, "original_max_position_embeddings", where),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _check_layer_idx(layer_idx: Any, n_layers: int, source: str) -> None:
    ok = isinstance(layer_idx, int | np.integer) and not isinstance(layer_idx, bool)
    if not ok or not 0 <= layer_idx < n_layers:
        raise ValueError(
            f"layer_idx must be an int in [0, {n_layers}) for the {n_layers} layers of "
            f"{source} (got {layer_idx!r})"
        )


def _v4_layer_rate(d: dict, layer_idx: int, source: str) -> int:
    """Compression rate of layer ``layer_idx`` from ``layer_types`` (+ ``compress_rates``) or
    DeepSeek's ``compress_ratios`` list (which may hold one more entry, for the MTP layer)."""
    types, ratios = d.get("layer_types"), d.get("compress_ratios")
    schedule = types if types is not None else ratios
    if schedule is None:
        raise ValueError(
            f"{source} has neither 'layer_types' nor 'compress_ratios' (the per-layer schedule "
            "of sliding / CSA / HCA layers)"
        )
    n_layers = d.get("num_hidden_layers")
    n_layers = len(schedule) if n_layers is None else int(n_layers)
    _check_layer_idx(layer_idx, n_layers, source)
    key = "layer_types" if types is not None else "compress_ratios"
    if layer_idx >= len(schedule):
        raise ValueError(f"{source}: {key!r} lists {len(schedule)} layers, fewer than {n_layers}")
    entry = schedule[layer_idx]
    if types is not None:
        if entry not in _LAYER_KINDS:
            raise ValueError(
                f"{source}: layer_types[{layer_idx}] = {entry!r} is not a DeepSeek-V4 layer kind "
                f"(expected one of {sorted(_LAYER_KINDS)})"
            )
        if entry == "sliding_attention":
            return 0
        legacy = {  # older HF configs give the two rates as scalars
            "compressed_sparse_attention": d.get("compress_rate_csa"),
            "heavily_compressed_attention": d.get("compress_rate_hca"),
        }
        rates = dict(_DEFAULT_RATES, **{k: v for k, v in legacy.items() if v is not None})
        rates.update(d.get("compress_rates") or {})
        entry = rates[entry]
    if isinstance(entry, bool) or not isinstance(entry, int) or not (entry == 0 or entry >= 4):
        raise ValueError(
            f"{source}: layer {layer_idx}'s compression rate ({key}) is {entry!r}; DeepSeek-V4 "
            "layers use 0 (sliding), 4 (CSA) or a larger int (HCA)"
        )
    return entry


def v4_layer_config(
    d: dict, layer_idx: int, source: str, options: dict, strict: bool = False
) -> V4AttentionConfig:
    """Layer ``layer_idx``'s config from a config dict (HF or inference keys); ``source``
    names the config in errors, ``options`` set or override fields; an HF key no V4 config
    holds is a warning, or with ``strict`` an error (``check_known_keys``)."""
    if not _is_native(d):
        check_known_keys(d, "V4", source, strict)
    d = _from_native_v4(d, source)
    head_dim = _int(d, "head_dim", source)
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = _int(d, "qk_rope_head_dim", source)
    else:
        rope_dim = int(head_dim * _float(d, "partial_rotary_factor", source, 64 / 512))
    rope = d.get("rope_parameters") or {}
    compress_rope = rope.get("compress") if isinstance(rope.get("compress"), dict) else rope
    fields = dict(
        hidden_size=_int(d, "hidden_size", source),
        num_heads=_int(d, "num_attention_heads", source),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=_int(d, "q_lora_rank", source),
        o_groups=_int(d, "o_groups", source),
        o_lora_rank=_int(d, "o_lora_rank", source),
        sliding_window=_int(d, "sliding_window", source),
        compress_rate=_v4_layer_rate(d, layer_idx, source),
        index_n_heads=_int(d, "index_n_heads", source),
        index_head_dim=_int(d, "index_head_dim", source),
        index_topk=_int(d, "index_topk", source),
        rope_theta=_float(d, "rope_theta", source, 10000.0),
        compress_rope_theta=_float(d, "compress_rope_theta", source, 160000.0),
        rope_scaling=_yarn(compress_rope or d.get("rope_scaling"), source),
        rms_norm_eps=_float(d, "rms_norm_eps", source, 1e-6),
    )
    fields.update(options)
    return V4AttentionConfig(**fields)


def v4_config_from_hf(
    config: Any, layer_idx: int, *, strict: bool = False, **options
) -> V4AttentionConfig:
    """The ``V4AttentionConfig`` of layer ``layer_idx`` of a V4 model config.

    **Arguments:**

    - ``config``: a transformers ``DeepseekV4Config`` or its dict, or a dict with DeepSeek's
      inference keys (``dim``, ``n_heads``, ``window_size``, ``compress_ratios``, …), read as
      DeepSeek's V4 ``ModelArgs`` reads them: omitted keys take its defaults
      (``compress_rope_theta`` 40000; YaRN only when ``original_seq_len > 0``), unknown keys
      are refused (docs/hf.md, "DeepSeek's inference config").
    - ``layer_idx``: which layer (its kind comes from ``layer_types`` or ``compress_ratios``).
    - ``strict``: an HF key that no V4 config holds (``rope_thta``) is an error, not a
      warning; either names every such key and the closest known one.
    - ``options``: architecture fields to override (execution options go to the loaders).

    **Returns:** the validated layer config. **Raises:** ``ValueError`` naming a missing or
    unknown key, an out-of-range ``layer_idx`` or an unknown layer kind.
    """
    return v4_layer_config(as_dict(config), layer_idx, "config", options, strict)


def _v32_config(d: dict, source: str, options: dict, strict: bool) -> V32AttentionConfig:
    if not _is_native(d):
        check_known_keys(d, "V3.2", source, strict)
    d = _from_native_v32(d, source)
    if d.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=True is not supported (V3.2 has none)")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    fields = dict(
        hidden_size=_int(d, "hidden_size", source),
        num_heads=_int(d, "num_attention_heads", source),
        q_lora_rank=_int(d, "q_lora_rank", source),
        kv_lora_rank=_int(d, "kv_lora_rank", source),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim", source),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", source),
        v_head_dim=_int(d, "v_head_dim", source),
        index_n_heads=_int(d, "index_n_heads", source),
        index_head_dim=_int(d, "index_head_dim", source),
        index_topk=_int(d, "index_topk", source),
        rope_theta=_float(rope, "rope_theta", source, _float(d, "rope_theta", source, 1e4)),
        rope_scaling=_yarn(rope, source),
        rms_norm_eps=1e-6,
    )
    fields.update(options)
    return V32AttentionConfig(**fields)


def v32_config_from_hf(config: Any, *, strict: bool = False, **options) -> V32AttentionConfig:
    """The ``V32AttentionConfig`` (shared by every layer) of a V3.2 model config.

    **Arguments:**

    - ``config``: a transformers ``DeepseekV32Config`` or its dict, or a dict with DeepSeek's
      inference keys (``dim``, ``n_heads``, ``kv_lora_rank``, …), read as DeepSeek's V3.2
      ``ModelArgs`` reads them: omitted keys take its defaults (YaRN on when ``max_seq_len``
      (16384) exceeds ``original_seq_len`` (4096), factor 40, ``mscale`` 1), unknown keys are
      refused (docs/hf.md, "DeepSeek's inference config").
    - ``strict``: an HF key that no V3.2 config holds is an error, not a warning (as for
      ``v4_config_from_hf``).
    - ``options``: architecture fields to override.

    HF's ``DeepseekV32Attention`` normalises with eps 1e-6 whatever ``rms_norm_eps`` says (as
    DeepSeek's reference does), so ``rms_norm_eps`` is 1e-6 unless ``options`` set it.
    """
    return _v32_config(as_dict(config), "config", options, strict)


def v32_layer_config(
    d: dict, layer_idx: int, source: str, options: dict, strict: bool = False
) -> V32AttentionConfig:
    """The layer config, after checking ``layer_idx`` against ``num_hidden_layers`` / ``n_layers``
    (when the config gives it); unknown HF keys as ``_v32_config`` (``strict``)."""
    n_layers = _from_native_v32(d, source).get("num_hidden_layers")
    if n_layers is not None:
        _check_layer_idx(layer_idx, int(n_layers), source)
    return _v32_config(d, source, options, strict)


def block_size(d: Mapping, source: str) -> tuple[int, int]:
    """FP8 tile of the checkpoint: ``quantization_config.weight_block_size`` or 128 x 128."""
    block = (d.get("quantization_config") or {}).get("weight_block_size")
    if block is None:
        return DEFAULT_BLOCK
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{source}: quantization_config.weight_block_size must be two positive ints "
            f"(got {block!r})"
        )
    return int(block[0]), int(block[1])
