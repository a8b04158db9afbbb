"""V4.1's compressor (docs/v41.md, "Compressor"), behind the compressor seam
(``csa_eqx._entries.compressor.AbstractCompressor``): disjoint groups of ``m`` tokens, each entry
published with its index key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._config import V4FamilyConfig
from .._layout import EntryLayout
from .._numerics.base import EXACT
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear, rms_norm, round_to
from .._rope import Rope
from .compressor import AbstractCompressor

__all__ = ["V41Compressor"]


class V41Compressor(AbstractCompressor):
    """A V4.1 KV source's compressor: ratio 1 one normed latent per token; ratio ``m > 1``
    disjoint groups of ``m`` tokens pooled with a float32 per-channel softmax gate (no position
    bias, no overlap), then normed. Each entry is its latent roped at the group's first
    position; the index keys ``RoPE(k_norm(latent · key_projᵀ))`` come from the same pre-RoPE
    latent, detached: only the indexer loss differentiates the keys, and it trains the
    indexer's weights (``key_proj``, ``key_norm``), never the compressor or the input (as V4's
    indexer compresses a detached input). Its entries are ``[entry ; index key]`` side by side
    (``widths``), which the layer splits.

    ``kv_proj``, ``gate_proj`` and ``kv_norm`` are DeepSeek's ``compressor.wkv``, ``.wgate``
    (absent at ratio 1) and ``.norm``; ``key_proj`` and ``key_norm`` its ``indexer.wk`` and
    ``indexer.k_norm``.

    **Arguments:** the layer's sizes (a ``V4FamilyConfig``), its ``ratio``, ``key`` and
    ``dtype``.
    """

    kv_proj: Float[Array, "dim hidden"] | Fp8Weight
    gate_proj: Float[Array, "dim hidden"] | Fp8Weight | None
    kv_norm: Float[Array, " dim"]
    key_proj: Float[Array, "index_dim dim"] | Fp8Weight
    key_norm: Float[Array, " index_dim"]

    def __init__(self, config: V4FamilyConfig, ratio: int, *, key: Array, dtype=jnp.float32):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        self.kv_proj = init_linear(k1, c.head_dim, c.hidden_size, dtype)
        self.gate_proj = init_linear(k2, c.head_dim, c.hidden_size, dtype) if ratio > 1 else None
        self.kv_norm = jnp.ones((c.head_dim,), jnp.float32)
        self.key_proj = init_linear(k3, c.index_head_dim, c.head_dim, dtype)
        self.key_norm = jnp.ones((c.index_head_dim,), jnp.float32)
        self.compress_rate, self.overlap = ratio, False
        self.rope = Rope(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
        self.eps = c.rms_norm_eps

    @property
    def position_bias(self) -> Array:
        """**Returns:** zeros ``[m, dim]``: V4.1 has no learned position bias."""
        return jnp.zeros((self.compress_rate, self.kv_proj.shape[0]), jnp.float32)

    def project(self, x, numerics=EXACT):
        """**Arguments:** ``x [B, S, hidden]`` (in the precision the numerics pool in) and the
        layer's ``numerics``.

        **Returns:** per-token ``(kv, gate)`` ``[B, S, dim]`` before pooling (the gate is zeros
        at ratio 1)."""
        kv = numerics.linear(x, self.kv_proj)
        if self.gate_proj is None:
            return kv, jnp.zeros_like(kv)
        return kv, numerics.linear(x, self.gate_proj)

    def pool(self, kv: Array, gate: Array, layout: EntryLayout) -> Array:
        """Ratio 1: each slot's own token (nothing to pool); else the gated groups (see
        ``AbstractCompressor.pool``)."""
        if self.compress_rate > 1:
            return super().pool(kv, gate, layout)
        rows = jnp.clip(layout.end, 0, kv.shape[1] - 1)
        return jnp.take_along_axis(kv, rows[..., None], axis=1)

    def widths(self) -> tuple[int, int]:
        return self.kv_proj.shape[0], self.kv_proj.shape[0] + self.key_proj.shape[0]

    def finish(self, pooled, positions, layout, dtype=None, numerics=EXACT):
        """The latent (RMSNorm of the pooled groups, rounded to ``dtype`` first), then the
        entries and index keys roped at each group's first position (see
        ``AbstractCompressor.finish``).

        **Returns:** ``[B, T, dim + index_dim]`` (entries, then keys)."""
        pooled = pooled if dtype is None else round_to(pooled, dtype)
        latent = rms_norm(pooled, self.kv_norm, self.eps)
        keys = numerics.linear(jax.lax.stop_gradient(latent), self.key_proj)
        keys = rms_norm(keys, self.key_norm, self.eps)
        entries, keys = (self.roped(a, positions, layout) for a in (latent, keys))
        return jnp.concatenate([entries, keys.astype(entries.dtype)], axis=-1)
