"""DeepSeek-V3.2 DSA layer: MLA whose queries attend only to the tokens a lightning indexer
selects (docs/concepts.md,
"DeepSeek-V3.2 DSA").

The MLA runs in its absorbed form: every head's query is mapped into the kv latent
(``q_nope · W_kb_h``) so all heads share one key ``[c_kv ; k_rope]`` and one value ``c_kv``
per token; the sparse attention gathers each query's selected latents and ``W_vb_h`` maps the
result back to per-head values. This equals expanding keys and values per head, which is what
DeepSeek's inference code does in its prefill, in bf16 torch ops: under numerics that follow it
(``numerics.expanded_attention``: ``DeepSeekInference``) the layer attends in that form
(``_expanded_attention``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._attention.auto import expanded_query_block
from .._attention.reads import picked_mask
from .._backend import backend_tiles
from .._config import V32AttentionConfig, YaRNScaling
from .._layout import Visibility
from .._loss.base import AttentionTarget
from .._numerics.base import EXACT, V32_FORMATS, AbstractNumerics, DeepSeekFormats
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear, rms_norm, round_to, upcast
from .._placement.heads import split_specs
from .._rope import apply_rope_half_split, apply_rope_interleaved, rope_inv_freq, yarn_mscale
from .._tiles import map_row_blocks
from .base import AbstractIndexedAttention
from .cache import V32Cache, check_cache_size, empty_rows
from .execution import Execution, checked_execution
from .forward import Forward

__all__ = ["V32Attention", "V32Indexer"]

# The indexer's key LayerNorm uses a fixed epsilon in DeepSeek's reference and in HF.
_INDEXER_NORM_EPS = 1e-6


def _yarn_attention_factor(scaling: YaRNScaling | None) -> float:
    """YaRN's magnitude factor on the rotated channels (HF folds it into cos/sin); 1 if off."""
    if scaling is None or scaling.factor <= 1:
        return 1.0

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale(1.0)


def _layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis in (at least) float32 (biased variance), rounded back."""
    xf = upcast(x)
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return round_to(y * weight.astype(xf.dtype) + bias.astype(xf.dtype), x.dtype)


def _rotary(config: V32AttentionConfig):
    """Inverse frequencies and YaRN attention factor shared by the MLA and the indexer."""
    c = config
    inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    return inv_freq, _yarn_attention_factor(c.rope_scaling)


class V32Indexer(eqx.Module):
    """V3.2 lightning indexer (docs/concepts.md, "DeepSeek-V3.2 DSA"): scores every earlier
    token of the segment, keeps the top-k.

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

    def __init__(self, config: V32AttentionConfig, *, key: Array, dtype=jnp.float32):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        self.wq_b = init_linear(k1, c.index_n_heads * c.index_head_dim, c.q_lora_rank, dtype)
        self.wk = init_linear(k2, c.index_head_dim, c.hidden_size, dtype)
        self.k_norm = jnp.ones((c.index_head_dim,), jnp.float32)
        self.k_norm_bias = jnp.zeros((c.index_head_dim,), jnp.float32)
        self.weights_proj = init_linear(k3, c.index_n_heads, c.hidden_size, dtype)
        self.config = config

    def _rope(self, x: Array, positions: Array) -> Array:
        """Half-split RoPE on the first ``qk_rope_head_dim`` channels (YaRN-scaled)."""
        r = self.config.qk_rope_head_dim
        inv_freq, factor = _rotary(self.config)
        rot = apply_rope_half_split(x[..., :r], positions, inv_freq) * factor
        return jnp.concatenate([round_to(rot, x.dtype), x[..., r:]], axis=-1)

    def queries(
        self,
        qr: Float[Array, "batch seq q_lora"],
        positions: Int[Array, "batch seq"],
        numerics: AbstractNumerics = EXACT,
    ) -> Float[Array, "batch seq heads dim"]:
        """As ``csa_eqx.IndexerHeads.queries``, with V3.2's half-split, YaRN-scaled RoPE."""
        c = self.config
        b, s, _ = qr.shape
        q = numerics.linear(qr, self.wq_b).reshape(b, s, c.index_n_heads, c.index_head_dim)
        return self._rope(q, positions[..., None])

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


