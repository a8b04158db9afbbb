"""DeepSeek-V4.1 configs and weights from either spelling (docs/v41.md, "Loading"): transformers'
``config.json`` (``model_type: deepseek_v41`` with a ``text_config``, or the text config
itself: ``hidden_size``, ``kv_source_layer_ids``, ...) and DeepSeek's ``inference/config.json``
(``dim``, ``kv_source_layers``, ...). Tensor names are the same in both checkpoints (under
``layers.{i}.attn.``, with transformers' ``model.`` prefix); the released FP8 weights are
dequantised with their E8M0 ``.scale`` tiles by the V4 loaders' code (``_hf_checkpoint``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .._layers.block import V4Block
from .._layers.v41 import V41Attention
from .._layers.v41_config import V41AttentionConfig
from .._numerics.base import V41_FORMATS
from ._checkpoint import load_tree, read_config, read_layer, strip_prefix
from ._config import block_size
from ._names import v41_parameter_names
from ._options import loader_execution

__all__ = [
    "v41_config_from_hf",
    "load_v41_attention",
    "load_v41_attention_from_safetensors",
]

V41_BLOCK = (32, 32)  # the release's FP8 tile (DeepSeek's fp8_block_size; weight_block_size)

# DeepSeek's ModelArgs defaults for the keys the attention reads (its inference/model.py)
_NATIVE_DEFAULTS = {
    "rope_theta": 10000.0,
    "compress_rope_theta": 40000.0,
    "norm_eps": 1e-20,
    "original_seq_len": 0,
    "rope_factor": 40,
    "beta_fast": 32,
    "beta_slow": 1,
    "candidate_source_layer": -1,
    "candidate_topk_blocks": 0,
    "candidate_block_size": 0,
}
_NATIVE = {  # V41AttentionConfig field <- DeepSeek key
    "hidden_size": "dim",
    "num_heads": "n_heads",
    "head_dim": "head_dim",
    "rope_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "rms_norm_eps": "norm_eps",
    "kv_source_layers": "kv_source_layers",
    "index_source_layers": "index_source_layers",
    "candidate_source_layer": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
}
_HF = {  # V41AttentionConfig field <- transformers key
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "head_dim": "head_dim",
    "rope_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "sliding_window",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
}


def _need(d: Mapping, key: str, source: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"{source} lacks the key {key!r}, needed to build a V4.1 stack")
    return d[key]


def v41_config_from_hf(config: Any, source: str = "config") -> V41AttentionConfig:
    """A V4.1 attention stack's config from transformers' or DeepSeek's ``config.json``.

    **Arguments:**

    - ``config``: a dict (or transformers config object): transformers' top level
        (``model_type: deepseek_v41``, its ``text_config`` is read), its text config, or
        DeepSeek's ``inference/config.json`` (``dim``, ``kv_source_layers``, ...; missing keys
        take DeepSeek's ``ModelArgs`` defaults, e.g. ``candidate_source_layer`` -1).
    - ``source``: what to call the config in errors.

    **Returns:** the ``V41AttentionConfig`` of the backbone's ``num_hidden_layers`` /
    ``n_layers`` layers (the draft layers' ratios are dropped). YaRN (``rope_scaling``, or
    DeepSeek's ``original_seq_len > 0``) applies to the compressed layers. transformers'
    unset ``candidate_source_layer_id`` is its last KV source, as in transformers. The
    schedule lists must be given (csa_eqx does not guess them).
    """
    d = dict(config) if isinstance(config, Mapping) else config.to_dict()
    if d.get("model_type") == "deepseek_v41" or "text_config" in d:
        d = dict(_need(d, "text_config", source))
    native = "dim" in d and "hidden_size" not in d
    keys = _NATIVE if native else _HF
    if native:
        d = {**_NATIVE_DEFAULTS, **d}
        n = _need(d, "n_layers", source)
        yarn = None
        if d["original_seq_len"] > 0:
            yarn = dict(
                factor=float(d["rope_factor"]),
                original_max_position_embeddings=int(d["original_seq_len"]),
                beta_fast=float(d["beta_fast"]),
                beta_slow=float(d["beta_slow"]),
            )
    else:
        n = _need(d, "num_hidden_layers", source)
        yarn = d.get("rope_scaling")
        if isinstance(yarn, Mapping):
            yarn = {
                k: v
                for k, v in yarn.items()
                if k
                in (
                    "factor",
                    "original_max_position_embeddings",
                    "beta_fast",
                    "beta_slow",
                    "rope_type",
                    "type",
                )
            }
        if d.get("candidate_source_layer_id") is None:
            kv = _need(d, "kv_source_layer_ids", source)
            d = {**d, "candidate_source_layer_id": kv[-1] if kv else -1}
    fields = {f: _need(d, k, source) for f, k in keys.items()}
    ratios = list(_need(d, "compress_ratios", source))
    if len(ratios) < n:
        raise ValueError(f"{source}: compress_ratios has {len(ratios)} entries for {n} layers")
    return V41AttentionConfig(
        compress_ratios=tuple(int(r) for r in ratios[:n]),
        **{
            **fields,
            "kv_source_layers": tuple(fields["kv_source_layers"]),
            "index_source_layers": tuple(fields["index_source_layers"]),
            "rope_scaling": yarn,
            **{f: float(fields[f]) for f in ("rope_theta", "compress_rope_theta", "rms_norm_eps")},
        },
    )


def v41_scale_fmt(config: Mapping) -> str | None:
    """The activation scale format of a V4.1 ``config.json`` (as ``v4_scale_fmt`` for V4):
    transformers' ``quantization_config.scale_fmt`` (at the top or in ``text_config``; absent:
    ``None``, amax scales), and for DeepSeek's ``inference/config.json`` the code's constant
    ``"ue8m0"`` (V4.1's ``ModelArgs`` has no ``scale_fmt`` field)."""
    d = dict(config)
    text = dict(d.get("text_config") or d)
    if "dim" in text and "hidden_size" not in text:
        return "ue8m0"
    quant = d.get("quantization_config") or text.get("quantization_config") or {}
    return quant.get("scale_fmt")


def load_v41_attention(
    config: V41AttentionConfig,
    layer_idx: int,
    tensors: Mapping[str, Any],
    prefix: str | None = None,
    dtype=jnp.float32,
    execution=None,
    block: tuple[int, int] = V41_BLOCK,
    scale_fmt: str | None = "ue8m0",
    **options,
) -> V41Attention:
    """Layer ``layer_idx`` of a V4.1 stack from a state dict under DeepSeek's names (docs/v41.md,
    "Loading").

    **Arguments:**

    - ``config``: the stack's ``V41AttentionConfig``; ``layer_idx``: the layer.
    - ``tensors``: name -> array (numpy, ``ml_dtypes``, jax or torch on the CPU), as released:
        FP8 E4M3 weights with their E8M0 (or float) block scales ``<name>.scale`` (one per
        ``block`` tile), BF16 / F32 tensors as stored, or float tensors already dequantised.
    - ``prefix``: the names' prefix (``None``: ``layers.{layer_idx}.attn.``; transformers'
        checkpoints add ``model.``); keys without it are ignored.
    - ``dtype``: the parameters' dtype (norms and sinks stay float32); ``execution``: as for
        ``V41Attention``; ``block``: the FP8 tile (the release's 32 x 32); ``scale_fmt``: the
        checkpoint's activation scale format for ``numerics="deepseek"`` (the release's
        ``"ue8m0"``, or ``None``: amax scales; ``v41_scale_fmt`` reads it from a config).
    - ``options``: instead of ``execution=``, the keywords of ``csa_eqx.Execution.from_options``
        (``head_parallel=True``, ``context_parallel=True``, ``indexer_sharded_topk=True``, ...;
        docs/v41.md, "Scaling out"); ``numerics="deepseek"`` is ``DeepSeekV41Inference()``
        (DeepSeek's inference numerics on V4.1's formats, docs/v41.md "Quantised inference").

    **Returns:** the ``V41Attention``, the FP8 weights multiplied by their tiles' scales.

    **Raises:** ``ValueError`` naming a missing tensor, one the layer's role does not hold, a
    wrong shape, a scale grid that does not fit its weight, an FP8 weight without its scale
    (or a scale of a weight that is not FP8) and non-finite values.
    """
    prefix = f"layers.{layer_idx}.attn." if prefix is None else prefix
    given = {_internal(k): v for k, v in strip_prefix(tensors, prefix).items()}
    where = f"state dict of layer {layer_idx}"
    execution = loader_execution(execution, options, scale_fmt, formats=V41_FORMATS)
    return _load(
        config, layer_idx, given, where, lambda n: prefix + _native(n), dtype, execution, block
    )


def load_v41_attention_from_safetensors(
    path: str | Path,
    layer_idx: int,
    *,
    dtype=jnp.float32,
    execution=None,
    **options,
) -> V41Attention:
    """Layer ``layer_idx`` of a V4.1 checkpoint folder in the released layout (docs/v41.md,
    "Loading").

    **Arguments:**

    - ``path``: a folder with ``config.json`` (transformers' spelling with ``text_config``,
        its text config, or DeepSeek's ``inference/config.json``) and ``*.safetensors`` shards
        (with ``model.safetensors.index.json`` when there are several). Tensors under
        ``layers.{i}.attn.`` (optionally ``model.``-prefixed): FP8 E4M3 weights with E8M0
        ``.scale`` tiles of ``quantization_config.weight_block_size`` (default 32 x 32, as
        DeepSeek's inference code), BF16 and F32 tensors as released.
    - ``layer_idx``: the layer; only its attention tensors are read.
    - ``dtype``, ``execution``, ``options``: as for ``load_v41_attention``.

    **Returns:** the ``V41Attention``.

    **Raises:** ``ValueError`` (``SafetensorsError`` for a corrupt file) naming the file, key or
    tensor at fault, as ``load_v41_attention``.
    """
    folder = Path(path)
    text, source = read_config(folder)
    top = json.loads(Path(source).read_text())
    config = v41_config_from_hf(top if "text_config" in top else text, source)
    quant = top.get("quantization_config") or text.get("quantization_config") or {}
    block = block_size({"quantization_config": quant}, source) if quant else V41_BLOCK
    if isinstance(layer_idx, bool) or not (
        isinstance(layer_idx, int) and 0 <= layer_idx < config.num_layers
    ):
        raise ValueError(
            f"layer_idx must be an int in [0, {config.num_layers}) for {source} (got {layer_idx!r})"
        )
    prefixes = {
        p: _internal for p in (f"layers.{layer_idx}.attn.", f"model.layers.{layer_idx}.attn.")
    }
    scale_fmt = v41_scale_fmt(top if "text_config" in top else text)
    execution = loader_execution(execution, options, scale_fmt, formats=V41_FORMATS)
    tensors, origin = read_layer(folder, prefixes)
    where = f"{folder}, layer {layer_idx}"
    return _load(
        config,
        layer_idx,
        tensors,
        where,
        lambda n: origin.get(n, _native(n)),
        dtype,
        execution,
        block,
    )


def _internal(name: str) -> str:
    """A checkpoint name -> the loader's (``wq_a.scale`` -> ``wq_a.weight_scale_inv``, the V4
    dequantiser's spelling of the same multiplier)."""
    return name[: -len("scale")] + "weight_scale_inv" if name.endswith(".scale") else name


def _native(name: str) -> str:
    """The inverse of ``_internal``, for errors."""
    suffix = "weight_scale_inv"
    return name[: -len(suffix)] + "scale" if name.endswith("." + suffix) else name


def _load(config, layer_idx, tensors, where, shown, dtype, execution, block) -> V41Attention:
    """Check that ``tensors`` (internal names) are those of the layer's role, then copy them
    in, dequantising FP8 weights with their tile scales (``_hf_checkpoint.load_tree``)."""
    layer = V41Attention(config, layer_idx, key=jax.random.key(0), dtype=dtype, execution=execution)
    names = v41_parameter_names(layer)
    wanted = set(names.values())
    scales = {n[: -len("weight")] + "weight_scale_inv" for n in wanted if n.endswith(".weight")}
    role = config.role(layer_idx)
    missing = sorted(wanted - set(tensors))
    extra = sorted(_native(n) for n in set(tensors) - wanted - scales)
    if missing:
        raise ValueError(f"{where} ({role}) lacks the tensors {missing}")
    if extra:
        raise ValueError(f"{where} ({role}) holds no tensors {extra}")
    dequantised = tuple(f"block.{n}" for n in V4Block.dequantised_at_load)
    return load_tree(layer, names, tensors, block, where, shown, dequantised)
