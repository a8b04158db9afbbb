"""Frozen, validated layer configurations: the architecture of a checkpoint's layer only.

Configs are hashable frozen dataclasses so that a module can hold one as a static field; every
invalid value raises ``ValueError`` naming the field and the rule when the config is built.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

__all__ = [
    "SHARED_SIZES",
    "YaRNScaling",
    "V4FamilyConfig",
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


def _finite_positive(obj: object, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        _require(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
            f,
            "must be a finite number > 0",
            v,
        )


def _even_unrotated(obj: object, field: str, rope_field: str) -> None:
    """Interleaved RoPE pairs channels, so the unrotated part of a head must be even too."""
    dim, rope = getattr(obj, field), getattr(obj, rope_field)
    _require(
        (dim - rope) % 2 == 0,
        field,
        f"minus {rope_field}={rope} (the unrotated channels) must be even for interleaved RoPE",
        dim,
    )


@dataclasses.dataclass(frozen=True)
class YaRNScaling:
    """YaRN rotary frequency scaling (the ``rope_type: yarn`` entry of an HF config).

    ``mscale`` / ``mscale_all_dim`` only matter for V3.2's softmax scale; V4 uses the scaled
    frequencies without any magnitude factor.

    **Arguments:**

    - ``factor``: context extension factor; original_max_position_embeddings: the pre-training
        context length the frequencies are interpolated from.
    - ``beta_fast``, ``beta_slow``: rotations per context bounding the interpolated band.
    - ``mscale``, ``mscale_all_dim``: V3.2's magnitude factors (``None`` = 1).
    - ``truncate``: round the band's bounds to whole dimensions, as HF does.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        for f in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            v = getattr(self, f)
            _require(
                (v is None and f.startswith("mscale"))
                or (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)),
                f"rope_scaling.{f}",
                "must be a finite number" + (" or None" if f.startswith("mscale") else ""),
                v,
            )
        _require(self.factor >= 1.0, "rope_scaling.factor", "must be >= 1", self.factor)
        _positive(self, "original_max_position_embeddings")
        _require(
            self.beta_fast > self.beta_slow > 0,
            "rope_scaling.beta_fast",
            "must exceed beta_slow > 0",
            (self.beta_fast, self.beta_slow),
        )


_YARN_FIELDS = {f.name for f in dataclasses.fields(YaRNScaling)}


