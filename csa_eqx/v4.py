"""DeepSeek-V4 attention layer: sliding window, CSA and HCA (SPEC §1)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, ArrayLike, Float, Int, jaxtyped

from . import checks
from .cache import V4Cache, init_v4_cache
from .compressor import (
    Compressor,
    EntryLayout,
    entry_layout,
    segment_positions,
    token_rows,
)
from .config import V4AttentionConfig
from .decode import v4_extend
from .loss import attention_target, projected_indexer_kl_loss
from .ops import init_linear, linear, rms_norm
from .remat import tag_selection
from .rope import apply_rope_interleaved, rope_inv_freq
from .selection import entry_visibility
from .sharding import constrain_heads, sharded_select_entries, tensor_axis_auto
from .sparse import DenseKeys, prefers_masked_picks, sparse_attention
from .streaming import select_projected_entries

__all__ = ["V4Attention", "Indexer"]


class Indexer(eqx.Module):
    """V4 lightning indexer: its own CSA compressor at ``index_head_dim`` plus query heads."""

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

    def queries(self, qr: Array, positions: Array) -> Array:
        """Roped per-head queries ``[B,S,H_I,d_I]`` (from the query latent)."""
        c = self.config
        b, s, _ = qr.shape
        q = linear(qr, self.q_b_proj).reshape(b, s, c.index_n_heads, c.index_head_dim)
        inv_freq = rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
        q = apply_rope_interleaved(q, positions[..., None], inv_freq)
        return constrain_heads(q, c.tensor_axis) if c.shard_indexer_acts else q

    def head_weights(self, x: Array) -> Array:
        """Per-head weights ``[B,S,H_I]`` including the ``H_I^-1/2`` factor (float32)."""
        c = self.config
        w = linear(x, self.weights_proj).astype(jnp.float32) * c.index_n_heads**-0.5
        return constrain_heads(w, c.tensor_axis) if c.shard_indexer_acts else w

    def project(self, x: Array, qr: Array, positions: Array) -> tuple[Array, Array]:
        """Per-token indexer inputs: roped queries and head weights (row by row, so the
        streaming selection can call it one query block at a time)."""
        return self.queries(qr, positions), self.head_weights(x)

    def select(
        self,
        x: Array,
        qr: Array,
        positions: Array,
        query_index: Array,
        segment: Array,
        layout: EntryLayout,
    ) -> Array:
        """Top-k entry slots ``[B,S,k]`` per query (``-1`` = none), tagged for remat.

        ``indexer_sharded_topk`` / ``shard_indexer_acts`` use the mesh set with
        ``jax.set_mesh`` (see ``csa_eqx.sharding``).
        """
        c = self.config
        keys = self.compressor(x, positions, layout)

        def stage(x, qr, positions, keys, query_index, segment, layout):
            tiles = dict(
                head_chunk=c.qk_head_chunk_size,
                key_block=c.indexer_key_block,
                query_block=c.query_block,
            )
            if c.indexer_sharded_topk:
                args = (
                    *self.project(x, qr, positions),
                    keys,
                    query_index,
                    segment,
                    layout,
                    c.index_topk,
                )
                return sharded_select_entries(
                    *args, **tiles, tensor_axis=c.tensor_axis, data_axis=c.data_axis
                )
            # project the indexer queries block by block inside the streaming loop
            return select_projected_entries(
                lambda *rows: self.project(*rows),  # hashable (a bound Module method is not)
                (x, qr, positions),
                keys,
                query_index,
                segment,
                layout,
                c.index_topk,
                **tiles,
            )

        if c.shard_indexer_acts:
            stage = tensor_axis_auto(stage, c.tensor_axis, query_index)
        selection = stage(x, qr, positions, keys, query_index, segment, layout)
        return tag_selection(selection, c.indexer_save_selection)


class V4Attention(eqx.Module):
    """One DeepSeek-V4 attention layer; the type follows ``config.compress_rate``.

    Parameters use the HF module's names and torch's ``[out, in]`` layout, so
    ``csa_eqx.hf.load_v4_attention`` is a plain copy.
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

    def __init__(self, config: V4AttentionConfig, *, key: Array, dtype=jnp.float32):
        c = config
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

    @property
    def inv_freq(self):
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
        """Query latent ``qr``, roped per-head queries and the roped shared key/value."""
        c = self.config
        b, s, _ = x.shape
        qr = rms_norm(linear(x, self.q_a_proj), self.q_a_norm, c.rms_norm_eps)
        q = linear(qr, self.q_b_proj).reshape(b, s, c.num_heads, c.head_dim)
        q = apply_rope_interleaved(
            rms_norm(q, None, c.rms_norm_eps), positions[..., None], self.inv_freq
        )
        kv = rms_norm(linear(x, self.kv_proj), self.kv_norm, c.rms_norm_eps)
        return qr, q, apply_rope_interleaved(kv, positions, self.inv_freq)

    def project_out(
        self, o: Float[Array, "batch seq heads dim"], positions: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq hidden"]:
        """De-rotate the attention output (RoPE at ``-t``), then the grouped output projection."""
        c = self.config
        b, s = o.shape[:2]
        o = apply_rope_interleaved(o, -positions[..., None], self.inv_freq)
        o = o.reshape(b, s, c.o_groups, -1, c.head_dim).reshape(b, s, c.o_groups, -1)
        w_a = self.o_a_proj.reshape(c.o_groups, c.o_lora_rank, -1).astype(o.dtype)
        return linear(jnp.einsum("bsgi,goi->bsgo", o, w_a).reshape(b, s, -1), self.o_b_proj)

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        positions: Int[ArrayLike, "batch seq"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
    ) -> Float[Array, "batch seq hidden"] | tuple[Float[Array, "batch seq hidden"], dict]:
        """Attend over the sliding window plus this layer's compressed entries.

        Arguments:
            x: hidden states ``[B, S, hidden]``.
            positions: RoPE positions ``[B, S]``; default: the index inside each segment.
            segment_ids: packed-document ids ``[B, S]`` (contiguous runs); tokens only see
                their own segment, and compression windows restart at each segment.
            return_aux: also return ``{"selection": int32 [B,S,k] or None,
                "indexer_loss": scalar or None}``.
        """
        c = self.config
        x, positions, segment_ids = checks.layer_inputs(c.hidden_size, x, positions, segment_ids)
        if x.size == 0:
            k = c.index_topk if c.has_indexer else None
            loss = c.has_indexer and c.indexer_loss != "off"
            return checks.empty_outputs(x, k, loss, return_aux)
        seg, query_index = token_rows(x, segment_ids)
        if positions is None:
            positions = segment_positions(seg)
        positions = jnp.asarray(positions, jnp.int32)

        qr, q, kv = self.project_qkv(x, positions)

        indices = jnp.zeros((*query_index.shape, 0), jnp.int32)  # gathered keys: none yet
        keys, dense, selection = kv, None, None
        if self.compressor is not None:
            layout = entry_layout(seg, c.compress_rate)
            entries = self.compressor(x, positions, layout).astype(kv.dtype)
            if self.indexer is not None:
                selection = self.indexer.select(x, qr, positions, query_index, seg, layout)
            if self.indexer is None or c.indexer_loss == "dense":
                # HCA, and CSA's dense warm-up: every visible entry, attended by one matmul
                dense = DenseKeys(entries, layout, query_index, seg)
            elif prefers_masked_picks(entries.shape[1], c.index_topk):
                # few entries per pick: a matmul masked to the picks beats gathering them
                dense = DenseKeys(entries, layout, query_index, seg, picks=selection)
            else:  # picks gathered from the entries, stored after the S token rows
                indices = jnp.where(selection >= 0, selection + x.shape[1], -1)
                keys = jnp.concatenate([kv, entries], axis=1)

        want_loss = return_aux and self.indexer is not None and c.indexer_loss != "off"
        o = sparse_attention(
            q,
            keys,
            indices,
            self.sinks,
            c.head_dim**-0.5,
            return_lse=want_loss,
            query_block=c.query_block,
            dense=dense,
            window=c.sliding_window,
            segment=seg,
        )
        if want_loss:
            o, lse = o
        y = self.project_out(o, positions)
        if return_aux:
            loss = None
            if want_loss:
                loss = self._indexer_loss(
                    x, qr, positions, query_index, seg, layout, q, entries, lse, selection
                )
            return y, {"selection": selection, "indexer_loss": loss}
        return y

    def _indexer_loss(
        self, x, qr, positions, query_index, seg, layout, q, entries, lse, selection
    ) -> Array:
        """The indexer's KL distillation loss (SPEC §4). The indexer scores detached hidden
        states and the target is detached, so its gradient reaches indexer parameters only.
        Candidates: every visible entry (dense warm-up) or the selection (sparse stage); long
        sequences stream (``projected_indexer_kl_loss``), never forming ``[B, S, T]``."""
        c, ix = self.config, self.indexer
        x, qr = jax.lax.stop_gradient((x, qr))
        keys = ix.compressor(x, positions, layout)
        return projected_indexer_kl_loss(
            lambda *rows: ix.project(*rows),  # hashable (a bound Module method is not)
            (x, qr, positions),
            keys,
            q,
            entries,
            lse,
            query_index,
            seg,
            layout,
            c.head_dim**-0.5,
            None if c.indexer_loss == "dense" else selection,
            head_chunk=c.qk_head_chunk_size,
            key_block=c.indexer_key_block,
            query_block=c.query_block,
        )

    def entry_attention(
        self,
        x: Float[Array, "batch seq hidden"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """Where *dense* attention looks, next to what the indexer picks (CSA layers).

        Returns the attention mass on each compressed-entry slot when the layer attends to its
        window and *all* visible entries (summed over heads, L1-normalised over entries: the
        dense-stage KL target), and the indexer's selection ``[B, S, k]``.
        """
        c = self.config
        if self.indexer is None:
            raise ValueError(f"entry_attention needs a CSA layer (this one is {c.layer_type})")
        x, _, segment_ids = checks.layer_inputs(c.hidden_size, x, None, segment_ids)
        seg, query_index = token_rows(x, segment_ids)
        positions = segment_positions(seg)
        qr, q, kv = self.project_qkv(x, positions)
        layout = entry_layout(seg, c.compress_rate)
        entries = self.compressor(x, positions, layout).astype(kv.dtype)
        visible = entry_visibility(query_index, seg, layout)
        _, lse = sparse_attention(
            q,
            kv,
            jnp.zeros((*query_index.shape, 0), jnp.int32),
            self.sinks,
            c.head_dim**-0.5,
            return_lse=True,
            query_block=c.query_block,
            dense=DenseKeys(entries, layout, query_index, seg),
            window=c.sliding_window,
            segment=seg,
        )
        mass = attention_target(
            q, entries, lse, visible, c.head_dim**-0.5, head_chunk=c.qk_head_chunk_size
        )
        selection = self.indexer.select(x, qr, positions, query_index, seg, layout)
        return mass, selection

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
        """An empty decode cache of fixed-size buffers for up to ``max_length`` tokens per row
        (see ``csa_eqx.cache.V4Cache``)."""
        return init_v4_cache(self, batch_size, max_length, dtype)

    def extend(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        cache: V4Cache,
        lengths: Int[ArrayLike, " batch"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
    ):
        """Run the chunk ``x`` after the tokens in ``cache``: ``(y, cache)`` equal to the full
        forward over the whole stream (prefill, chunked prefill or a decode step; see
        ``csa_eqx.decode`` for ``lengths`` / ``segment_ids`` and ``return_aux``)."""
        return v4_extend(self, x, cache, lengths, segment_ids, return_aux)
