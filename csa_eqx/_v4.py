"""DeepSeek-V4 attention layer: sliding window, CSA and HCA (docs/concepts.md, "The DeepSeek-V4
attention block")."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from . import _checks as checks
from ._attention import AbstractIndexedAttention
from ._cache import V4Cache, check_cache_size, compressor_state, empty_rows
from ._compressor import Compressor
from ._config import V4AttentionConfig
from ._execution import Execution, checked_execution
from ._heads import split_specs
from ._layout import Visibility, segment_positions, token_rows
from ._loss import attention_target
from ._numerics import V4_FORMATS, DeepSeekFormats
from ._ops import init_linear, linear, rms_norm
from ._rope import apply_rope_interleaved, rope_inv_freq
from ._rows import whole_rows
from ._target import AttentionTarget

__all__ = ["V4Attention", "Indexer"]


class Indexer(eqx.Module):
    """V4 lightning indexer (docs/concepts.md, "The lightning indexer"): its own CSA
    compressor at ``index_head_dim`` plus query heads.

    **Arguments:**

    - ``config``: the layer's ``V4AttentionConfig`` (a CSA layer).
    - ``key``: PRNG key for the random initial weights; dtype: their dtype.
    """

    compressor: Compressor
    q_b_proj: Float[Array, "heads_x_dim q_lora"]
    weights_proj: Float[Array, "heads hidden"]
    config: V4AttentionConfig = eqx.field(static=True)

    def __init__(self, config: V4AttentionConfig, *, key: Array, dtype=jnp.float32):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        self.compressor = Compressor(
            c.hidden_size,
            c.index_head_dim,
            c.compress_rate,
            True,
            c.rope_dim,
            c.compress_rope_theta,
            c.rope_scaling,
            c.rms_norm_eps,
            key=k1,
            dtype=dtype,
        )
        self.q_b_proj = init_linear(k2, c.index_n_heads * c.index_head_dim, c.q_lora_rank, dtype)
        self.weights_proj = init_linear(k3, c.index_n_heads, c.hidden_size, dtype)
        self.config = config

    def queries(
        self, qr: Float[Array, "batch seq q_lora"], positions: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq heads dim"]:
        """**Arguments:** the query latent ``qr [B, S, q_lora_rank]`` and int32 ``positions``
        ``[B, S]``.

        **Returns:** roped per-head queries ``[B, S, H_I, d_I]``.
        """
        c = self.config
        b, s, _ = qr.shape
        q = linear(qr, self.q_b_proj).reshape(b, s, c.index_n_heads, c.index_head_dim)
        inv_freq = rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
        return apply_rope_interleaved(q, positions[..., None], inv_freq)

    def head_weights(self, x: Float[Array, "batch seq hidden"]) -> Float[Array, "batch seq heads"]:
        """**Arguments:** the layer input ``x [B, S, hidden]``.

        **Returns:** float32 per-head weights ``[B, S, H_I]``, ``H_I^-1/2`` included.
        """
        c = self.config
        return linear(x, self.weights_proj).astype(jnp.float32) * c.index_n_heads**-0.5


class V4Attention(AbstractIndexedAttention):
    """One DeepSeek-V4 attention layer; the type follows ``config.compress_rate``.

    Parameters use the HF module's names and torch's ``[out, in]`` layout, so
    ``csa_eqx.hf.load_v4_attention`` is a plain copy.

    **Arguments:** ``config`` (a ``V4AttentionConfig``), ``key``, ``dtype``, ``execution``, as in
    ``csa_eqx.AbstractIndexedAttention``.
    """

    q_a_proj: Float[Array, "q_lora hidden"]
    q_a_norm: Float[Array, " q_lora"]
    q_b_proj: Float[Array, "heads_x_dim q_lora"]
    kv_proj: Float[Array, "dim hidden"]
    kv_norm: Float[Array, " dim"]
    o_a_proj: Float[Array, "groups_x_rank group_in"]
    o_b_proj: Float[Array, "hidden groups_x_rank"]
    sinks: Float[Array, " heads"]
    compressor: Compressor | None
    indexer: Indexer | None
    config: V4AttentionConfig = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V4_FORMATS

    def __init__(self, config: V4AttentionConfig, *, key: Array, dtype=jnp.float32, execution=None):
        """A randomly initialised layer (``csa_eqx.hf`` loads weights): ``config``, PRNG
        ``key``, parameter ``dtype`` (norms and sinks stay float32) and ``execution`` (``None``:
        automatic), as ``AbstractIndexedAttention`` says."""
        c = config
        execution = checked_execution(execution, c, V4_FORMATS)
        ks = jax.random.split(key, 7)
        self.q_a_proj = init_linear(ks[0], c.q_lora_rank, c.hidden_size, dtype)
        self.q_a_norm = jnp.ones((c.q_lora_rank,), jnp.float32)
        self.q_b_proj = init_linear(ks[1], c.num_heads * c.head_dim, c.q_lora_rank, dtype)
        self.kv_proj = init_linear(ks[2], c.head_dim, c.hidden_size, dtype)
        self.kv_norm = jnp.ones((c.head_dim,), jnp.float32)
        group_in = c.num_heads * c.head_dim // c.o_groups
        self.o_a_proj = init_linear(ks[3], c.o_groups * c.o_lora_rank, group_in, dtype)
        self.o_b_proj = init_linear(ks[4], c.hidden_size, c.o_groups * c.o_lora_rank, dtype)
        self.sinks = jnp.zeros((c.num_heads,), jnp.float32)
        self.compressor = None
        self.indexer = None
        if c.layer_type != "sliding":
            self.compressor = Compressor(
                c.hidden_size,
                c.head_dim,
                c.compress_rate,
                c.layer_type == "csa",
                c.rope_dim,
                c.compress_rope_theta,
                c.rope_scaling,
                c.rms_norm_eps,
                key=ks[5],
                dtype=dtype,
            )
        if c.has_indexer:
            self.indexer = Indexer(c, key=ks[6], dtype=dtype)
        self.config = config
        self.execution = execution

    @property
    def inv_freq(self):
        """**Returns:** the RoPE inverse frequencies ``[rope_dim // 2]`` (float32 numpy): plain
        ``rope_theta`` for sliding layers, YaRN-scaled ``compress_rope_theta`` otherwise."""
        c = self.config
        if c.layer_type == "sliding":
            return rope_inv_freq(c.rope_dim, c.rope_theta)
        return rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.rope_scaling)

    def project_qkv(
        self, x: Float[Array, "batch seq hidden"], positions: Int[Array, "batch seq"]
    ) -> tuple[
        Float[Array, "batch seq q_lora"],
        Float[Array, "batch seq heads dim"],
        Float[Array, "batch seq dim"],
    ]:
        """**Arguments:** ``x [B, S, hidden]`` and int32 RoPE ``positions [B, S]``.

        **Returns:** the query latent ``qr [B, S, q_lora_rank]``, roped per-head queries
        ``[B, S, H, head_dim]`` and the roped shared key/value ``[B, S, head_dim]`` (as the
        numerics round it).
        """
        c = self.config
        b, s, _ = x.shape
        qr = rms_norm(linear(x, self.q_a_proj), self.q_a_norm, c.rms_norm_eps)
        # heads from the weights, not the config: under head parallelism a device holds some
        q = linear(qr, self.q_b_proj).reshape(b, s, -1, c.head_dim)
        q = apply_rope_interleaved(
            rms_norm(q, None, c.rms_norm_eps), positions[..., None], self.inv_freq
        )
        kv = rms_norm(linear(x, self.kv_proj), self.kv_norm, c.rms_norm_eps)
        kv = apply_rope_interleaved(kv, positions, self.inv_freq)
        return qr, q, self.execution.numerics.kv(kv, c.rope_dim, self.formats)

    def project_out(
        self, o: Float[Array, "batch seq heads dim"], positions: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq hidden"]:
        """De-rotate the attention output (RoPE at ``-t``), then the grouped output projection
        (docs/concepts.md, "The DeepSeek-V4 attention block").

        **Arguments:** ``o [B, S, H, head_dim]`` and the queries' ``positions [B, S]``.

        **Returns:** ``[B, S, hidden]``.
        """
        c = self.config
        b, s = o.shape[:2]
        o = apply_rope_interleaved(o, -positions[..., None], self.inv_freq)
        groups = self.o_a_proj.shape[0] // c.o_lora_rank  # this device's, under head parallelism
        o = o.reshape(b, s, groups, -1, c.head_dim).reshape(b, s, groups, -1)
        w_a = self.o_a_proj.reshape(groups, c.o_lora_rank, -1).astype(o.dtype)
        return linear(jnp.einsum("bsgi,goi->bsgo", o, w_a).reshape(b, s, -1), self.o_b_proj)

    @property
    def entry_rate(self) -> int:
        """**Returns:** ``compress_rate`` (tokens per compressed entry; 0 for a sliding layer)."""
        return self.config.compress_rate

    @property
    def context_halo(self) -> int:
        """Rows before a chunk of the sequence that its forward needs: the sliding window's
        ``window - 1`` and the compressor's own window (``m - 1``, HCA) or its own and the
        preceding one (``2m - 1``, CSA)."""
        c = self.config
        m = c.compress_rate
        windows = 0 if not m else (2 * m - 1 if c.layer_type == "csa" else m - 1)
        return max(c.sliding_window - 1, windows)

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism over ``axis``: the query projection's rows, the sinks, the grouped
        ``o_a_proj``'s rows and ``o_b_proj``'s input columns are split (heads and groups are
        contiguous blocks, so each device's heads feed its groups); every other array is
        replicated. See ``AbstractIndexedAttention.head_specs``."""
        specs = split_specs(
            {
                "q_b_proj": P(axis, None),
                "sinks": P(axis),
                "o_a_proj": P(axis, None),
                "o_b_proj": P(None, axis),
            }
        )
        return specs, {"num_heads": self.config.num_heads, "o_groups": self.config.o_groups}

    def forward_rows(self, x, source, stage, want_loss=False):
        """The pipeline over ``source`` (see ``AbstractIndexedAttention.forward_rows``): the
        sliding window plus this layer's compressed entries (docs/concepts.md, "The
        DeepSeek-V4 attention block"), for the forward and ``extend`` alike."""
        c, ex = self.config, self.execution
        nx = ex.numerics
        qr, q, kv = self.project_qkv(x, source.positions)
        reads, source = source.window_reads(ex.window, kv, c.sliding_window)
        selection, problem, entries = None, None, None
        if self.compressor is not None:
            dtype = nx.entry_dtype(x)
            entries, layout, source = source.entries(
                "compressor", self.compressor, nx.compressor_input(x), dtype, self._round_kv
            )
            entries = entries.astype(kv.dtype)
            visibility = Visibility(source.query_index, source.segment, layout)
            if self.indexer is not None:
                # the selection ignores gradients and the loss must train the indexer's
                # compressor only, never x
                index_input = nx.compressor_input(jax.lax.stop_gradient(x))
                keys, _, source = source.entries(
                    "indexer", self.indexer.compressor, index_input, dtype, self._round_index
                )
                problem = self.indexer_problem(x, qr, source.positions, keys, visibility)
                selection = ex.select(problem, c.index_topk)
            reads = reads.join(ex.entry_reads(entries, visibility, selection, stage))

        o = ex.attend(q, reads, self.sinks, c.head_dim**-0.5, return_lse=want_loss)
        target = None
        if want_loss:
            o, lse = o
            target = AttentionTarget(q, entries, lse, c.head_dim**-0.5)
        return self.project_out(o, source.positions), selection, (problem, target), source

    def _round_kv(self, entries: Array) -> Array:
        """The compressed entries as the numerics round the KV."""
        return self.execution.numerics.kv(entries, self.config.rope_dim, self.formats)

    def _round_index(self, keys: Array) -> Array:
        """The indexer's keys as the numerics round them."""
        return self.execution.numerics.indexer(keys, self.formats)

    def entry_attention(
        self,
        x: Float[Array, "batch seq hidden"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """Where *dense* attention looks, next to what the indexer picks (CSA layers).

        **Arguments:**

        - ``x``: hidden states ``[B, S, hidden]``.
        - ``segment_ids``: packed-document ids ``[B, S]`` or ``None``.

        **Returns:**

        The attention mass ``[B, S, slots]`` (float32) on each compressed-entry slot when
        the layer attends to its window and *all* visible entries (summed over heads,
        L1-normalised over entries: the dense-stage KL target), and the indexer's
        selection int32 ``[B, S, index_topk]`` (``-1`` = none), as the forward makes it.
        """
        c, ex = self.config, self.execution
        if self.indexer is None:
            raise ValueError(f"entry_attention needs a CSA layer (this one is {c.layer_type})")
        x, _, segment_ids = checks.layer_inputs(c.hidden_size, x, None, segment_ids)
        seg, query_index = token_rows(x, segment_ids)
        rows = whole_rows(segment_positions(seg), seg, query_index, c.compress_rate)
        # the window and every visible entry: the dense stage's reads
        _, selection, (problem, target), _ = self.forward_rows(x, rows, "dense", True)
        visible = problem.visibility.mask()
        return attention_target(target, visible, head_chunk=ex.qk_head_chunk_size), selection

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
        """An empty decode cache of fixed-size buffers.

        **Arguments:**

        - ``batch_size``: rows decoded at once.
        - ``max_length``: tokens per row the cache can hold (window ring, and
            ``max_length // compress_rate`` entry slots).
        - ``dtype``: dtype of the cached keys and compressor states.

        **Returns:**

        A ``csa_eqx.V4Cache`` (``length`` 0 in every row).
        """
        c = self.config
        check_cache_size(batch_size, max_length)
        slots = max_length // c.compress_rate if c.compress_rate else 0
        length, position, segment = empty_rows(batch_size)
        empty = jnp.full((batch_size, slots), -1, jnp.int32)  # copied below: distinct buffers
        ring = c.sliding_window - 1
        return V4Cache(
            length=length,
            position=position,
            segment=segment,
            window_kv=jnp.zeros((batch_size, ring, c.head_dim), dtype),
            window_segment=jnp.full((batch_size, ring), -1, jnp.int32),
            entry_end=empty,
            entry_segment=jnp.copy(empty),
            entry_count=jnp.zeros((batch_size,), jnp.int32),
            compressor=compressor_state(self.compressor, batch_size, slots, dtype),
            indexer=None
            if self.indexer is None
            else compressor_state(self.indexer.compressor, batch_size, slots, dtype),
            max_length=max_length,
        )
