"""The V4 and V3.2 loaders (state dicts and checkpoint folders, HF or DeepSeek-native names);
``csa_eqx.hf`` re-exports them."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._config import V4AttentionConfig
from .._layers.block import V4Block
from .._layers.v4 import V4Attention
from .._layers.v32 import V32Attention
from ._checkpoint import load_tree, read_config, read_layer, rename, strip_prefix
from ._config import (
    as_dict,
    block_size,
    v4_layer_config,
    v4_scale_fmt,
    v32_layer_config,
    v32_scale_fmt,
)
from ._names import v4_parameter_names, v32_parameter_names
from ._options import split_options

__all__ = [
    "native_v4_name",
    "load_v4_attention",
    "load_v4_attention_from_safetensors",
    "native_v32_name",
    "load_v32_attention",
    "load_v32_attention_from_safetensors",
]


# --- DeepSeek-V4 -----------------------------------------------------------------------------


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


class _Family(NamedTuple):
    """What differs between loading a V4 and a V3.2 layer."""

    layer: type  # V4Attention / V32Attention
    layer_config: Callable  # (config dict, layer_idx, source, overrides, strict) -> config
    parameter_names: Callable  # layer config -> {module path: HF parameter name}
    native_name: Callable  # DeepSeek-native tensor name -> HF name
    check: Callable  # (layer config, tensor names, where, layer_idx) -> None, or raises
    scale_fmt: Callable  # (config dict, source) -> DeepSeek's activation scale format
    dequantised: tuple[str, ...] = ()  # FP8 tensors held dequantised whatever the numerics


def _load(family: _Family, tensors, d, layer_idx, *, source, where, shown, dtype, strict, options):
    """Build ``family``'s layer ``layer_idx`` from the config dict ``d`` (``source`` says
    whose keys; an unknown key warns, or with ``strict`` raises) and copy ``tensors`` (HF
    names) into it; errors name ``where`` and ``shown`` tensor names."""
    overrides, execution = split_options(options, family.scale_fmt(d, source))
    cfg = family.layer_config(d, layer_idx, source, overrides, strict)
    family.check(cfg, set(tensors), where, layer_idx)
    layer = family.layer(cfg, key=jax.random.key(0), dtype=dtype, execution=execution)
    names = family.parameter_names(cfg)
    block = block_size(d, source)
    return load_tree(layer, names, tensors, block, where, shown, family.dequantised)


def _load_state_dict(
    family: _Family, state_dict, config, layer_idx, prefix, dtype, strict, options
):
    """The shared body of the ``load_*_attention`` loaders (keys under ``prefix``)."""
    return _load(
        family,
        strip_prefix(state_dict, prefix),
        as_dict(config),
        layer_idx,
        source="config",
        where=f"state dict of layer {layer_idx}",
        shown=lambda n: prefix + n,
        dtype=dtype,
        strict=strict,
        options=options,
    )


def load_v4_attention(
    state_dict: Mapping[str, Any],
    config: Any,
    layer_idx: int,
    *,
    prefix: str = "",
    dtype=jnp.float32,
    strict: bool = False,
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
    - ``strict``: an HF config key that no V4 config holds is a ``ValueError``, not a warning;
      either names every such key and the closest known one (a misspelt ``rope_thta`` would
      otherwise load the default ``rope_theta``).
    - ``options``: how the layer runs: ``execution=csa_eqx.Execution(...)``, or the keywords
      of ``Execution.from_options`` (``qk_head_chunk_size=``, ``indexer_key_block=``,
      ``query_block=``, ``indexer_save_selection=``, ``indexer_sharded_topk=``,
      ``shard_indexer_acts=``, ``indexer_loss=``, ``data_axis=``, ``tensor_axis=``,
      ``context_parallel=``, ``context_axis=``, ``head_parallel=``, ``numerics=``:
      ``"deepseek"`` for DeepSeek's inference numerics with the config's scale format,
      docs/numerics.md); any other keyword
      overrides an architecture field of the config.

    **Returns:** the ``V4Attention``.

    **Raises:** ``ValueError`` naming any missing, unexpected, mis-shaped or non-finite tensor,
    and a config whose layer kind does not match the tensors.
    """
    return _load_state_dict(_V4, state_dict, config, layer_idx, prefix, dtype, strict, options)


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