def _rope_scaling(cfg) -> None:
    """``rope_scaling`` is None, a ``YaRNScaling``, or a dict of its fields (converted, with an
    optional ``rope_type``/``type`` of ``"yarn"``) — nothing else."""
    v = cfg.rope_scaling
    if isinstance(v, dict):
        params = dict(v)
        kind = params.pop("rope_type", params.pop("type", "yarn"))
        _require(kind == "yarn", "rope_scaling", "given as a dict must be YaRN", kind)
        unknown = sorted(set(params) - _YARN_FIELDS)
        _require(not unknown, "rope_scaling", f"keys must be among {sorted(_YARN_FIELDS)}", unknown)
        missing = sorted({"factor", "original_max_position_embeddings"} - set(params))
        _require(not missing, "rope_scaling", f"lacks the key(s) {missing}", v)
        floats = {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
        params = {  # JSON gives 16 for 16.0
            k: float(x) if k in floats and type(x) is int else x for k, x in params.items()
        }
        object.__setattr__(cfg, "rope_scaling", YaRNScaling(**params))
        return
    _require(
        v is None or isinstance(v, YaRNScaling),
        "rope_scaling",
        "must be None, a YaRNScaling or a dict of its fields",
        v,
    )


# the sizes V4's and V3.2's configs share (same names, same rules): width, attention heads,
# query LoRA rank and the lightning indexer's heads, head dim and k
SHARED_SIZES = (
    "hidden_size",
    "num_heads",
    "q_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
)


def _check_shared_fields(config) -> None:
    """The checks of the fields V4's and V3.2's configs share (same names, same rules)."""
    _positive(config, *SHARED_SIZES)
    _finite_positive(config, "rope_theta", "rms_norm_eps")


@dataclasses.dataclass(frozen=True)
class V4FamilyConfig:
    """The sizes every layer of the DeepSeek-V4 family holds (``V4AttentionConfig``,
    ``V41AttentionConfig``), with their checks: the attention block (docs/concepts.md, "The
    DeepSeek-V4 attention block": q-LoRA, one shared key/value per token, the sliding window,
    the grouped output LoRA) and the lightning indexer's heads. Field names follow the HF
    config; ``index_*`` are the indexer's heads, head dim and ``k``, ``o_groups`` /
    ``o_lora_rank`` the grouped output LoRA.

    **Arguments:** the fields below; a subclass adds its own (and may change the defaults).
    Every field is checked in ``__post_init__``: a ``ValueError`` names the field, the rule and
    the value.
    """

    hidden_size: int = 4096
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YaRNScaling | dict | None = None  # a dict of YaRNScaling's fields is converted
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        _check_shared_fields(self)
        _positive(self, "head_dim", "o_groups", "o_lora_rank", "sliding_window")
        _non_negative(self, "rope_dim")
        _require(
            self.rope_dim % 2 == 0 and self.rope_dim <= min(self.head_dim, self.index_head_dim),
            "rope_dim",
            "must be even and at most head_dim and index_head_dim",
            self.rope_dim,
        )
        _require(
            self.num_heads % self.o_groups == 0,
            "o_groups",
            f"must divide num_heads={self.num_heads}",
            self.o_groups,
        )
        _even_unrotated(self, "head_dim", "rope_dim")
        _even_unrotated(self, "index_head_dim", "rope_dim")
        _finite_positive(self, "compress_rope_theta")
        _rope_scaling(self)


@dataclasses.dataclass(frozen=True)
class V4AttentionConfig(V4FamilyConfig):
    """One DeepSeek-V4 attention layer's architecture (docs/concepts.md, "The DeepSeek-V4
    attention block"). Field names follow the HF config; how the layer runs is
    ``csa_eqx.Execution``.

    ``compress_rate`` picks the layer type: 0 sliding window only, 4 CSA (overlapping
    compressor + lightning indexer), any other value > 4 HCA (all visible compressed entries).

    **Arguments:** ``compress_rate`` and the sizes of ``V4FamilyConfig`` (HF names). Every
    field is checked in ``__post_init__``: a ``ValueError`` names the field, the rule and the
    value.
    """

    compress_rate: int = 4

    def __post_init__(self):
        super().__post_init__()
        _non_negative(self, "compress_rate")
        _require(
            self.compress_rate == 0 or self.compress_rate >= 4,
            "compress_rate",
            "must be 0 (sliding), 4 (CSA) or > 4 (HCA)",
            self.compress_rate,
        )

    def __pdoc__(self, **kwargs):
        """The config as equinox prints it inside a module (``eqx.tree_pprint``, through
        ``wadler_lindig``): the fields that differ from their defaults, and ``compress_rate``
        always, since it names the layer type.

        **Arguments:** the printer's options (``indent``, ...).

        **Returns:** a ``wadler_lindig`` document."""
        import wadler_lindig as wl  # equinox's printer: present wherever this is called

        shown = [
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name == "compress_rate" or getattr(self, f.name) != f.default
        ]
        return wl.bracketed(
            begin=wl.TextDoc(f"{type(self).__name__}("),
            docs=wl.named_objs(shown, **kwargs),
            sep=wl.comma,
            end=wl.TextDoc(")"),
            indent=kwargs["indent"],
        )

    @property
    def layer_type(self) -> Literal["sliding", "csa", "hca"]:
        """**Returns:** ``"sliding"``, ``"csa"`` or ``"hca"``, from ``compress_rate``."""
        if self.compress_rate == 0:
            return "sliding"
        return "csa" if self.compress_rate == 4 else "hca"

    @property
    def has_indexer(self) -> bool:
        """**Returns:** whether the layer selects entries with an indexer (CSA only)."""
        return self.layer_type == "csa"


@dataclasses.dataclass(frozen=True)
class V32AttentionConfig:
    """One DeepSeek-V3.2 DSA layer's architecture (docs/concepts.md, "DeepSeek-V3.2 DSA"): MLA
    plus a lightning indexer over raw tokens. How it runs is ``csa_eqx.Execution``.

    Field names follow the HF config. ``rope_scaling`` (YaRN) rescales the rotary frequencies,
    multiplies the rotated channels by YaRN's attention factor (as HF's cos/sin do) and the
    softmax scale by ``yarn_mscale(rope_scaling)**2``.

    **Arguments:** the fields below (HF names; ``index_*`` as in ``V4AttentionConfig``), checked
    in ``__post_init__`` like V4's.
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
    rope_scaling: YaRNScaling | dict | None = None  # a dict of YaRNScaling's fields is converted
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        _check_shared_fields(self)
        _positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _require(
            self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= self.index_head_dim,
            "qk_rope_head_dim",
            f"must be even and at most index_head_dim={self.index_head_dim}",
            self.qk_rope_head_dim,
        )
        _rope_scaling(self)
