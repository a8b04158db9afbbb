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

from .._config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .._layers.v4 import V4Attention
from .._layers.v32 import V32Attention
from ._names import v4_parameter_names, v32_parameter_names
from ._safetensors_io import write_safetensors

__all__ = ["save_v4_checkpoint", "save_v32_checkpoint"]

_HF_KINDS = {
    "sliding": "sliding_attention",
    "csa": "compressed_sparse_attention",
    "hca": "heavily_compressed_attention",
}


def _yarn(scaling: YaRNScaling | None) -> dict | None:
    if scaling is None:
        return None
    entry = {"rope_type": "yarn", **dataclasses.asdict(scaling)}
    return {k: v for k, v in entry.items() if v is not None}


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
    hca = {c.compress_rate for c in configs if c.layer_type == "hca"}
    if len(hca) > 1:
        raise ValueError(
            f"the HCA layers' compress_rate differ ({sorted(hca)}): an HF config has one"
        )
    c = configs[0]
    config = dict(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        num_hidden_layers=len(layers),
        head_dim=c.head_dim,
        qk_rope_head_dim=c.rope_dim,
        q_lora_rank=c.q_lora_rank,
        o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank,
        sliding_window=c.sliding_window,
        layer_types=[_HF_KINDS[cfg.layer_type] for cfg in configs],
        compress_rates={
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": hca.pop() if hca else 128,
        },
        index_n_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim,
        index_topk=c.index_topk,
        rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta,
        rms_norm_eps=c.rms_norm_eps,
    )
    if c.rope_scaling is not None:
        config["rope_scaling"] = _yarn(c.rope_scaling)
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
    c = configs[0]
    if c.rms_norm_eps != 1e-6:
        raise ValueError(
            f"rms_norm_eps must be 1e-6 to be written (HF's V3.2 layer normalises with 1e-6 "
            f"whatever its config says; got {c.rms_norm_eps!r})"
        )
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {**_yarn(c.rope_scaling), "rope_theta": c.rope_theta}
    config = dict(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        num_hidden_layers=len(layers),
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        index_n_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim,
        index_topk=c.index_topk,
        rope_parameters=rope,
        attention_bias=False,
    )
    names = [v32_parameter_names()] * len(layers)
    return _write(folder, config, _tensors(layers, names))
