"""The DeepSeek-V4 family's attention block, a part of every V4 and V4.1 layer (docs/concepts.md,
"The DeepSeek-V4 attention block"): the q-LoRA queries, one shared key/value per token read
through the sliding window, the per-head attention sinks and the grouped output LoRA. What a
layer reads besides its window (compressed entries, a selection) comes from elsewhere
(``csa_eqx._layers.parts``).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._config import V4FamilyConfig
from .._numerics.base import EXACT, AbstractNumerics
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear, rms_norm, round_to
from .._rope import Rope

__all__ = ["V4Block"]


class V4Block(eqx.Module):
    """The attention block of a V4-family layer. Parameters use the HF module's names and
    torch's ``[out, in]`` layout (DeepSeek's: ``wq_a`` = ``q_a_proj``, ``q_norm`` = ``q_a_norm``,
    ``wq_b``, ``wkv`` = ``kv_proj``, ``kv_norm``, ``wo_a`` = ``o_a_proj``, ``wo_b``,
    ``attn_sink`` = ``sinks``). The projections go through the numerics' ``linear``; a loader
    under ``DeepSeekInference`` keeps ``q_a_proj``, ``q_b_proj``, ``kv_proj`` and ``o_b_proj``
    as the checkpoint's ``Fp8Weight``. ``o_a_proj`` is always a float array (the grouped einsum;
    DeepSeek's ``convert.py`` dequantises ``wo_a``: ``dequantised_at_load``).

    **Arguments:**

    - ``config``: the layer's sizes (a ``V4FamilyConfig``).
    - ``compressed``: whether the layer reads compressed entries: its RoPE is then the
        (YaRN-scaled) ``compress_rope_theta`` table, else plain ``rope_theta``.
    - ``query_norm``: an RMSNorm (no weight) on each query head before RoPE (V4's; V4.1 has
        none).
    - ``key``: PRNG key of the random initial weights; ``dtype``: their dtype (norms and sinks
        stay float32).
    """

    q_a_proj: Float[Array, "q_lora hidden"] | Fp8Weight
    q_a_norm: Float[Array, " q_lora"]
    q_b_proj: Float[Array, "heads_x_dim q_lora"] | Fp8Weight
    kv_proj: Float[Array, "dim hidden"] | Fp8Weight
    kv_norm: Float[Array, " dim"]
    o_a_proj: Float[Array, "groups_x_rank group_in"]
    o_b_proj: Float[Array, "hidden groups_x_rank"] | Fp8Weight
    sinks: Float[Array, " heads"]
    head_dim: int = eqx.field(static=True)
    o_lora_rank: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    query_norm: bool = eqx.field(static=True)
    rope: Rope = eqx.field(static=True)
    dequantised_at_load: ClassVar[tuple[str, ...]] = ("o_a_proj",)

    def __init__(
        self,
        config: V4FamilyConfig,
        *,
        compressed: bool,
        query_norm: bool,
        key: Array,
        dtype=jnp.float32,
    ):
        c = config
        ks = jax.random.split(key, 5)
        self.q_a_proj = init_linear(ks[0], c.q_lora_rank, c.hidden_size, dtype)
        self.q_a_norm = jnp.ones((c.q_lora_rank,), jnp.float32)
        self.q_b_proj = init_linear(ks[1], c.num_heads * c.head_dim, c.q_lora_rank, dtype)
        self.kv_proj = init_linear(ks[2], c.head_dim, c.hidden_size, dtype)
        self.kv_norm = jnp.ones((c.head_dim,), jnp.float32)
        group_in = c.num_heads * c.head_dim // c.o_groups
        self.o_a_proj = init_linear(ks[3], c.o_groups * c.o_lora_rank, group_in, dtype)
        self.o_b_proj = init_linear(ks[4], c.hidden_size, c.o_groups * c.o_lora_rank, dtype)
        self.sinks = jnp.zeros((c.num_heads,), jnp.float32)
        self.head_dim, self.o_lora_rank = c.head_dim, c.o_lora_rank
        self.eps, self.query_norm = c.rms_norm_eps, query_norm
        plain = Rope(c.rope_dim, c.rope_theta)
        self.rope = Rope(c.rope_dim, c.compress_rope_theta, c.rope_scaling) if compressed else plain

    @property
    def inv_freq(self):
        """**Returns:** the RoPE inverse frequencies ``[rope_dim // 2]`` (float32 numpy): plain
        ``rope_theta`` for a sliding layer, the YaRN-scaled ``compress_rope_theta`` for one
        that reads compressed entries."""
        return self.rope.inv_freq()

    @property
    def scale(self) -> float:
        """**Returns:** the softmax scale ``head_dim^-1/2``."""
        return self.head_dim**-0.5

    def project_qkv(
        self,
        x: Float[Array, "batch seq hidden"],
        positions: Int[Array, "batch seq"],
        numerics: AbstractNumerics = EXACT,
    ) -> tuple[
        Float[Array, "batch seq q_lora"],
        Float[Array, "batch seq heads dim"],
        Float[Array, "batch seq dim"],
    ]:
        """**Arguments:** ``x [B, S, hidden]``, int32 RoPE ``positions [B, S]`` and the layer's
        ``numerics`` (its projections and per-head norm).

        **Returns:** the query latent ``qr [B, S, q_lora_rank]``, the roped per-head queries
        ``[B, S, H, head_dim]`` (RMS-normed per head first when ``query_norm``) and the roped
        shared key/value ``[B, S, head_dim]`` (before the numerics round it).
        """
        b, s, _ = x.shape
        nx = numerics
        qr = rms_norm(nx.linear(x, self.q_a_proj), self.q_a_norm, self.eps)

        def queries(qr):
            # heads from the weights, not the config: under head parallelism a device holds some
            q = nx.linear(qr, self.q_b_proj).reshape(b, s, -1, self.head_dim)
            if self.query_norm:
                q = nx.head_norm(q, self.eps)
            return self.rope.interleaved(q, positions[..., None])

        # recomputed from qr in the backward: the pre-norm [B, S, H, head_dim] is not saved
        q = jax.checkpoint(queries)(qr)
        kv = rms_norm(nx.linear(x, self.kv_proj), self.kv_norm, self.eps)
        return qr, q, self.rope.interleaved(kv, positions)

    def project_out(
        self,
        o: Float[Array, "batch seq heads dim"],
        positions: Int[Array, "batch seq"],
        numerics: AbstractNumerics = EXACT,
    ) -> Float[Array, "batch seq hidden"]:
        """De-rotate the attention output (RoPE at ``-t``), then the grouped output projection
        (docs/concepts.md, "The DeepSeek-V4 attention block").

        **Arguments:** ``o [B, S, H, head_dim]``, the queries' ``positions [B, S]`` and the
        layer's ``numerics`` (``o_b_proj``'s product).

        **Returns:** ``[B, S, hidden]``.
        """
        b, s = o.shape[:2]
        o = self.rope.interleaved(o, -positions[..., None])
        groups = self.o_a_proj.shape[0] // self.o_lora_rank  # this device's, under head parallelism
        o = o.reshape(b, s, groups, -1, self.head_dim).reshape(b, s, groups, -1)
        w_a = self.o_a_proj.reshape(groups, self.o_lora_rank, -1).astype(o.dtype)
        acc = jnp.promote_types(o.dtype, jnp.float32)
        # DeepSeek's bf16 einsum rounds its result, which its FP8 product then quantises
        o = round_to(jnp.einsum("bsgi,goi->bsgo", o, w_a, preferred_element_type=acc), o.dtype)
        return numerics.linear(o.reshape(b, s, -1), self.o_b_proj)

    @staticmethod
    def head_specs(axis: str) -> dict[str, P]:
        """Head parallelism over ``axis``: the query projection's rows, the sinks, the grouped
        ``o_a_proj``'s rows and ``o_b_proj``'s input columns are split (heads and groups are
        contiguous blocks, so each device's heads feed its groups); the rest is replicated. An
        ``Fp8Weight`` is split with its scales (whole tiles per device).

        **Returns:** the split arrays' ``PartitionSpec`` by attribute name."""
        return {
            "q_b_proj": P(axis, None),
            "sinks": P(axis),
            "o_a_proj": P(axis, None),
            "o_b_proj": P(None, axis),
        }

    def window_cache(self, batch_size: int, window: int, dtype) -> dict[str, Array]:
        """**Arguments:** the cache's ``batch_size``, the sliding ``window`` and the keys'
        ``dtype``.

        **Returns:** an empty ring of the last ``window - 1`` tokens: ``window_kv`` (zeros) and
        ``window_segment`` (``-1`` = empty), as ``csa_eqx.V4Cache`` holds them."""
        return {
            "window_kv": jnp.zeros((batch_size, window - 1, self.head_dim), dtype),
            "window_segment": jnp.full((batch_size, window - 1), -1, jnp.int32),
        }
