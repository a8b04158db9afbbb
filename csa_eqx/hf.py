"""Load Hugging Face DeepSeek-V4 attention weights (state dicts or safetensors checkpoints).

State-dict keys are the HF attention module's own parameter names (``q_a_proj.weight``,
``compressor.indexer.kv_proj.weight``, …). Checkpoint folders are read with a small safetensors
reader (JSON header + raw bytes, numpy/ml_dtypes only, never pickle) that touches only the
requested layer's tensors.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .execution import Execution
from .v4 import V4Attention
from .v32 import V32Attention

__all__ = [
    "v4_config_from_hf",
    "load_v4_attention",
    "load_v4_attention_from_safetensors",
    "read_safetensors",
]

_LAYER_TYPE_RATE_KEY = {
    "compressed_sparse_attention": "compressed_sparse_attention",
    "heavily_compressed_attention": "heavily_compressed_attention",
}
_LEGACY_RATE_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers config or a dict, got {type(config).__name__}")


def _yarn(params: Mapping | None) -> YaRNScaling | None:
    if not params or params.get("rope_type", params.get("type", "default")) != "yarn":
        return None
    return YaRNScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _v4_layer_rate(d: dict, layer_idx: int) -> int:
    rates = dict(d.get("compress_rates") or {})
    rates.setdefault("compressed_sparse_attention", d.get("compress_rate_csa", 4))
    rates.setdefault("heavily_compressed_attention", d.get("compress_rate_hca", 128))
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        return int(d["compress_ratios"][layer_idx])
    if types is None:
        raise ValueError("config has neither layer_types nor compress_ratios")
    if not 0 <= layer_idx < len(types):
        raise ValueError(f"layer_idx={layer_idx} out of range for {len(types)} layers")
    kind = types[layer_idx]
    return 0 if kind == "sliding_attention" else int(rates[_LAYER_TYPE_RATE_KEY[kind]])


def v4_config_from_hf(config: Any, layer_idx: int, **overrides) -> V4AttentionConfig:
    """Build the ``V4AttentionConfig`` of layer ``layer_idx`` from an HF config (object/dict).

    ``overrides`` replace architecture fields (e.g. ``index_topk=``); execution options belong
    to ``csa_eqx.Execution`` (see ``load_v4_attention``).
    """
    d = _as_dict(config)
    head_dim = int(d["head_dim"])
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * float(d.get("partial_rotary_factor") or 64 / 512))
    rope = d.get("rope_parameters") or {}
    compress_rope = rope.get("compress") if isinstance(rope.get("compress"), dict) else rope
    compress_rope = compress_rope or d.get("rope_scaling")
    fields = dict(
        hidden_size=int(d["hidden_size"]),
        num_heads=int(d["num_attention_heads"]),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(d["q_lora_rank"]),
        o_groups=int(d["o_groups"]),
        o_lora_rank=int(d["o_lora_rank"]),
        sliding_window=int(d["sliding_window"]),
        compress_rate=_v4_layer_rate(d, layer_idx),
        index_n_heads=int(d["index_n_heads"]),
        index_head_dim=int(d["index_head_dim"]),
        index_topk=int(d["index_topk"]),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
        rope_scaling=_yarn(compress_rope),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
    )
    fields.update(overrides)
    return V4AttentionConfig(**fields)


def _to_numpy(name: str, value: Any) -> np.ndarray:
    """Array from numpy / torch / jax; low-precision floats are upcast to float32."""
    if hasattr(value, "detach"):  # torch tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16") or "float8" in str(value.dtype):
            value = value.float()
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype in (ml_dtypes.bfloat16, np.float16) or "float8" in str(arr.dtype):
        arr = arr.astype(np.float32)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"tensor {name!r} has non-float dtype {arr.dtype}")
    return arr


def _is_fp8(value: Any) -> bool:
    return "float8" in str(getattr(value, "dtype", ""))


def _dequantize(name: str, weight: Any, state_dict: Mapping) -> np.ndarray:
    """Upcast, applying DeepSeek's block-wise FP8 ``weight_scale_inv`` when present."""
    w = _to_numpy(name, weight)
    if not _is_fp8(weight):
        return w
    scale_key = name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None
    if scale_key is None or scale_key not in state_dict:
        raise ValueError(
            f"tensor {name!r} is stored as FP8 without its block scale {scale_key!r}; "
            "load a dequantised checkpoint or include the *_scale_inv tensors"
        )
    scale = _to_numpy(scale_key, state_dict[scale_key])
    bo, bi = math.ceil(w.shape[0] / scale.shape[0]), math.ceil(w.shape[1] / scale.shape[1])
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
    return w * full


def _load_tree(module: eqx.Module, names: dict[str, Any], state_dict: Mapping, prefix: str):
    """Replace each leaf named in ``names`` (path -> HF key) with the state-dict tensor."""
    missing = [prefix + k for k in names.values() if prefix + k not in state_dict]
    if missing:
        raise ValueError(f"state dict is missing tensor(s): {', '.join(missing)}")
    for path, key in names.items():
        current = _get_path(module, path)
        value = _dequantize(prefix + key, state_dict[prefix + key], state_dict)
        if value.shape != current.shape:
            raise ValueError(
                f"tensor {prefix + key!r} has shape {value.shape}, expected {tuple(current.shape)}"
            )
        new = jnp.asarray(value, dtype=current.dtype)
        module = eqx.tree_at(lambda m, p=path: _get_path(m, p), module, new)
    return module


