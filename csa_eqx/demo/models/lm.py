"""A small decoder LM whose layer schedule mixes sliding, CSA and HCA attention (or V3.2 DSA),
or is a DeepSeek-V4.1 stack (sliding, full, reindex and reuse layers sharing entries and
selections)."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ... import StackState
from ..._config import V4AttentionConfig, V4FamilyConfig, V32AttentionConfig
from ..._execution import Execution
from ..._layers.v4 import V4Attention
from ..._layers.v32 import V32Attention
from ..._layers.v41 import V41Attention
from ..._layers.v41_config import V41AttentionConfig
from ..._ops import init_linear, linear, rms_norm
from ...presets import v32_sized_as

__all__ = ["LMConfig", "DecoderLM", "Block", "FAMILIES"]

_RATES = {"sliding": 0, "csa": 4}
# the layer kinds of each family's schedules: V4 / V3.2 layers, or the roles of a V4.1 stack
FAMILIES = {"v4": ("sliding", "csa", "hca", "dsa"), "v41": ("sliding", "full", "reindex", "reuse")}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model shape. ``layers`` is the attention schedule: for ``family="v4"`` ``"sliding"``,
    ``"csa"``, ``"hca"`` (V4) or ``"dsa"`` (V3.2), for ``family="v41"`` the roles of a V4.1
    stack (``"sliding"``, ``"full"``, ``"reindex"``, ``"reuse"``: ``v41_config``);
    ``attention`` is the V4 template each layer specialises."""

    vocab_size: int
    layers: tuple[str, ...] = ("sliding", "csa", "hca")
    family: str = "v4"
    attention: V4AttentionConfig = V4AttentionConfig(
        hidden_size=128,
        num_heads=4,
        head_dim=64,
        rope_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=32,
        compress_rate=4,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
    )
    hca_rate: int = 16
    mlp_ratio: int = 2
    execution: Execution = Execution()

    def __post_init__(self):
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive (got {self.vocab_size})")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)} (got {self.family!r})")
        kinds = FAMILIES[self.family]
        bad = [kind for kind in self.layers if kind not in kinds]
        if bad or not self.layers:
            raise ValueError(
                f"layers must be a non-empty schedule of {'/'.join(kinds)} for the "
                f"{self.family} family (got {self.layers})"
            )
        if self.hca_rate <= 4:
            raise ValueError(f"hca_rate must be > 4 (got {self.hca_rate})")
        if self.family == "v41":
            self.v41_config()  # the stack's wiring checks its own schedule

    def layer_config(self, kind: str) -> V4AttentionConfig:
        rate = self.hca_rate if kind == "hca" else _RATES[kind]
        return dataclasses.replace(self.attention, compress_rate=rate)

    def v41_config(self) -> V41AttentionConfig:
        """The V4.1 stack of a ``"v41"`` schedule, with the template's sizes: every compressed
        layer at the template's ``compress_rate``; the ``"full"`` layers are KV sources, they
        and the ``"reindex"`` layers index sources; a full layer followed by a reindex layer is
        the candidate source, whose pre-filter keeps 4 blocks of 4 entries per query."""
        roles, m = self.layers, self.attention.compress_rate
        full = tuple(i for i, r in enumerate(roles) if r == "full")
        index = tuple(i for i, r in enumerate(roles) if r in ("full", "reindex"))
        consumer = any(r == "reindex" and full and i > full[0] for i, r in enumerate(roles))
        fields = dataclasses.fields(V4FamilyConfig)
        sizes = {f.name: getattr(self.attention, f.name) for f in fields}
        return V41AttentionConfig(
            **sizes,
            compress_ratios=tuple(0 if r == "sliding" else m for r in roles),
            kv_source_layers=full,
            index_source_layers=index,
            candidate_source_layer=full[0] if consumer else -1,
            candidate_topk_blocks=4 if consumer else 0,
            candidate_block_size=4 if consumer else 0,
        )


