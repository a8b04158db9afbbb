"""DeepSeek-V3.2's lightning indexer (docs/concepts.md, "DeepSeek-V3.2 DSA"): it scores every
earlier token of the segment through one shared key per token and keeps the top-k."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._config import V32AttentionConfig
from .._numerics.base import EXACT, AbstractNumerics
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear, round_to, upcast
from .._rope import apply_rope_half_split, yarn_table
from .base import AbstractCandidateRule, AbstractIndexer, NoCandidates

__all__ = ["V32Indexer"]

# The indexer's key LayerNorm uses a fixed epsilon in DeepSeek's reference and in HF.
_INDEXER_NORM_EPS = 1e-6


def _layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis in (at least) float32 (biased variance), rounded back."""
    xf = upcast(x)
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return round_to(y * weight.astype(xf.dtype) + bias.astype(xf.dtype), x.dtype)


class V32Indexer(AbstractIndexer):
    """V3.2 lightning indexer (an ``AbstractIndexer``; docs/concepts.md, "DeepSeek-V3.2 DSA"):
    scores every earlier token of the segment, keeps the top-k.

    ``wq_b`` and ``wk`` project through the numerics' ``linear`` (an FP8 checkpoint's
    ``Fp8Weight`` under ``DeepSeekInference``), ``weights_proj`` in float32.

    **Arguments:**

    - ``config``: the layer's ``V32AttentionConfig``.
    - ``key``: PRNG key for the random initial weights; dtype: their dtype.
    """

    wq_b: Float[Array, "heads_x_dim q_lora"] | Fp8Weight
    wk: Float[Array, "dim hidden"] | Fp8Weight
    k_norm: Float[Array, " dim"]
    k_norm_bias: Float[Array, " dim"]
    weights_proj: Float[Array, "heads hidden"]
    config: V32AttentionConfig = eqx.field(static=True)
    candidates: ClassVar[AbstractCandidateRule] = NoCandidates()

    def __init__(self, config: V32AttentionConfig, *, key: Array, dtype=jnp.float32):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        self.wq_b = init_linear(k1, c.index_n_heads * c.index_head_dim, c.q_lora_rank, dtype)
        self.wk = init_linear(k2, c.index_head_dim, c.hidden_size, dtype)
        self.k_norm = jnp.ones((c.index_head_dim,), jnp.float32)
        self.k_norm_bias = jnp.zeros((c.index_head_dim,), jnp.float32)
        self.weights_proj = init_linear(k3, c.index_n_heads, c.hidden_size, dtype)
        self.config = config

    @property
    def topk(self) -> int:
        """**Returns:** the tokens each query picks (``index_topk``)."""
        return self.config.index_topk

    def _rope(self, x: Array, positions: Array) -> Array:
        """Half-split RoPE on the first ``qk_rope_head_dim`` channels (YaRN-scaled)."""
        c = self.config
        r = c.qk_rope_head_dim
        inv_freq, factor = yarn_table(r, c.rope_theta, c.rope_scaling)
        rot = apply_rope_half_split(x[..., :r], positions, inv_freq) * factor
        return jnp.concatenate([round_to(rot, x.dtype), x[..., r:]], axis=-1)

    @property
    def heads(self) -> int:
        """**Returns:** the query heads (``index_n_heads``)."""
        return self.config.index_n_heads

    @property
    def query_weight(self) -> Float[Array, "heads_x_dim q_lora"] | Fp8Weight:
        """**Returns:** the query heads' projection (``wq_b``)."""
        return self.wq_b

    def rope_queries(self, q: Array, positions: Array) -> Array:
        """**Returns:** ``q`` with V3.2's half-split, YaRN-scaled RoPE (as the keys)."""
        return self._rope(q, positions)

    def keys(
        self,
        x: Float[Array, "batch seq hidden"],
        positions: Int[Array, "batch seq"],
        numerics: AbstractNumerics = EXACT,
    ) -> Float[Array, "batch seq dim"]:
        """**Arguments:** the layer input ``x [B, S, hidden]``, int32 ``positions [B, S]`` and
        the layer's ``numerics``.

        **Returns:** the one shared key per token, ``RoPE(LayerNorm(x W_k))`` ``[B, S, d_I]``.
        """
        k = numerics.linear(x, self.wk)
        k = _layer_norm(k, self.k_norm, self.k_norm_bias, _INDEXER_NORM_EPS)
        return self._rope(k, positions)

    def head_weights(
        self, x: Float[Array, "batch seq hidden"], numerics: AbstractNumerics = EXACT
    ) -> Float[Array, "batch seq heads"]:
        """As ``csa_eqx.IndexerHeads.head_weights``, in float32 whatever ``x``'s dtype
        (DeepSeek's code projects ``x.float()`` with a float32 weight: nothing rounded to
        bf16)."""
        return numerics.linear(upcast(x), self.weights_proj) * self.config.index_n_heads**-0.5
