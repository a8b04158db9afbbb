"""The V4 family's lightning indexer, a part of every V4 and V4.1 layer that selects
(docs/concepts.md, "The lightning indexer"): per-head queries from the attention's q-LoRA
latent, per-head weights from the layer input and, for V4, the compressor of its keys. Where
the keys come from is the layer's parts' business (V4: this compressor; V4.1: its KV source's
index keys).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._config import V4FamilyConfig
from .._entries.compressor import AbstractCompressor
from .._numerics.base import EXACT, AbstractNumerics
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear
from .._rope import Rope
from .base import AbstractCandidateRule, AbstractIndexer, NoCandidates

__all__ = ["IndexerHeads"]


class IndexerHeads(AbstractIndexer):
    """The V4 family's indexer (an ``AbstractIndexer``): its query heads and head weights (HF:
    ``compressor.indexer.q_b_proj`` and ``.scorer.weights_proj``; DeepSeek: ``indexer.wq_b``,
    ``indexer.weights_proj``) and, in a V4 CSA layer, the compressor of its keys (HF:
    ``compressor.indexer.kv_proj``, ...).

    Both projections go through the numerics' ``linear``: ``q_b_proj`` an FP8 checkpoint's
    ``Fp8Weight`` under ``DeepSeekInference``, ``weights_proj`` a float array (DeepSeek keeps it
    in bf16: a bf16 product, rounded).

    **Arguments:**

    - ``config``: the layer's sizes (a ``V4FamilyConfig``); ``key`` and ``dtype``.
    - ``compressor``: the compressor of the keys it scores (V4's CSA layers; ``None``: the
        keys come from elsewhere, V4.1's KV source).
    - ``candidates``: its candidate rule (``NoCandidates()``; V4.1's index sources have theirs).
    """

    q_b_proj: Float[Array, "heads_x_dim q_lora"] | Fp8Weight
    weights_proj: Float[Array, "heads hidden"]
    compressor: AbstractCompressor | None
    heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    topk: int = eqx.field(static=True)
    rope: Rope = eqx.field(static=True)
    candidates: AbstractCandidateRule = eqx.field(static=True)

    def __init__(
        self,
        config: V4FamilyConfig,
        *,
        key: Array,
        dtype=jnp.float32,
        compressor: AbstractCompressor | None = None,
        candidates: AbstractCandidateRule = NoCandidates(),  # noqa: B008 (immutable)
    ):
        c = config
        k1, k2 = jax.random.split(key)
        self.q_b_proj = init_linear(k1, c.index_n_heads * c.index_head_dim, c.q_lora_rank, dtype)
        self.weights_proj = init_linear(k2, c.index_n_heads, c.hidden_size, dtype)
        self.compressor = compressor
        self.heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.rope = Rope(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
        self.candidates = candidates

    @property
    def query_weight(self) -> Float[Array, "heads_x_dim q_lora"] | Fp8Weight:
        """**Returns:** the query heads' projection (``q_b_proj``)."""
        return self.q_b_proj

    def rope_queries(self, q: Array, positions: Array) -> Array:
        """**Returns:** ``q`` roped by the compress table, in DeepSeek's interleaved pairs."""
        return self.rope.interleaved(q, positions)

    def head_weights(
        self, x: Float[Array, "batch seq hidden"], numerics: AbstractNumerics = EXACT
    ) -> Float[Array, "batch seq heads"]:
        """**Arguments:** the layer input ``x [B, S, hidden]`` and the layer's ``numerics``.

        **Returns:** float32 per-head weights ``[B, S, H_I]``, ``H_I^-1/2`` included (the
        product rounded to ``x``'s dtype first, as the numerics' ``linear`` rounds it).
        """
        return numerics.linear(x, self.weights_proj).astype(jnp.float32) * self.heads**-0.5