class Block(eqx.Module):
    """Pre-norm residual block: attention, then a SwiGLU MLP."""

    attn_norm: Float[Array, " hidden"]
    attn: eqx.Module
    mlp_norm: Float[Array, " hidden"]
    w_gate: Float[Array, "ffn hidden"]
    w_up: Float[Array, "ffn hidden"]
    w_down: Float[Array, "hidden ffn"]

    def __init__(self, attn: eqx.Module, hidden: int, ffn: int, *, key: Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn_norm = jnp.ones((hidden,))
        self.attn = attn
        self.mlp_norm = jnp.ones((hidden,))
        self.w_gate = init_linear(k1, ffn, hidden)
        self.w_up = init_linear(k2, ffn, hidden)
        self.w_down = init_linear(k3, hidden, ffn)

    def __call__(
        self,
        h: Array,
        segment_ids: Array | None,
        return_aux: bool,
        indexer_loss: str | None = None,
        shared: Any = StackState(),  # noqa: B008 (an immutable empty state)
    ):
        """The block over ``h``, from the state the earlier layers published (``shared``: a
        ``StackState`` at the first layer, then whatever the layers return, ``V41Shared`` in a
        V4.1 stack).

        **Returns:** ``(h, aux or None, shared)``."""
        eps = 1e-6
        out, shared, *aux = self.attn(
            rms_norm(h, self.attn_norm, eps),
            segment_ids=segment_ids,
            return_aux=return_aux,
            indexer_loss=indexer_loss,
            shared=shared,
        )
        return self.mlp(h + out), aux[0] if aux else None, shared

    def mlp(self, h: Array) -> Array:
        """The residual SwiGLU MLP half of the block."""
        z = rms_norm(h, self.mlp_norm, 1e-6)
        return h + linear(jax.nn.silu(linear(z, self.w_gate)) * linear(z, self.w_up), self.w_down)

    def extend(self, h: Array, cache, lengths: Array | None, segment_ids: Array | None, shared):
        """The block over a chunk that follows ``cache`` (the layer's ``extend``).

        **Returns:** ``(h, cache, shared)``."""
        x = rms_norm(h, self.attn_norm, 1e-6)
        out, cache, shared = self.attn.extend(x, cache, lengths, segment_ids, shared=shared)
        return self.mlp(h + out), cache, shared


def dsa_config(t: V4AttentionConfig) -> V32AttentionConfig:
    """The V3.2 DSA layer matching a V4 template's sizes."""
    return v32_sized_as(
        t,
        kv_lora_rank=t.head_dim,
        qk_nope_head_dim=t.head_dim - t.rope_dim,
        qk_rope_head_dim=t.rope_dim,
        v_head_dim=t.head_dim,
        rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps,
    )


def _make_attention(cfg: LMConfig, i: int, kind: str, key: Array) -> eqx.Module:
    if cfg.family == "v41":
        return V41Attention(cfg.v41_config(), i, key=key, execution=cfg.execution)
    if kind == "dsa":
        return V32Attention(dsa_config(cfg.attention), key=key, execution=cfg.execution)
    return V4Attention(cfg.layer_config(kind), key=key, execution=cfg.execution)


class DecoderLM(eqx.Module):
    """Token embedding, a stack of ``Block`` s, final RMSNorm and an untied LM head."""

    embed: Float[Array, "vocab hidden"]
    blocks: tuple[Block, ...]
    norm: Float[Array, " hidden"]
    head: Float[Array, "vocab hidden"]
    config: LMConfig = eqx.field(static=True)

    def __init__(self, config: LMConfig, *, key: Array):
        d = config.attention.hidden_size
        keys = jax.random.split(key, 2 * len(config.layers) + 2)
        self.embed = jax.random.normal(keys[0], (config.vocab_size, d)) * 0.02
        self.blocks = tuple(
            Block(
                _make_attention(config, i, kind, keys[2 + 2 * i]),
                d,
                config.mlp_ratio * d,
                key=keys[3 + 2 * i],
            )
            for i, kind in enumerate(config.layers)
        )
        self.norm = jnp.ones((d,))
        self.head = init_linear(keys[1], config.vocab_size, d)
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        segment_ids: Int[Array, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
    ):
        """Logits ``[B, S, vocab]``; with ``return_aux`` also ``{"selections": per-layer
        selections (None for layers without an indexer), "indexer_loss": summed KL loss}``.
        ``indexer_loss`` is the indexers' training stage for this call (``"off"``, ``"dense"``,
        ``"sparse"``; ``None``: ``config.execution.indexer_loss``)."""
        h, auxes, shared = self.embed[tokens], [], StackState()
        for block in self.blocks:
            h, aux, shared = block(h, segment_ids, return_aux, indexer_loss, shared)
            auxes.append(aux)
        logits = linear(rms_norm(h, self.norm, 1e-6), self.head)
        if not return_aux:
            return logits
        losses = [a["indexer_loss"] for a in auxes if a["indexer_loss"] is not None]
        return logits, {
            "selections": [a["selection"] for a in auxes],
            "indexer_loss": sum(losses) if losses else jnp.zeros(()),
        }

    def init_caches(self, batch_size: int, max_length: int, dtype=jnp.float32) -> tuple:
        """One empty decode cache per block."""
        return tuple(b.attn.init_cache(batch_size, max_length, dtype) for b in self.blocks)

    def extend(
        self,
        tokens: Int[Array, "batch seq"],
        caches: tuple,
        lengths: Int[Array, " batch"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq vocab"], tuple]:
        """Logits of a chunk that follows ``caches`` and the updated caches (prefill, chunked
        prefill or one decode step; equal to the full forward over the whole stream)."""
        h, new, shared = self.embed[tokens], [], StackState()
        for block, cache in zip(self.blocks, caches, strict=True):
            h, cache, shared = block.extend(h, cache, lengths, segment_ids, shared)
            new.append(cache)
        return linear(rms_norm(h, self.norm, 1e-6), self.head), tuple(new)