def _load_folder(family: _Family, path, layer_idx, dtype, strict, options):
    """The shared body of the ``load_*_from_safetensors`` loaders: check the config before any
    I/O, read layer ``layer_idx``'s tensors under HF or DeepSeek-native names and build
    ``family``'s layer."""
    folder = Path(path)
    d, source = read_config(folder)
    with warnings.catch_warnings():  # fails before I/O; an unknown key warns once, from _load
        warnings.simplefilter("ignore")
        family.layer_config(d, layer_idx, source, split_options(options)[0], strict)
    prefixes = {
        f"model.layers.{layer_idx}.self_attn.": lambda n: n,
        f"model.layers.{layer_idx}.attn.": family.native_name,
        f"layers.{layer_idx}.attn.": family.native_name,
    }
    tensors, origin = read_layer(folder, prefixes)
    return _load(
        family,
        tensors,
        d,
        layer_idx,
        source=source,
        where=f"{folder}, layer {layer_idx}",
        shown=lambda n: origin.get(n, n),
        dtype=dtype,
        strict=strict,
        options=options,
    )


def native_v4_name(name: str) -> str:
    """**Arguments:** a DeepSeek-native V4 attention tensor name (``wq_a.weight``, ``wq_a.scale``).

    **Returns:** the HF module's parameter name (``q_a_proj.weight``,
    ``q_a_proj.weight_scale_inv``).
    """
    return rename(name, _NATIVE_V4_RENAMES)


_V4 = _Family(
    V4Attention,
    v4_layer_config,
    v4_parameter_names,
    native_v4_name,
    _check_v4_kind,
    v4_scale_fmt,
    tuple(f"block.{n}" for n in V4Block.dequantised_at_load),
)


def load_v4_attention_from_safetensors(
    path: str | Path, layer_idx: int, *, dtype=jnp.float32, strict: bool = False, **options
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
    - ``strict``, ``options``: as for ``load_v4_attention`` (``execution=`` or its keywords).

    **Returns:** the ``V4Attention`` (float weights in ``dtype``).

    **Raises:** ``ValueError`` (``SafetensorsError`` for a corrupt file) naming the file, key
    or tensor at fault; docs/hf.md lists every case.
    """
    return _load_folder(_V4, path, layer_idx, dtype, strict, options)


# --- DeepSeek-V3.2 (DSA) ---------------------------------------------------------------------


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
    """**Arguments:** a DeepSeek-native V3.2 attention tensor name (``wkv_a.weight`` …).

    **Returns:** the HF parameter name (``kv_a_proj_with_mqa.weight`` …).
    """
    return rename(name, _NATIVE_V32_RENAMES)


def _any_v32_layer(cfg, present, where, layer_idx) -> None:
    """Every V3.2 layer is a DSA layer: nothing to check against the tensors."""


_V32 = _Family(
    V32Attention,
    v32_layer_config,
    lambda cfg: v32_parameter_names(),  # the same tensors for every layer
    native_v32_name,
    _any_v32_layer,
    v32_scale_fmt,
)


def load_v32_attention(
    state_dict: Mapping[str, Any],
    config: Any,
    layer_idx: int,
    *,
    prefix: str = "",
    dtype=jnp.float32,
    strict: bool = False,
    **options,
) -> V32Attention:
    """A ``V32Attention`` holding layer ``layer_idx``'s weights from an HF attention state dict.

    **Arguments:** as for ``load_v4_attention`` (``config``: see ``v32_config_from_hf``).
    Every V3.2 layer is a DSA layer, so ``layer_idx`` only has to be in range (when the
    config gives ``num_hidden_layers``).

    **Returns:** the ``V32Attention``.

    **Raises:** ``ValueError`` naming any missing, unexpected, mis-shaped or non-finite tensor.
    """
    return _load_state_dict(_V32, state_dict, config, layer_idx, prefix, dtype, strict, options)


def load_v32_attention_from_safetensors(
    path: str | Path, layer_idx: int, *, dtype=jnp.float32, strict: bool = False, **options
) -> V32Attention:
    """Load layer ``layer_idx``'s attention from a V3.2 checkpoint folder.

    The released V3.2 layout: HF names (``model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight``,
    ``...indexer.wk.weight``) with FP8 weights and float32 ``weight_scale_inv`` tile scales,
    and the HF ``config.json``; DeepSeek's ``convert.py`` names (``layers.{i}.attn.wkv_a.weight``
    + ``.scale``) and inference config keys load too.

    **Arguments**, **Raises:** as for ``load_v4_attention_from_safetensors``.

    **Returns:** the ``V32Attention``.
    """
    return _load_folder(_V32, path, layer_idx, dtype, strict, options)