class V32Attention(AbstractIndexedAttention):
    """One DeepSeek-V3.2 attention layer (MLA + DSA).

    Parameters use the HF module's names and torch's ``[out, in]`` layout (``k_norm_bias`` holds
    ``indexer.k_norm.bias``), so ``csa_eqx.hf.load_v32_attention`` is a plain copy. Every
    projection goes through the numerics' ``linear``; under ``DeepSeekInference`` a loader keeps
    an FP8 checkpoint's ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
    ``o_proj``, ``indexer.wq_b`` and ``indexer.wk`` as ``Fp8Weight`` (the absorbed form
    dequantises ``kv_b_proj``, as DeepSeek's decode does).

    **Arguments:** ``config`` (a ``V32AttentionConfig``), ``key``, ``dtype``, ``execution``, as in
    ``csa_eqx.AbstractIndexedAttention``.
    """

    q_a_proj: Float[Array, "q_lora hidden"] | Fp8Weight
    q_a_layernorm: Float[Array, " q_lora"]
    q_b_proj: Float[Array, "heads_x_qk q_lora"] | Fp8Weight
    kv_a_proj_with_mqa: Float[Array, "kv_lora_plus_rope hidden"] | Fp8Weight
    kv_a_layernorm: Float[Array, " kv_lora"]
    kv_b_proj: Float[Array, "heads_x_kv kv_lora"] | Fp8Weight
    o_proj: Float[Array, "hidden heads_x_v"] | Fp8Weight
    indexer: V32Indexer
    config: V32AttentionConfig = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V32_FORMATS

    def __init__(
        self, config: V32AttentionConfig, *, key: Array, dtype=jnp.float32, execution=None
    ):
        """A randomly initialised layer (``csa_eqx.hf`` loads weights): ``config``, PRNG
        ``key``, parameter ``dtype`` (norms stay float32) and ``execution`` (``None``:
        automatic), as ``AbstractIndexedAttention`` says."""
        c = config
        execution = checked_execution(execution, c, V32_FORMATS)
        ks = jax.random.split(key, 6)
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.q_a_proj = init_linear(ks[0], c.q_lora_rank, c.hidden_size, dtype)
        self.q_a_layernorm = jnp.ones((c.q_lora_rank,), jnp.float32)
        self.q_b_proj = init_linear(ks[1], c.num_heads * qk, c.q_lora_rank, dtype)
        self.kv_a_proj_with_mqa = init_linear(
            ks[2], c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size, dtype
        )
        self.kv_a_layernorm = jnp.ones((c.kv_lora_rank,), jnp.float32)
        self.kv_b_proj = init_linear(
            ks[3], c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, dtype
        )
        self.o_proj = init_linear(ks[4], c.hidden_size, c.num_heads * c.v_head_dim, dtype)
        self.indexer = V32Indexer(c, key=ks[5], dtype=dtype)
        self.config = config
        self.execution = execution

    @property
    def softmax_scale(self) -> float:
        """``(d_nope + d_rope)^-1/2``, times YaRN's ``mscale²`` when the config uses YaRN."""
        c = self.config
        return (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5 * yarn_mscale(c.rope_scaling) ** 2

    def _kv_up(self, dtype) -> tuple[Array, Array]:
        """Per-head ``W_kb`` ``[H, d_nope, kv_lora]`` and ``W_vb`` ``[H, d_v, kv_lora]`` in
        ``dtype`` (an ``Fp8Weight`` dequantised, as DeepSeek's absorbed decode does)."""
        c = self.config
        w = self.kv_b_proj
        w = w.dequantize(dtype) if isinstance(w, Fp8Weight) else w.astype(dtype)
        # heads from the weights, not the config: under head parallelism a device holds some
        w_kv = w.reshape(-1, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w_kv[:, : c.qk_nope_head_dim], w_kv[:, c.qk_nope_head_dim :]

    def project_qkv(
        self, x: Float[Array, "batch seq hidden"], positions: Int[Array, "batch seq"]
    ) -> tuple[
        Float[Array, "batch seq q_lora"],
        Float[Array, "batch seq heads latent"],
        Float[Array, "batch seq latent"],
    ]:
        """**Arguments:** ``x [B, S, hidden]`` and int32 RoPE ``positions [B, S]``.

        **Returns:** the query latent ``qr [B, S, q_lora_rank]``, absorbed per-head queries
        ``[q_nope·W_kb ; q_rope]`` ``[B, S, H, latent]`` and the shared per-token key
        ``[c_kv ; k_rope]`` ``[B, S, latent]`` (its first ``kv_lora_rank`` channels are the
        value; as the numerics round it), ``latent = kv_lora_rank + qk_rope_head_dim``.
        """
        qr, q_nope, q_rope, keys = self._project(x, positions)
        return qr, self._absorbed(q_nope, q_rope), keys

    def _project(self, x, positions) -> tuple[Array, Array, Array, Array]:
        """``project_qkv`` before the absorption: ``(qr, q_nope [B, S, H, d_nope], q_rope
        [B, S, H, d_rope], keys)``."""
        c, nx = self.config, self.execution.numerics
        b, s, _ = x.shape
        inv_freq, rope_factor = _rotary(c)
        qr = rms_norm(nx.linear(x, self.q_a_proj), self.q_a_layernorm, c.rms_norm_eps)
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        q = nx.linear(qr, self.q_b_proj).reshape(b, s, -1, qk)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        q_rope = apply_rope_interleaved(q_rope, positions[..., None], inv_freq) * rope_factor

        latent = nx.linear(x, self.kv_a_proj_with_mqa)
        c_kv = rms_norm(latent[..., : c.kv_lora_rank], self.kv_a_layernorm, c.rms_norm_eps)
        k_rope = apply_rope_interleaved(latent[..., c.kv_lora_rank :], positions, inv_freq)
        keys = jnp.concatenate([c_kv, round_to(k_rope * rope_factor, c_kv.dtype)], axis=-1)
        # the latent as the numerics round it before it is cached and read (DeepSeek's FP8 KV)
        keys = nx.kv(keys, c.qk_rope_head_dim, self.formats)
        return qr, q_nope, round_to(q_rope, q.dtype), keys

    def _absorbed(self, q_nope: Array, q_rope: Array) -> Array:
        """The absorbed per-head queries ``[q_nope·W_kb ; q_rope]`` ``[B, S, H, latent]``."""
        q_latent = jnp.einsum("bshn,hnc->bshc", q_nope, self._kv_up(q_nope.dtype)[0])
        return jnp.concatenate([q_latent, q_rope], axis=-1)

    def _attend(self, queries, keys, visibility, selection, stage, return_lse=False):
        """MLA over the tokens the stage reads (forward and ``extend``): every visible one in
        the dense warm-up, else the picks as ``execution.picks`` says."""
        ex = self.execution
        values = keys[..., : self.config.kv_lora_rank]
        reads = ex.entry_reads(keys, visibility, selection, stage, values)
        return ex.attend(queries, reads, None, self.softmax_scale, return_lse=return_lse)

    def project_out(
        self, o: Float[Array, "batch seq heads kv_lora"]
    ) -> Float[Array, "batch seq hidden"]:
        """Per-head values from the attended latents (``W_vb``), then the output projection.

        **Arguments:** the attended latents ``o [B, S, H, kv_lora_rank]``.

        **Returns:** ``[B, S, hidden]``.
        """
        b, s = o.shape[:2]
        o = jnp.einsum("bshc,hvc->bshv", o, self._kv_up(o.dtype)[1]).reshape(b, s, -1)
        return self.execution.numerics.linear(o, self.o_proj)

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism over ``axis``: the rows of ``q_b_proj`` and ``kv_b_proj`` (per-head
        queries and up-projections) and ``o_proj``'s input columns are split; every other
        array (the MLA latent, the indexer) is replicated. See
        ``AbstractIndexedAttention.head_specs``."""
        specs = split_specs(
            {"q_b_proj": P(axis, None), "kv_b_proj": P(axis, None), "o_proj": P(None, axis)}
        )
        return specs, {"num_heads": self.config.num_heads}

    @property
    def selects(self) -> bool:
        """**Returns:** ``True``: the MLA reads the tokens its indexer selects."""
        return True

    @property
    def entry_rate(self) -> int:
        """**Returns:** 1 (every token is an entry the indexer selects among)."""
        return 1

    @property
    def context_halo(self) -> int:
        """**Returns:** 0: a chunk's rows need nothing of the rows before them but their keys,
        which context parallelism all-gathers (``Rows.gather``)."""
        return 0

    def forward_rows(self, x, source, stage, want_loss=False, shared=None):
        """The pipeline over ``source`` (see ``AbstractIndexedAttention.forward_rows``): sparse
        MLA over the tokens the indexer selects (docs/concepts.md, "DeepSeek-V3.2 DSA"); in
        the ``"dense"`` stage, the warm-up: plain causal MLA over every earlier token of the
        segment. Every token is its own entry: under context parallelism the rows' MLA latents
        and indexer keys are all-gathered into the whole sequence's; ``extend`` appends them
        to the cache's. It publishes nothing (``shared`` is not read)."""
        positions, nx = source.positions, self.execution.numerics
        qr, q_nope, q_rope, keys = self._project(x, positions)
        # the selection ignores gradients and the loss must train the indexer only, never x
        index_keys = nx.indexer(
            self.indexer.keys(jax.lax.stop_gradient(x), positions, nx), self.formats
        )
        keys, layout, source = source.tokens("latent", keys)
        index_keys, _, source = source.tokens("index_keys", index_keys)
        keys = keys.astype(q_nope.dtype)
        visibility = Visibility(source.query_index, source.segment, layout)
        problem = self.indexer_problem(x, qr, positions, index_keys, visibility)
        selection = self.execution.select(problem, self.config.index_topk)
        expanded = nx.expanded_attention(self.formats)
        queries = None if expanded and not want_loss else self._absorbed(q_nope, q_rope)
        if expanded:
            o = self._expanded_attention(q_nope, q_rope, keys, visibility, selection, stage)
            y = nx.linear(o[0].reshape(*o[0].shape[:2], -1), self.o_proj)
        else:
            o = self._attend(queries, keys, visibility, selection, stage, want_loss)
            y = self.project_out(o[0] if want_loss else o)
        target = None
        if want_loss:  # KL distillation against the absorbed MLA queries and keys attended
            target = AttentionTarget(queries, keys, o[1], self.softmax_scale)
        return Forward(y, selection, problem, target, source, {})

    def _expanded_attention(self, q_nope, q_rope, keys, visibility, selection, stage):
        """DeepSeek-V3.2's prefill attention (its ``MLA.forward`` with a mask): each head's keys
        ``[k_nope ; k_rope]`` and values from the cached latent through ``kv_b_proj`` (the
        numerics' ``linear``: DeepSeek's FP8 product), the scores, the scaled scores, the
        softmax and ``P·V`` each rounded to the activations' dtype (bf16), over the tokens the
        stage reads (every visible one in the warm-up, else the picks); queries in blocks
        (``Execution.query_block``, else ``csa_eqx._auto.expanded_query_block``).

        **Returns:** ``(o [B, S, H, d_v], lse [B, S, H])``; a query that sees a non-finite key
        or value (or whose own query is) returns NaN, one that sees nothing zeros."""
        c, ex = self.config, self.execution
        b, s, _, _ = q_nope.shape
        t, dt = keys.shape[1], q_nope.dtype
        kv = ex.numerics.linear(keys[..., : c.kv_lora_rank], self.kv_b_proj)
        kv = kv.reshape(b, t, -1, c.qk_nope_head_dim + c.v_head_dim)
        heads = kv.shape[2]
        rope = keys[:, :, None, c.kv_lora_rank :]
        k_rope = jnp.broadcast_to(rope, (b, t, heads, rope.shape[-1]))
        k = jnp.concatenate([kv[..., : c.qk_nope_head_dim], k_rope.astype(dt)], axis=-1)
        v = kv[..., c.qk_nope_head_dim :]
        bad = ~jnp.all(jnp.isfinite(k), axis=(2, 3)) | ~jnp.all(jnp.isfinite(v), axis=(2, 3))
        k, v = (jnp.where(bad[:, :, None, None], 0, a) for a in (k, v))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        q_bad = ~jnp.all(jnp.isfinite(q), axis=(2, 3))
        q = jnp.where(q_bad[:, :, None, None], 0, q)
        scale = jnp.float32(self.softmax_scale)
        picks = None if selection is None or stage == "dense" else selection

        def block(start, rows):
            q, q_bad, index, segment, picked = rows
            mask = Visibility(index, segment, visibility.layout).mask()
            if picked is not None:
                mask &= picked_mask(picked, t)
            logits = jnp.einsum("bshd,bthd->bsht", q, k, preferred_element_type=jnp.float32)
            logits = round_to(round_to(logits, dt).astype(jnp.float32) * scale, dt)
            logits = jnp.where(mask[:, :, None, :], logits.astype(jnp.float32), -jnp.inf)
            peak = jnp.max(logits, axis=-1)
            peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
            p = jnp.exp(logits - peak[..., None])
            denom = jnp.sum(p, axis=-1)
            weights = round_to(p / jnp.where(denom > 0, denom, 1.0)[..., None], dt)
            o = jnp.einsum("bsht,bthd->bshd", weights, v, preferred_element_type=jnp.float32)
            poisoned = q_bad | jnp.any(mask & bad[:, None, :], axis=-1)
            o = round_to(jnp.where(poisoned[:, :, None, None], jnp.nan, o), dt)
            return o, jnp.where(poisoned[..., None], jnp.nan, peak + jnp.log(denom))

        tiles = backend_tiles() if ex.tiles is None else ex.tiles
        qb = ex.query_block or expanded_query_block(b, heads, t, tiles.attention_elements)
        rows = (q, q_bad, visibility.query_index, visibility.query_segment, picks)
        return map_row_blocks(block, rows, min(qb, max(s, 1)))

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V32Cache:
        """An empty decode cache of fixed-size buffers.

        **Arguments:**

        - ``batch_size``: rows decoded at once.
        - ``max_length``: tokens per row the cache can hold.
        - ``dtype``: dtype of the cached latents and indexer keys.

        **Returns:**

        A ``csa_eqx.V32Cache`` (``length`` 0 in every row).
        """
        c = self.config
        check_cache_size(batch_size, max_length)
        length, position, segment = empty_rows(batch_size)
        latent = c.kv_lora_rank + c.qk_rope_head_dim
        return V32Cache(
            length=length,
            position=position,
            segment=segment,
            latent=jnp.zeros((batch_size, max_length, latent), dtype),
            index_keys=jnp.zeros((batch_size, max_length, c.index_head_dim), dtype),
            token_segment=jnp.full((batch_size, max_length), -1, jnp.int32),
            max_length=max_length,
        )
