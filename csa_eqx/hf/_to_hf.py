"""Layer configs -> HF config fields: the inverse of ``_config.py``.

Private to ``csa_eqx.hf`` and torch-free. The checkpoint writer (``_save.py``) writes these
fields as ``config.json``; ``csa_eqx.testing`` builds its transformers configs from them. Both
read back through ``_config.py`` to the configs they came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from ._config import _DEFAULT_RATES, _LAYER_KINDS

HF_LAYER_TYPES = {kind: hf_type for hf_type, kind in _LAYER_KINDS.items()}


def yarn_parameters(scaling: YaRNScaling) -> dict:
    """The HF ``rope_parameters`` entry of a YaRN scaling: ``rope_type`` ``"yarn"`` and every
    field of ``scaling`` that is set."""
    entry = {"rope_type": "yarn", **dataclasses.asdict(scaling)}
    return {k: v for k, v in entry.items() if v is not None}


def _yarn_fields(scaling: YaRNScaling, **rope) -> dict:
    """``rope_parameters`` and the context length the scaling stretches to (transformers warns
    unless ``max_position_embeddings`` says so)."""
    return dict(
        rope_parameters={**yarn_parameters(scaling), **rope},
        max_position_embeddings=int(scaling.factor * scaling.original_max_position_embeddings),
    )


def _shared_fields(config: V4AttentionConfig | V32AttentionConfig, num_layers: int) -> dict:
    """The fields both versions take from the same config fields (HF's names equal ours but
    for ``num_attention_heads``)."""
    same = ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim", "index_topk")
    fields = {name: getattr(config, name) for name in same}
    return dict(fields, num_attention_heads=config.num_heads, num_hidden_layers=num_layers)


def v4_hf_fields(configs: Sequence[V4AttentionConfig]) -> dict:
    """The HF ``DeepseekV4Config`` fields of a model whose layer ``i`` is ``configs[i]``.

    **Arguments:** ``configs``: one architecture but for ``compress_rate`` (the caller
    checks; the fields are layer 0's), every HCA layer with one rate (an HF config has one per
    layer kind).

    **Returns:** the fields (``layer_types``, ``compress_rates``, ...). ``ValueError`` if the
    HCA layers' rates differ.
    """
    c = configs[0]
    hca = {cfg.compress_rate for cfg in configs if cfg.layer_type == "hca"}
    if len(hca) > 1:
        raise ValueError(
            f"the HCA layers' compress_rate differ ({sorted(hca)}): an HF config has one"
        )
    rates = dict(_DEFAULT_RATES)
    if hca:
        rates["heavily_compressed_attention"] = hca.pop()
    fields = dict(
        _shared_fields(c, len(configs)),
        head_dim=c.head_dim,
        qk_rope_head_dim=c.rope_dim,
        o_groups=c.o_groups,
        o_lora_rank=c.o_lora_rank,
        sliding_window=c.sliding_window,
        layer_types=[HF_LAYER_TYPES[cfg.layer_type] for cfg in configs],
        compress_rates=rates,
        rope_theta=c.rope_theta,
        compress_rope_theta=c.compress_rope_theta,
        rms_norm_eps=c.rms_norm_eps,
    )
    if c.rope_scaling is not None:
        fields.update(_yarn_fields(c.rope_scaling))
    return fields


def v32_hf_fields(config: V32AttentionConfig, num_layers: int = 1) -> dict:
    """The HF ``DeepseekV32Config`` fields of ``num_layers`` layers of one ``config``.

    **Returns:** the fields. ``ValueError`` unless ``config.rms_norm_eps`` is 1e-6: HF's V3.2
    layer normalises with 1e-6 whatever its config says.
    """
    if config.rms_norm_eps != 1e-6:
        raise ValueError(
            f"rms_norm_eps must be 1e-6 for an HF V3.2 config (HF's V3.2 layer normalises with "
            f"1e-6 whatever its config says; got {config.rms_norm_eps!r})"
        )
    fields = dict(
        _shared_fields(config, num_layers),
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_parameters=dict(rope_type="default", rope_theta=config.rope_theta),
        attention_bias=False,
    )
    if config.rope_scaling is not None:
        fields.update(_yarn_fields(config.rope_scaling, rope_theta=config.rope_theta))
    return fields
