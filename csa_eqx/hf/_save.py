"""Write csa_eqx layers as a checkpoint folder the loaders read (``config.json`` with the HF
config's keys + ``model.safetensors`` with the HF module's parameter names under
``model.layers.{i}.self_attn.``): a small model to try the loaders on without a download, and a
layer trained here handed to HF-layout tooling. No torch, no transformers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._config import V4AttentionConfig, V32AttentionConfig
from .._layers.v4 import V4Attention
from .._layers.v32 import V32Attention
from ._names import v4_parameter_names, v32_parameter_names
from ._safetensors_io import write_safetensors
from ._to_hf import v4_hf_fields, v32_hf_fields

__all__ = ["save_v4_checkpoint", "save_v32_checkpoint"]


def _numpy(array) -> np.ndarray:
    """A parameter as stored: float32 / bf16 arrays as they are (a bf16 parameter as bf16)."""
    array = np.asarray(array)
    return array.view(ml_dtypes.bfloat16) if array.dtype == jnp.bfloat16 else array


def _tensors(layers: Sequence, names: Sequence[dict[str, str]]) -> dict[str, np.ndarray]:
    out = {}
    for i, (layer, layer_names) in enumerate(zip(layers, names, strict=True)):
        for path, name in layer_names.items():
            value = layer
            for part in path.split("."):
                value = getattr(value, part)
            out[f"model.layers.{i}.self_attn.{name}"] = _numpy(value)
    return out


def _shared(configs: Sequence, differ: tuple[str, ...], what: str) -> None:
    """``ValueError`` unless every config equals the first one but for the ``differ`` fields."""
    first = dataclasses.replace(configs[0], **{f: getattr(configs[0], f) for f in differ})
    for i, c in enumerate(configs):
        same = dataclasses.replace(c, **{f: getattr(configs[0], f) for f in differ})
        if same != first:
            raise ValueError(
                f"layers[{i}]'s config differs from layers[0]'s in more than {list(differ)}: "
                f"one {what} checkpoint holds one architecture"
            )


def _write(folder: str | Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_safetensors(folder / "model.safetensors", tensors)
    return folder


def _layers(layers, kind: type, name: str) -> list:
    layers = [layers] if isinstance(layers, kind) else list(layers)
    if not layers or not all(isinstance(layer, kind) for layer in layers):
        raise TypeError(f"layers must be a {name} or a non-empty sequence of them")
    return layers


def save_v4_checkpoint(folder: str | Path, layers: V4Attention | Sequence[V4Attention]) -> Path:
    """Write DeepSeek-V4 layers as a checkpoint folder that
    ``load_v4_attention_from_safetensors(folder, layer_idx)`` reads back (the same arrays).

    **Arguments:**

    - ``folder``: where to write (created; ``config.json`` and ``model.safetensors``
        overwritten).
    - ``layers``: a ``V4Attention`` or a sequence of them: layer ``i`` of the model. They share
        one architecture but for ``compress_rate``, and every HCA layer one rate (the HF
        config's ``compress_rates``).

    **Returns:** the folder. ``TypeError`` / ``ValueError`` name what cannot be written.
    """
    layers = _layers(layers, V4Attention, "csa_eqx.V4Attention")
    configs: list[V4AttentionConfig] = [layer.config for layer in layers]
    _shared(configs, ("compress_rate",), "V4")
    config = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", **v4_hf_fields(configs)
    )
    names = [v4_parameter_names(cfg) for cfg in configs]
    return _write(folder, config, _tensors(layers, names))


def save_v32_checkpoint(folder: str | Path, layers: V32Attention | Sequence[V32Attention]) -> Path:
    """Write DeepSeek-V3.2 layers as a checkpoint folder that
    ``load_v32_attention_from_safetensors(folder, layer_idx)`` reads back (the same arrays).

    **Arguments:** the ``folder`` (as for ``save_v4_checkpoint``) and ``layers``: a
    ``V32Attention`` or a sequence of them with one config (``rms_norm_eps`` 1e-6, as every HF
    V3.2 layer normalises).

    **Returns:** the folder.
    """
    layers = _layers(layers, V32Attention, "csa_eqx.V32Attention")
    configs: list[V32AttentionConfig] = [layer.config for layer in layers]
    _shared(configs, (), "V3.2")
    config = dict(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        **v32_hf_fields(configs[0], len(layers)),
    )
    names = [v32_parameter_names()] * len(layers)
    return _write(folder, config, _tensors(layers, names))
