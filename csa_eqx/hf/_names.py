"""Where each checkpoint tensor of a layer lives in its pytree: the parameter names of the V4,
V3.2 and V4.1 layers (attribute path -> checkpoint name) and ``parameter_paths`` (checkpoint
name -> pytree path, for any of them)."""

from __future__ import annotations

from .._config import V4AttentionConfig, V32AttentionConfig
from .._layers.v41_config import V41AttentionConfig

__all__ = ["v4_parameter_names", "v32_parameter_names", "v41_parameter_names", "parameter_paths"]


def v4_parameter_names(config: V4AttentionConfig) -> dict[str, str]:
    """**Arguments:** the layer's ``config`` (its kind decides which compressor / indexer
    tensors exist).

    **Returns:** module attribute path -> HF parameter name, for one V4 layer
    (``"entry_source.compressor.kv_proj"`` -> ``"compressor.kv_proj.weight"``, ...).
    """
    block = ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj")
    names = {f"block.{n}": f"{n}.weight" for n in block}
    names["block.sinks"] = "sinks"
    compressor = {
        "kv_proj": "kv_proj.weight",
        "gate_proj": "gate_proj.weight",
        "position_bias": "position_bias",
        "kv_norm": "kv_norm.weight",
    }
    own, indexer = "entry_source.compressor", "selection_source.indexer"
    if config.layer_type != "sliding":
        names.update({f"{own}.{k}": f"compressor.{v}" for k, v in compressor.items()})
    if config.has_indexer:
        names.update(
            {f"{indexer}.compressor.{k}": f"compressor.indexer.{v}" for k, v in compressor.items()}
        )
        names[f"{indexer}.q_b_proj"] = "compressor.indexer.q_b_proj.weight"
        names[f"{indexer}.weights_proj"] = "compressor.indexer.scorer.weights_proj.weight"
    return names


def v32_parameter_names() -> dict[str, str]:
    """**Returns:** module attribute path -> HF parameter name, for one V3.2 attention layer."""
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


# V41Attention's attribute path -> the checkpoint's name after ``layers.{i}.attn.``
_NAMES = {
    ("block", "q_a_proj"): "wq_a.weight",
    ("block", "q_a_norm"): "q_norm.weight",
    ("block", "q_b_proj"): "wq_b.weight",
    ("block", "kv_proj"): "wkv.weight",
    ("block", "kv_norm"): "kv_norm.weight",
    ("block", "o_a_proj"): "wo_a.weight",
    ("block", "o_b_proj"): "wo_b.weight",
    ("block", "sinks"): "attn_sink",
    ("entry_source", "compressor", "kv_proj"): "compressor.wkv.weight",
    ("entry_source", "compressor", "gate_proj"): "compressor.wgate.weight",
    ("entry_source", "compressor", "kv_norm"): "compressor.norm.weight",
    ("entry_source", "compressor", "key_proj"): "indexer.wk.weight",
    ("entry_source", "compressor", "key_norm"): "indexer.k_norm.weight",
    ("selection_source", "indexer", "q_b_proj"): "indexer.wq_b.weight",
    ("selection_source", "indexer", "weights_proj"): "indexer.weights_proj.weight",
}


def _get(module, path):
    for p in path:
        module = getattr(module, p, None)
    return module


def v41_parameter_names(layer) -> dict[str, str]:
    """**Arguments:** a ``V41Attention`` (its role decides what it holds).

    **Returns:** its attribute path (``"entry_source.compressor.key_proj"``,
    ``"block.q_a_proj"``) -> the checkpoint's tensor name after ``layers.{i}.attn.``
    (``"indexer.wk.weight"``), for the arrays it holds."""
    return {".".join(p): n for p, n in _NAMES.items() if _get(layer, p) is not None}


_FAMILIES = {  # config type -> the layer's parameter names (attribute path -> checkpoint name)
    V4AttentionConfig: lambda layer: v4_parameter_names(layer.config),
    V32AttentionConfig: lambda layer: v32_parameter_names(),
    V41AttentionConfig: v41_parameter_names,
}


def parameter_paths(layer) -> dict[str, str]:
    """Where each checkpoint tensor of a layer lives in its pytree (what an optimiser mask by
    name, or a hand-written loader, needs; docs/api/layers.md, "Parameter paths").

    **Arguments:** a ``V4Attention``, ``V32Attention`` or ``V41Attention``.

    **Returns:** checkpoint name -> pytree path, the path as ``jax.tree_util.keystr`` prints
    the layer's leaf: HF's attention-module names for V4 and V3.2 layers
    (``"compressor.indexer.q_b_proj.weight"`` -> ``".selection_source.indexer.q_b_proj"``),
    DeepSeek's names after ``layers.{i}.attn.`` for V4.1 (``"indexer.wq_b.weight"`` ->
    ``".selection_source.indexer.q_b_proj"``); only the tensors the layer holds.
    """
    names = _FAMILIES.get(type(getattr(layer, "config", None)))
    if names is None:
        raise TypeError(
            "parameter_paths takes a V4Attention, V32Attention or V41Attention "
            f"(got {type(layer).__name__})"
        )
    return {name: f".{path}" for path, name in names(layer).items()}