def _get_path(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def v4_parameter_names(config: V4AttentionConfig) -> dict[str, str]:
    """Module attribute path -> HF parameter name, for one V4 layer."""
    names = {
        "q_a_proj": "q_a_proj.weight",
        "q_a_norm": "q_a_norm.weight",
        "q_b_proj": "q_b_proj.weight",
        "kv_proj": "kv_proj.weight",
        "kv_norm": "kv_norm.weight",
        "o_a_proj": "o_a_proj.weight",
        "o_b_proj": "o_b_proj.weight",
        "sinks": "sinks",
    }
    compressor = {
        "kv_proj": "kv_proj.weight",
        "gate_proj": "gate_proj.weight",
        "position_bias": "position_bias",
        "kv_norm": "kv_norm.weight",
    }
    if config.layer_type != "sliding":
        names.update({f"compressor.{k}": f"compressor.{v}" for k, v in compressor.items()})
    if config.has_indexer:
        names.update(
            {f"indexer.compressor.{k}": f"compressor.indexer.{v}" for k, v in compressor.items()}
        )
        names["indexer.q_b_proj"] = "compressor.indexer.q_b_proj.weight"
        names["indexer.weights_proj"] = "compressor.indexer.scorer.weights_proj.weight"
    return names


def _execution(execution: Execution | None, options: dict) -> Execution:
    """``execution``, or the one the loaders' keyword ``options`` describe."""
    if execution is not None and options:
        raise ValueError(
            f"pass either execution= or execution keyword options, not both (got {sorted(options)})"
        )
    if execution is not None:
        return execution
    unknown = sorted(set(options) - set(_EXECUTION_OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown loader options {unknown}; expected one of {list(_EXECUTION_OPTIONS)}"
        )
    return Execution.from_options(**options)


_EXECUTION_OPTIONS = tuple(inspect.signature(Execution.from_options).parameters)


def load_v4_attention(
    state_dict: Mapping[str, Any],
    config: Any,
    layer_idx: int,
    *,
    prefix: str = "",
    dtype=jnp.float32,
    execution: Execution | None = None,
    **options,
) -> V4Attention:
    """A ``V4Attention`` holding layer ``layer_idx``'s weights from an HF attention state dict.

    Arguments:
        state_dict: HF attention parameters by name (numpy, torch or JAX arrays).
        config: the HF config (object or dict).
        layer_idx: which layer (its type follows the config's layer schedule).
        prefix: prefix of the names in ``state_dict``.
        dtype: parameter dtype.
        execution: how the layer runs (``csa_eqx.Execution``), or instead
        **options: the keyword options of ``Execution.from_options`` (``qk_head_chunk_size=``,
            ``indexer_key_block=``, ``query_block=``, ``indexer_save_selection=``,
            ``indexer_sharded_topk=``, ``shard_indexer_acts=``, ``indexer_loss=``,
            ``data_axis=``, ``tensor_axis=``).

    Returns:
        The ``V4Attention``. Raises ``ValueError`` naming any missing or mis-shaped tensor.
    """
    ex = _execution(execution, options)
    cfg = v4_config_from_hf(config, layer_idx)
    layer = V4Attention(cfg, key=jax.random.key(0), dtype=dtype, execution=ex)
    return _load_tree(layer, v4_parameter_names(cfg), state_dict, prefix)


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str | Path, keep=lambda name: True) -> dict[str, np.ndarray]:
    """Read the tensors of one ``.safetensors`` file whose names pass ``keep``."""
    out = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__" or not keep(name):
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            f.seek(base + start)
            data = f.read(end - start)
            dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
            out[name] = np.frombuffer(data, dtype=dtype).reshape(info["shape"]).copy()
    return out


# DeepSeek's own checkpoint names (what ``save_pretrained`` writes and the Hub ships) -> the HF
# module's parameter names, applied in order to the part after ``layers.{i}.attn.``.
_NATIVE_V4_RENAMES = [
    (r"^indexer\.compressor\.", "compressor.indexer."),
    (r"^indexer\.weights_proj\.", "compressor.indexer.scorer.weights_proj."),
    (r"^indexer\.wq_b\.", "compressor.indexer.q_b_proj."),
    (r"(^|\.)attn_sink$", r"\1sinks"),
    (r"(^|\.)q_norm\.", r"\1q_a_norm."),
    (r"(^|\.)norm\.", r"\1kv_norm."),
    (r"(^|\.)ape$", r"\1position_bias"),
    (r"(^|\.)wq_a\.", r"\1q_a_proj."),
    (r"(^|\.)wq_b\.", r"\1q_b_proj."),
    (r"(^|\.)wkv\.", r"\1kv_proj."),
    (r"(^|\.)wgate\.", r"\1gate_proj."),
    (r"(^|\.)wo_a\.", r"\1o_a_proj."),
    (r"(^|\.)wo_b\.", r"\1o_b_proj."),
    (r"\.scale$", ".weight_scale_inv"),
]


def native_v4_name(name: str) -> str:
    """HF parameter name of a DeepSeek-native V4 attention tensor name (``wq_a.weight`` …)."""
    for pattern, repl in _NATIVE_V4_RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def _checkpoint_files(folder: Path, prefixes: tuple[str, ...]) -> list[Path]:
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return sorted({folder / f for k, f in weight_map.items() if k.startswith(prefixes)})
    return sorted(folder.glob("*.safetensors"))


def load_v4_attention_from_safetensors(
    path: str | Path, layer_idx: int, *, dtype=jnp.float32, **options
) -> V4Attention:
    """Load layer ``layer_idx``'s attention from an HF checkpoint folder; ``options`` as for
    ``load_v4_attention`` (``execution=`` or its keyword options).

    The folder holds ``config.json`` and one or more ``*.safetensors`` files (with or without
    ``model.safetensors.index.json``). Tensors may use DeepSeek's native names
    (``model.layers.{i}.attn.wq_a.weight``, as written by ``save_pretrained``) or the HF module
    names (``model.layers.{i}.self_attn.q_a_proj.weight``); only that layer's attention tensors
    are read.
    """
    folder = Path(path)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    hf_prefix = f"model.layers.{layer_idx}.self_attn."
    native = (f"model.layers.{layer_idx}.attn.", f"layers.{layer_idx}.attn.")
    prefixes = (hf_prefix, *native)
    files = _checkpoint_files(folder, prefixes)
    if not files:
        raise ValueError(f"no safetensors files for layer {layer_idx} under {folder}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, value in read_safetensors(file, keep=lambda n: n.startswith(prefixes)).items():
            if name.startswith(hf_prefix):
                tensors[name[len(hf_prefix) :]] = value
            else:
                short = name[len(next(p for p in native if name.startswith(p))) :]
                tensors[native_v4_name(short)] = value
    if not tensors:
        raise ValueError(f"no attention tensors for layer {layer_idx} in {folder}")
    return load_v4_attention(tensors, config, layer_idx, dtype=dtype, **options)


# --- DeepSeek-V3.2 (DSA) -------------------------------------------------------------------


__all__ += ["v32_config_from_hf", "v32_parameter_names", "load_v32_attention"]


def v32_config_from_hf(config: Any, **overrides) -> V32AttentionConfig:
    """Build the ``V32AttentionConfig`` (shared by every layer) from an HF config (object/dict).

    HF's ``DeepseekV32Attention`` normalises with eps 1e-6 whatever ``rms_norm_eps`` says (as
    DeepSeek's reference does), so ``rms_norm_eps`` is 1e-6 unless ``overrides`` set it.
    ``overrides`` replace architecture fields.
    """
    d = _as_dict(config)
    if d.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported (released V3.2 models have none)")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'yarn')")
    if rope.get("attention_factor") is not None:
        raise ValueError("an explicit rope attention_factor is not supported")
    fields = dict(
        hidden_size=int(d["hidden_size"]),
        num_heads=int(d["num_attention_heads"]),
        q_lora_rank=int(d["q_lora_rank"]),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        index_n_heads=int(d["index_n_heads"]),
        index_head_dim=int(d["index_head_dim"]),
        index_topk=int(d["index_topk"]),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rope_scaling=_yarn(rope),
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return V32AttentionConfig(**fields)


def v32_parameter_names() -> dict[str, str]:
    """Module attribute path -> HF parameter name, for one V3.2 attention layer."""
    names = {
        n: f"{n}.weight"
        for n in (
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        )
    }
    for n in ("wq_b", "wk", "k_norm", "weights_proj"):
        names[f"indexer.{n}"] = f"indexer.{n}.weight"
    names["indexer.k_norm_bias"] = "indexer.k_norm.bias"
    return names


def load_v32_attention(
    state_dict: Mapping[str, Any],
    config: Any,
    layer_idx: int,
    *,
    prefix: str = "",
    dtype=jnp.float32,
    execution: Execution | None = None,
    **options,
) -> V32Attention:
    """A ``V32Attention`` holding layer ``layer_idx``'s weights from an HF attention state dict.

    Every V3.2 layer is a DSA layer, so ``layer_idx`` only has to be in range. ``execution``
    and ``options`` as for ``load_v4_attention``.

    Returns:
        The ``V32Attention``. Raises ``ValueError`` naming any missing or mis-shaped tensor.
    """
    n_layers = _as_dict(config).get("num_hidden_layers")
    if n_layers is not None and not 0 <= layer_idx < int(n_layers):
        raise ValueError(f"layer_idx={layer_idx} out of range for {n_layers} layers")
    ex = _execution(execution, options)
    cfg = v32_config_from_hf(config)
    layer = V32Attention(cfg, key=jax.random.key(0), dtype=dtype, execution=ex)
    return _load_tree(layer, v32_parameter_names(), state_dict, prefix)
