"""Load DeepSeek-V4 / V3.2 attention weights (state dicts or safetensors checkpoint folders).

State-dict keys are the HF attention module's own parameter names (``q_a_proj.weight``,
``compressor.indexer.kv_proj.weight``, …). Checkpoint folders may use those names or
DeepSeek's native ones (``layers.{i}.attn.wq_a.weight`` with ``.scale`` tile scales) and
either the HF ``config.json`` keys or DeepSeek's own inference keys (``dim``, ``n_heads``,
``window_size``, ``compress_ratios``, …). Every mismatch between config, layer and tensors is a
``ValueError`` naming the file / key / tensor with the expected and the actual value
(docs/hf.md lists them).
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .execution import Execution
from .safetensors_io import SafetensorsError, decode_e8m0, read_safetensors, safetensors_header
from .v4 import V4Attention
from .v32 import V32Attention

__all__ = [
    "SafetensorsError",
    "read_safetensors",
    "v4_config_from_hf",
    "v4_parameter_names",
    "native_v4_name",
    "load_v4_attention",
    "load_v4_attention_from_safetensors",
    "v32_config_from_hf",
    "v32_parameter_names",
    "native_v32_name",
    "load_v32_attention",
    "load_v32_attention_from_safetensors",
]

# --- configs ---------------------------------------------------------------------------------

_LAYER_KINDS = {  # HF layer type -> (csa_eqx layer kind, key of its rate in compress_rates)
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


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers config or a dict, got {type(config).__name__}")


def _from_native(d: dict) -> dict:
    """HF-keyed view of a config; DeepSeek's inference keys (``dim``, ``n_heads``, …) are
    renamed and its YaRN keys (``original_seq_len``, ``rope_factor``, …) become
    ``rope_scaling``. An HF config (it has ``hidden_size``) is returned unchanged."""
    if "hidden_size" in d or "dim" not in d:
        return d
    out = {_NATIVE_KEYS.get(k, k): v for k, v in d.items()}
    if int(d.get("original_seq_len") or 0) > 0:
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": d.get("rope_factor"),
            "original_max_position_embeddings": d["original_seq_len"],
            "beta_fast": d.get("beta_fast", 32),
            "beta_slow": d.get("beta_slow", 1),
            # V3.2's softmax factor (0.1·mscale·ln(factor) + 1)², no factor on cos / sin
            "mscale": d.get("mscale"),
            "mscale_all_dim": d.get("mscale"),
        }
    return out


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


def _v4_config(d: dict, layer_idx: int, source: str, options: dict) -> V4AttentionConfig:
    d = _from_native(d)
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


def v4_config_from_hf(config: Any, layer_idx: int, **options) -> V4AttentionConfig:
    """The ``V4AttentionConfig`` of layer ``layer_idx`` of a V4 model config.

    **Arguments:**

    - ``config``: a transformers ``DeepseekV4Config`` or its dict, or a dict with DeepSeek's
      inference keys (``dim``, ``n_heads``, ``head_dim``, ``rope_head_dim``, ``window_size``,
      ``compress_ratios``, ``original_seq_len`` / ``rope_factor`` for YaRN, …).
    - ``layer_idx``: which layer (its kind comes from ``layer_types`` or ``compress_ratios``).
    - ``options``: architecture fields to override (execution options belong to the loaders).

    **Returns:** the validated layer config. **Raises:** ``ValueError`` naming a missing key,
    an out-of-range ``layer_idx`` or an unknown layer kind.
    """
    return _v4_config(_as_dict(config), layer_idx, "config", options)


def _v32_config(d: dict, source: str, options: dict) -> V32AttentionConfig:
    d = _from_native(d)
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


def v32_config_from_hf(config: Any, **options) -> V32AttentionConfig:
    """The ``V32AttentionConfig`` (shared by every layer) of a V3.2 model config.

    **Arguments:**

    - ``config``: a transformers ``DeepseekV32Config`` or its dict, or a dict with DeepSeek's
      inference keys (``dim``, ``n_heads``, ``kv_lora_rank``, ``original_seq_len``,
      ``rope_factor``, ``mscale``, …).
    - ``options``: architecture fields to override.

    HF's ``DeepseekV32Attention`` normalises with eps 1e-6 whatever ``rms_norm_eps`` says (as
    DeepSeek's reference does), so ``rms_norm_eps`` is 1e-6 unless ``options`` set it.
    """
    return _v32_config(_as_dict(config), "config", options)


def _block_size(d: Mapping, source: str) -> tuple[int, int]:
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


# --- tensors ---------------------------------------------------------------------------------


def _dtype_name(value: Any) -> str:
    return str(getattr(value, "dtype", type(value).__name__))


def _to_numpy(name: str, value: Any) -> np.ndarray:
    """Float array from numpy / torch / jax; low-precision floats are upcast to float32 and
    E8M0 scales decoded as ``2**(byte - 127)``."""
    if hasattr(value, "detach"):  # torch tensor, without importing torch up front
        import torch

        value = value.detach().cpu()
        if value.dtype == getattr(torch, "float8_e8m0fnu", None):
            return decode_e8m0(value.view(torch.uint8).numpy())
        if value.dtype in (torch.bfloat16, torch.float16) or "float8" in str(value.dtype):
            value = value.float()
        value = value.numpy()
    arr = np.asarray(value)
    if arr.dtype == ml_dtypes.float8_e8m0fnu:
        return decode_e8m0(arr)
    if arr.dtype in (ml_dtypes.bfloat16, np.float16) or "float8" in str(arr.dtype):
        arr = arr.astype(np.float32)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"tensor {name!r} has non-float dtype {arr.dtype}")
    return arr


def _is_fp8(value: Any) -> bool:
    dtype = _dtype_name(value)
    return "float8" in dtype and "e8m0" not in dtype


def _scale_key(name: str) -> str | None:
    return name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None


def _dequantize(
    name: str, weight: Any, scale: Any, block: tuple[int, int], shown: Callable[[str], str]
) -> np.ndarray:
    """Upcast ``weight``; an FP8 weight is multiplied by its per-tile ``scale`` (DeepSeek's
    ``weight_scale_inv`` / ``.scale``: one entry per ``block`` tile, ragged at the edges)."""
    scale_name = _scale_key(name)
    if not _is_fp8(weight):
        if scale is not None:
            raise ValueError(
                f"tensor {shown(scale_name)!r} is a block scale, but {shown(name)!r} is stored "
                f"as {_dtype_name(weight)}, not FP8"
            )
        return _to_numpy(shown(name), weight)
    if scale is None:
        raise ValueError(
            f"tensor {shown(name)!r} is stored as FP8 without its block scale "
            f"{shown(scale_name)!r}; load a dequantised checkpoint or include the scales"
        )
    w, s = _to_numpy(shown(name), weight), _to_numpy(shown(scale_name), scale)
    grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, block, strict=True))
    if s.shape != grid:
        raise ValueError(
            f"block scale {shown(scale_name)!r} has shape {s.shape}, expected {grid} "
            f"(one per {block[0]}x{block[1]} tile of the {w.shape} weight)"
        )
    if not np.isfinite(s).all():
        raise ValueError(
            f"block scale {shown(scale_name)!r} has {int((~np.isfinite(s)).sum())} non-finite "
            "entries (an E8M0 byte 0xFF is NaN)"
        )
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: w.shape[0], : w.shape[1]]
    return w * full


def _check_names(present: set[str], expected: set[str], where: str, shown) -> None:
    """Every expected tensor present, nothing else (FP8 scales of expected weights allowed)."""
    scales = {_scale_key(n) for n in expected} - {None}
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - scales)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(shown(n) for n in missing)}")
        if unexpected:
            parts.append(
                f"unexpected tensor(s) for this layer: {', '.join(shown(n) for n in unexpected)}"
            )
        raise ValueError(f"{where}: {'; '.join(parts)}")


def _load_tree(
    module: eqx.Module,
    names: dict[str, str],
    tensors: Mapping[str, Any],
    block: tuple[int, int],
    where: str,
    shown: Callable[[str], str],
):
    """Replace each leaf named in ``names`` (path -> HF key) with its (dequantised) tensor."""
    _check_names(set(tensors), set(names.values()), where, shown)
    for path, key in names.items():
        current = _get_path(module, path)
        value = _dequantize(key, tensors[key], tensors.get(_scale_key(key) or ""), block, shown)
        if value.shape != current.shape:
            raise ValueError(
                f"{where}: tensor {shown(key)!r} has shape {value.shape}, "
                f"expected {tuple(current.shape)}"
            )
        if not np.isfinite(value).all():
            raise ValueError(
                f"{where}: tensor {shown(key)!r} has {int((~np.isfinite(value)).sum())} "
                "non-finite values"
            )
        new = jnp.asarray(value, dtype=current.dtype)
        module = eqx.tree_at(lambda m, p=path: _get_path(m, p), module, new)
    return module


def _get_path(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _strip(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}


# --- DeepSeek-V4 -----------------------------------------------------------------------------


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


def _check_v4_kind(cfg: V4AttentionConfig, present: set[str], where: str, layer_idx: int):
    """The layer kind the config names must be the one the tensors hold (compressor, indexer)."""
    indexer = any(n.startswith("compressor.indexer.") for n in present)
    compressor = any(n.startswith("compressor.") for n in present)
    found = "csa" if indexer else "hca" if compressor else "sliding"
    if found != cfg.layer_type:
        raise ValueError(
            f"{where}: the config makes layer {layer_idx} a {cfg.layer_type!r} layer "
            f"(compress_rate={cfg.compress_rate}), but its tensors are a {found!r} layer's "
            f"(compressor: {'yes' if compressor else 'no'}, indexer: "
            f"{'yes' if indexer else 'no'}); the config's layer schedule (layer_types / "
            "compress_ratios) does not match these weights"
        )


_EXECUTION_OPTIONS = frozenset(inspect.signature(Execution.from_options).parameters)


def _split_options(options: dict) -> tuple[dict, Execution]:
    """Loader keyword ``options`` -> (architecture overrides, ``Execution``): ``execution=``
    an ``Execution``, or the keywords of ``Execution.from_options``; anything else overrides a
    config field."""
    overrides = {k: v for k, v in options.items() if k not in _EXECUTION_OPTIONS | {"execution"}}
    flags = {k: v for k, v in options.items() if k in _EXECUTION_OPTIONS}
    execution = options.get("execution")
    if execution is not None and flags:
        raise ValueError(
            f"pass either execution= or the execution keywords {sorted(flags)}, not both"
        )
    return overrides, Execution.from_options(**flags) if execution is None else execution


def _load_v4(tensors, d, layer_idx, *, source, where, shown, dtype, options) -> V4Attention:
    overrides, execution = _split_options(options)
    cfg = _v4_config(d, layer_idx, source, overrides)
    _check_v4_kind(cfg, set(tensors), where, layer_idx)
    layer = V4Attention(cfg, key=jax.random.key(0), dtype=dtype, execution=execution)
    names = v4_parameter_names(cfg)
    return _load_tree(layer, names, tensors, _block_size(d, source), where, shown)


def load_v4_attention(
    state_dict: Mapping[str, Any],
    config: Any,
    layer_idx: int,
    *,
    prefix: str = "",
    dtype=jnp.float32,
    **options,
) -> V4Attention:
    """A ``V4Attention`` holding layer ``layer_idx``'s weights from an HF attention state dict.

    **Arguments:**

    - ``state_dict``: HF attention parameter names -> numpy / torch / JAX arrays; FP8 weights
      come with their ``*.weight_scale_inv`` tile scales (float32 or E8M0).
    - ``config``: the model config (see ``v4_config_from_hf``); its
      ``quantization_config.weight_block_size`` gives the FP8 tile (default 128 x 128).
    - ``layer_idx``: which layer. ``prefix``: stripped from the keys; keys without it are
      ignored (so a whole model's state dict works with ``prefix="model.layers.2.self_attn."``).
    - ``options``: how the layer runs: ``execution=csa_eqx.Execution(...)``, or the keywords
      of ``Execution.from_options`` (``qk_head_chunk_size=``, ``indexer_key_block=``,
      ``query_block=``, ``indexer_save_selection=``, ``indexer_sharded_topk=``,
      ``shard_indexer_acts=``, ``indexer_loss=``, ``data_axis=``, ``tensor_axis=``); any other
      keyword overrides an architecture field of the config.

    **Returns:** the ``V4Attention``.

    **Raises:** ``ValueError`` naming any missing, unexpected, mis-shaped or non-finite tensor,
    and a config whose layer kind does not match the tensors.
    """
    tensors = _strip(state_dict, prefix)
    return _load_v4(
        tensors,
        _as_dict(config),
        layer_idx,
        source="config",
        where=f"state dict of layer {layer_idx}",
        shown=lambda n: prefix + n,
        dtype=dtype,
        options=options,
    )


# DeepSeek's native V4 names -> the HF module's, applied in order to the part after
# ``layers.{i}.attn.`` (transformers' conversion mapping does the same renames).
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


def _rename(name: str, renames: list[tuple[str, str]]) -> str:
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def native_v4_name(name: str) -> str:
    """HF parameter name of a DeepSeek-native V4 attention tensor name (``wq_a.weight`` …)."""
    return _rename(name, _NATIVE_V4_RENAMES)


# --- checkpoint folders ----------------------------------------------------------------------


def _read_config(folder: Path) -> tuple[dict, str]:
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist or is not a directory")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{folder} has no config.json: a checkpoint folder holds config.json (HF keys or "
            "DeepSeek's inference keys) and its *.safetensors files"
        )
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object (got {type(d).__name__})")
    return d.get("text_config", d), str(path)


def _shard_files(folder: Path, wanted: Callable[[str], bool]) -> dict[Path, set[str] | None]:
    """Files to read -> the tensor names the index assigns to them (None without an index)."""
    index_file = folder / "model.safetensors.index.json"
    if not index_file.exists():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no *.safetensors files")
        return dict.fromkeys(files)
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError):
        raise ValueError(
            f"{index_file} is not a safetensors index (a JSON object with a 'weight_map')"
        ) from None
    files: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        if wanted(name):
            files.setdefault(folder / file, set()).add(name)
    for file in files:
        if not file.is_file():
            raise ValueError(f"{index_file} maps tensors to {file.name}, which is missing")
    return files


def _read_layer(
    folder: Path, prefixes: dict[str, Callable[[str], str]]
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The requested layer's tensors (HF names) and each one's origin ``file: name``.

    ``prefixes`` maps a checkpoint name prefix to the renaming of what follows it. With an
    index only the files it names are read, and only the tensors it assigns to them; without
    one, a tensor found in two files is an error (a stray shard must not silently win).
    """

    def wanted(name: str) -> bool:
        return name.startswith(tuple(prefixes))

    seen: dict[str, list[str]] = {}  # HF name -> every "file: checkpoint name" holding it
    plan: dict[Path, dict[str, str]] = {}  # file -> checkpoint name -> HF name
    for file, assigned in _shard_files(folder, wanted).items():
        header, _ = safetensors_header(file)
        if assigned is not None and (lost := sorted(assigned - header.keys())):
            raise ValueError(
                f"{folder / 'model.safetensors.index.json'} assigns {lost[0]!r} to {file.name}, "
                "which does not hold it"
            )
        for name in header:
            if wanted(name) and (assigned is None or name in assigned):
                prefix = next(p for p in prefixes if name.startswith(p))
                hf = prefixes[prefix](name[len(prefix) :])
                plan.setdefault(file, {})[name] = hf
                seen.setdefault(hf, []).append(f"{file.name}: {name}")
    clashes = {hf: where for hf, where in seen.items() if len(where) > 1}
    if clashes:
        hf, where = sorted(clashes.items())[0]
        raise ValueError(
            f"{folder}: {len(clashes)} tensor(s) of this layer are stored more than once, e.g. "
            f"{hf!r} in {' and '.join(where)}; without a model.safetensors.index.json the loader "
            "cannot tell which copy is current (remove the stray file or add an index; DeepSeek's "
            "convert.py output split over several model-parallel files is not supported)"
        )
    if not plan:
        raise ValueError(f"{folder}: no attention tensors of this layer (looked for {prefixes})")
    tensors: dict[str, np.ndarray] = {}
    for file, names in plan.items():
        for name, value in read_safetensors(file, keep=names.__contains__).items():
            tensors[names[name]] = value
    return tensors, {hf: where[0] for hf, where in seen.items()}


def load_v4_attention_from_safetensors(
    path: str | Path, layer_idx: int, *, dtype=jnp.float32, **options
) -> V4Attention:
    """Load layer ``layer_idx``'s attention from a V4 checkpoint folder.

    **Arguments:**

    - ``path``: a folder with ``config.json`` (HF keys, a top-level ``text_config``, or
      DeepSeek's inference keys) and one or more ``*.safetensors`` files (with
      ``model.safetensors.index.json`` when there are several). Tensors may use DeepSeek's
      native names (``layers.{i}.attn.wq_a.weight`` + ``wq_a.scale``, optionally under
      ``model.``) or the HF module names (``model.layers.{i}.self_attn.q_a_proj.weight``).
      FP8 weights (``F8_E4M3``) are dequantised with their tile scales (``F8_E8M0`` or float).
    - ``layer_idx``: which layer; only its attention tensors are read.
    - ``options``: as for ``load_v4_attention`` (``execution=`` or its keywords).

    **Raises:** ``ValueError`` (``SafetensorsError`` for a corrupt file) naming the file, key
    or tensor at fault; docs/hf.md lists every case.
    """
    folder = Path(path)
    d, source = _read_config(folder)
    _v4_config(d, layer_idx, source, _split_options(options)[0])  # fails before any I/O
    prefixes = {
        f"model.layers.{layer_idx}.self_attn.": lambda n: n,
        f"model.layers.{layer_idx}.attn.": native_v4_name,
        f"layers.{layer_idx}.attn.": native_v4_name,
    }
    tensors, origin = _read_layer(folder, prefixes)
    return _load_v4(
        tensors,
        d,
        layer_idx,
        source=source,
        where=f"{folder}, layer {layer_idx}",
        shown=lambda n: origin.get(n, n),
        dtype=dtype,
        options=options,
    )


# --- DeepSeek-V3.2 (DSA) ---------------------------------------------------------------------


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


# DeepSeek's native V3.2 names (``convert.py`` output) -> HF's; the indexer's are the same.
_NATIVE_V32_RENAMES = [
    (r"^wq_a\.", "q_a_proj."),
    (r"^q_norm\.", "q_a_layernorm."),
    (r"^wq_b\.", "q_b_proj."),
    (r"^wkv_a\.", "kv_a_proj_with_mqa."),
    (r"^kv_norm\.", "kv_a_layernorm."),
    (r"^wkv_b\.", "kv_b_proj."),
    (r"^wo\.", "o_proj."),
    (r"\.scale$", ".weight_scale_inv"),
]


def native_v32_name(name: str) -> str:
    """HF parameter name of a DeepSeek-native V3.2 attention tensor name (``wkv_a.weight`` …)."""
    return _rename(name, _NATIVE_V32_RENAMES)


def _v32_layer_config(d: dict, layer_idx: int, source: str, options: dict):
    """The layer config, after checking ``layer_idx`` against ``num_hidden_layers`` / ``n_layers``
    (when the config gives it)."""
    n_layers = _from_native(d).get("num_hidden_layers")
    if n_layers is not None:
        _check_layer_idx(layer_idx, int(n_layers), source)
    return _v32_config(d, source, options)


def _load_v32(tensors, d, layer_idx, *, source, where, shown, dtype, options) -> V32Attention:
    overrides, execution = _split_options(options)
    cfg = _v32_layer_config(d, layer_idx, source, overrides)
    layer = V32Attention(cfg, key=jax.random.key(0), dtype=dtype, execution=execution)
    names = v32_parameter_names()
    return _load_tree(layer, names, tensors, _block_size(d, source), where, shown)


def load_v32_attention(
    state_dict: Mapping[str, Any],
    config: Any,
    layer_idx: int,
    *,
    prefix: str = "",
    dtype=jnp.float32,
    **options,
) -> V32Attention:
    """A ``V32Attention`` holding layer ``layer_idx``'s weights from an HF attention state dict.

    Every V3.2 layer is a DSA layer, so ``layer_idx`` only has to be in range (when the
    config gives ``num_hidden_layers``). ``prefix``, FP8 scales and ``options`` work as in
    ``load_v4_attention``. **Raises:** ``ValueError`` naming any missing, unexpected,
    mis-shaped or non-finite tensor.
    """
    return _load_v32(
        _strip(state_dict, prefix),
        _as_dict(config),
        layer_idx,
        source="config",
        where=f"state dict of layer {layer_idx}",
        shown=lambda n: prefix + n,
        dtype=dtype,
        options=options,
    )


def load_v32_attention_from_safetensors(
    path: str | Path, layer_idx: int, *, dtype=jnp.float32, **options
) -> V32Attention:
    """Load layer ``layer_idx``'s attention from a V3.2 checkpoint folder.

    The released V3.2 layout: HF names (``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``,
    ``...indexer.wk.weight``) with FP8 weights and float32 ``weight_scale_inv`` tile scales,
    and the HF ``config.json``; DeepSeek's ``convert.py`` names (``layers.{i}.attn.wkv_a.weight``
    + ``.scale``) and inference config keys load too. Otherwise as
    ``load_v4_attention_from_safetensors``.
    """
    folder = Path(path)
    d, source = _read_config(folder)
    _v32_layer_config(d, layer_idx, source, _split_options(options)[0])  # before any I/O
    prefixes = {
        f"model.layers.{layer_idx}.self_attn.": lambda n: n,
        f"model.layers.{layer_idx}.attn.": native_v32_name,
        f"layers.{layer_idx}.attn.": native_v32_name,
    }
    tensors, origin = _read_layer(folder, prefixes)
    return _load_v32(
        tensors,
        d,
        layer_idx,
        source=source,
        where=f"{folder}, layer {layer_idx}",
        shown=lambda n: origin.get(n, n),
        dtype=dtype,
        options=options,
    )
