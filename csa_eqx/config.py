"""Frozen, validated layer configurations: the architecture of a checkpoint's layer only.

Configs are hashable frozen dataclasses so that a module can hold one as a static field; every
invalid value raises ``ValueError`` naming the field and the rule when the config is built.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = [
    "YaRNScaling",
    "V4AttentionConfig",
    "V32AttentionConfig",
]


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} {rule} (got {value!r})")


def _positive(obj: object, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        _require(
            isinstance(v, int) and not isinstance(v, bool) and v > 0, f, "must be a positive int", v
        )


def _non_negative(obj: object, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        _require(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            f,
            "must be a non-negative int",
            v,
        )


@dataclasses.dataclass(frozen=True)
class YaRNScaling:
    """YaRN rotary frequency scaling (the ``rope_type: yarn`` entry of an HF config).

    ``mscale`` / ``mscale_all_dim`` only matter for V3.2's softmax scale; V4 uses the scaled
    frequencies without any magnitude factor.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _require(self.factor >= 1.0, "rope_scaling.factor", "must be >= 1", self.factor)
        _positive(self, "original_max_position_embeddings")
        _require(
            self.beta_fast > self.beta_slow > 0,
            "rope_scaling.beta_fast",
            "must exceed beta_slow > 0",
            (self.beta_fast, self.beta_slow),
        )


@dataclasses.dataclass(frozen=True)
class V4AttentionConfig:
    """One DeepSeek-V4 attention layer's architecture (docs/concepts.md, "DeepSeek-V4 layers").
    Field names follow the HF config; how the layer runs is ``csa_eqx.Execution``.

    ``compress_rate`` picks the layer type: 0 sliding window only, 4 CSA (overlapping
    compressor + lightning indexer), any other value > 4 HCA (all visible compressed entries).
    """

    hidden_size: int = 4096
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_rate: int = 4
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YaRNScaling | None = None
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        _positive(
            self,
            "hidden_size",
            "num_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        )
        _non_negative(self, "rope_dim", "compress_rate")
        _require(
            self.rope_dim % 2 == 0 and self.rope_dim <= min(self.head_dim, self.index_head_dim),
            "rope_dim",
            "must be even and at most head_dim and index_head_dim",
            self.rope_dim,
        )
        _require(
            self.compress_rate == 0 or self.compress_rate >= 4,
            "compress_rate",
            "must be 0 (sliding), 4 (CSA) or > 4 (HCA)",
            self.compress_rate,
        )
        _require(
            self.num_heads % self.o_groups == 0,
            "o_groups",
            f"must divide num_heads={self.num_heads}",
            self.o_groups,
        )
        for f in ("rope_theta", "compress_rope_theta", "rms_norm_eps"):
            _require(getattr(self, f) > 0, f, "must be > 0", getattr(self, f))

    @property
    def layer_type(self) -> Literal["sliding", "csa", "hca"]:
        if self.compress_rate == 0:
            return "sliding"
        return "csa" if self.compress_rate == 4 else "hca"

    @property
    def has_indexer(self) -> bool:
        return self.layer_type == "csa"


@dataclasses.dataclass(frozen=True)
class V32AttentionConfig:
    """One DeepSeek-V3.2 DSA layer's architecture (docs/concepts.md, "DeepSeek-V3.2"): MLA
    plus a lightning indexer over raw tokens. How it runs is ``csa_eqx.Execution``.

    Field names follow the HF config. ``rope_scaling`` (YaRN) rescales the rotary frequencies,
    multiplies the rotated channels by YaRN's attention factor (as HF's cos/sin do) and the
    softmax scale by ``yarn_mscale(rope_scaling)**2``.
    """

    hidden_size: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: YaRNScaling | None = None
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        _positive(
            self,
            "hidden_size",
            "num_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        )
        _require(
            self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.index_head_dim,
            "qk_rope_head_dim",
            f"must be even and at most index_head_dim={self.index_head_dim}",
            self.qk_rope_head_dim,
        )
        for f in ("rope_theta", "rms_norm_eps"):
            _require(getattr(self, f) > 0, f, "must be > 0", getattr(self, f))
