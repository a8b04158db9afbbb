"""Named layer sizes shared by tests, benchmarks, ``csa-eqx inspect`` and the notebooks.

One table says which compression rate each V4 layer kind uses; the presets give the
attention sizes of the released models (architecture only, no execution options) and tiny
sizes for tests. Every function accepts field overrides, e.g. ``v4_flash("hca", index_topk=8)``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ._config import SHARED_SIZES, V4AttentionConfig, V32AttentionConfig

__all__ = [
    "LayerKind",
    "COMPRESS_RATES",
    "TINY_HCA_RATE",
    "v4_flash",
    "v4_pro",
    "v32",
    "tiny_v4",
    "tiny_v32",
    "v32_sized_as",
]

LayerKind = Literal["sliding", "csa", "hca"]

# compress_rate of each V4 layer kind in the released models
# (docs/concepts.md, "The DeepSeek-V4 attention block")
COMPRESS_RATES: dict[str, int] = {"sliding": 0, "csa": 4, "hca": 128}
# tiny test layers use a short HCA window so that a few dozen tokens close several entries
TINY_HCA_RATE = 8


def _v4(base: V4AttentionConfig, kind: LayerKind, hca_rate: int, overrides: dict):
    if kind not in COMPRESS_RATES:
        raise ValueError(f"layer kind must be one of {sorted(COMPRESS_RATES)} (got {kind!r})")
    overrides.setdefault("compress_rate", hca_rate if kind == "hca" else COMPRESS_RATES[kind])
    config = dataclasses.replace(base, **overrides)
    if config.layer_type != kind:
        raise ValueError(
            f"compress_rate={config.compress_rate} makes a {config.layer_type!r} layer, "
            f"not the {kind!r} layer asked for"
        )
    return config


_V4_FLASH = V4AttentionConfig()  # the HF config's defaults are DeepSeek-V4-Flash's sizes
# V4-Pro differs from V4-Flash only in width, heads, query LoRA rank, output groups and k
_V4_PRO = dataclasses.replace(
    _V4_FLASH, hidden_size=7168, num_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024
)
_TINY_V4 = V4AttentionConfig(
    hidden_size=64,
    num_heads=4,
    head_dim=32,
    rope_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=8,
)


def v4_flash(kind: LayerKind = "csa", **overrides) -> V4AttentionConfig:
    """One DeepSeek-V4-Flash attention layer of ``kind`` (hidden 4096, 64 heads x 512,
    indexer 64 x 128, k = 512, HCA m = 128).

    **Arguments:**

    - ``kind``: ``"sliding"``, ``"csa"`` or ``"hca"`` (docs/concepts.md, "The DeepSeek-V4
        attention block").
    - ``overrides``: fields of ``V4AttentionConfig`` to change.

    **Returns:** the ``V4AttentionConfig``. Raises ``ValueError`` for an unknown ``kind`` or a
    ``compress_rate`` override that makes another kind.
    """
    return _v4(_V4_FLASH, kind, COMPRESS_RATES["hca"], overrides)


def v4_pro(kind: LayerKind = "csa", **overrides) -> V4AttentionConfig:
    """One DeepSeek-V4-Pro attention layer of ``kind`` (hidden 7168, 128 heads x 512,
    16 output groups, indexer 64 x 128, k = 1024, HCA m = 128).

    **Arguments** and **Returns:** as for ``v4_flash``.
    """
    return _v4(_V4_PRO, kind, COMPRESS_RATES["hca"], overrides)


def v32(**overrides) -> V32AttentionConfig:
    """One DeepSeek-V3.2 DSA layer (hidden 7168, 128 MLA heads, indexer 64 x 128,
    k = 2048).

    **Arguments:**

    - ``overrides``: fields of ``V32AttentionConfig`` to change.

    **Returns:** the ``V32AttentionConfig``.
    """
    return dataclasses.replace(V32AttentionConfig(), **overrides)


def tiny_v4(kind: LayerKind = "csa", **overrides) -> V4AttentionConfig:
    """A V4 layer of ``kind`` small enough for unit tests (hidden 64, 4 heads x 32,
    indexer 4 x 16, k = 8, window 16, HCA m = 8).

    **Arguments** and **Returns:** as for ``v4_flash``.
    """
    return _v4(_TINY_V4, kind, TINY_HCA_RATE, overrides)


def v32_sized_as(config: V4AttentionConfig, **fields) -> V32AttentionConfig:
    """A V3.2 layer with a V4 layer's shared sizes (``csa_eqx._config.SHARED_SIZES``: width,
    attention heads, query LoRA rank, indexer heads, head dim and k).

    **Arguments:**

    - ``config``: the V4 layer whose shared sizes to take.
    - ``fields``: the MLA sizes (``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
        ``v_head_dim``) and any other field of ``V32AttentionConfig`` to set; the rest are
        V3.2's defaults.

    **Returns:** the ``V32AttentionConfig``.
    """
    shared = {name: getattr(config, name) for name in SHARED_SIZES}
    return V32AttentionConfig(**(shared | fields))


def tiny_v32(**overrides) -> V32AttentionConfig:
    """A V3.2 layer small enough for unit tests: ``tiny_v4``'s shared sizes (hidden 64,
    4 heads, indexer 4 x 16, k = 8) with MLA latents of 32 (nope 16, rope 8, values 16).

    **Arguments** and **Returns:** as for ``v32``.
    """
    mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    return v32_sized_as(_TINY_V4, **(mla | overrides))
