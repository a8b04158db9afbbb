"""DeepSeek-V4.1 attention (docs/v41.md): V4's sliding window with sinks and sparse attention
over compressed entries, with the compressed KV, the index keys and the selections shared
across the layers of a stack.

One layer class, ``V41Attention``, whose role (sliding, full, reindex, reuse) the stack config
resolves. The state a layer shares passes explicitly: a layer takes the published
``V41Shared`` as an argument and returns what it publishes; ``run_v41_stack`` threads it
through a list of layers. Under head or context parallelism the state crosses each layer's
placement as its carried state (``csa_eqx._placement.Carried``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Int, jaxtyped

from . import _checks as checks
from ._attention import AbstractIndexedAttention
from ._cache import CompressorState, V4Cache, check_cache_size, empty_rows
from ._compressor import pool_windows
from ._config import YaRNScaling
from ._decode import ChunkSource, chunk_rows
from ._execution import Execution, checked_execution
from ._heads import split_specs
from ._layout import EntryLayout, Visibility
from ._numerics import V41_FORMATS, DeepSeekFormats
from ._ops import init_linear, linear, rms_norm
from ._placement import Carried
from ._rope import apply_rope_interleaved, rope_inv_freq
from ._rows import Rows
from ._target import AttentionTarget
from ._v41_config import V41AttentionConfig, V41WiringError

__all__ = [
    "V41Attention",
    "V41Compressor",
    "V41Indexer",
    "V41Shared",
    "run_v41_stack",
    "extend_v41_stack",
]


class V41Shared(NamedTuple):
    """What the layers of a V4.1 stack publish to the later ones (docs/v41.md, "The sharing
    schedule"). A field is ``None`` until a layer publishes it.

    **Arguments:**

    - ``entries``: the latest KV source's compressed entries (roped at each group's first
        position), ``[B, T, head_dim]``.
    - ``keys``: its index keys ``[B, T, index_head_dim]`` (roped likewise).
    - ``layout``: their slots' ``EntryLayout`` (``[B, T]``).
    - ``selection``: the latest index source's top-k, int32 ``[B, S, index_topk]`` entry slots
        in increasing order, ``-1`` = none.
    - ``candidates``: the candidate source's pre-filter, int32 ``[B, S, Nb]``: the ids of the
        kept blocks of ``bc`` entry slots, in increasing order, ``-1`` past the last
        (``csa_eqx.candidate_blocks``; docs/v41.md, "Memory").
    - ``stale_keys``: ``None``, or the keys the next index source scores instead of
        ``keys`` (only ``extend_v41_stack(..., stale_index_keys=True)`` sets it, to emulate
        DeepSeek's stale-key defect).
    """

    entries: Float[Array, "batch slots dim"] | None = None
    keys: Float[Array, "batch slots index_dim"] | None = None
    layout: EntryLayout | None = None
    selection: Int[Array, "batch seq k"] | None = None
    candidates: Int[Array, "batch seq blocks"] | None = None
    stale_keys: Float[Array, "batch slots index_dim"] | None = None


class V41Compressor(eqx.Module):
    """A V4.1 KV source's compressor (docs/v41.md, "Compressor"): ratio 1 one normed latent per
    token; ratio ``m > 1`` disjoint groups of ``m`` tokens pooled with a float32 per-channel
    softmax gate (no position bias, no overlap), then normed. Each entry is its latent roped at
    the group's first position; the index keys ``RoPE(k_norm(latent · key_projᵀ))`` come from
    the same pre-RoPE latent, detached: only the indexer loss differentiates the keys, and it
    trains the indexer's weights (``key_proj``, ``key_norm``), never the compressor or the
    input (as V4's indexer compresses a detached input).

    ``kv_proj``, ``gate_proj`` and ``kv_norm`` are DeepSeek's ``compressor.wkv``, ``.wgate``
    (absent at ratio 1) and ``.norm``; ``key_proj`` and ``key_norm`` its ``indexer.wk`` and
    ``indexer.k_norm``.

    **Arguments:** the layer's ``V41AttentionConfig``, its ``ratio``, ``key`` and ``dtype``.
    """

    kv_proj: Float[Array, "dim hidden"]
    gate_proj: Float[Array, "dim hidden"] | None
    kv_norm: Float[Array, " dim"]
    key_proj: Float[Array, "index_dim dim"]
    key_norm: Float[Array, " index_dim"]
    compress_rate: int = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: YaRNScaling | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    overlap: ClassVar[bool] = False  # what the decode seam's pooling asks (HCA-style groups)

    def __init__(self, config: V41AttentionConfig, ratio: int, *, key: Array, dtype=jnp.float32):
        c = config
        k1, k2, k3 = jax.random.split(key, 3)
        self.kv_proj = init_linear(k1, c.head_dim, c.hidden_size, dtype)
        self.gate_proj = init_linear(k2, c.head_dim, c.hidden_size, dtype) if ratio > 1 else None
        self.kv_norm = jnp.ones((c.head_dim,), jnp.float32)
        self.key_proj = init_linear(k3, c.index_head_dim, c.head_dim, dtype)
        self.key_norm = jnp.ones((c.index_head_dim,), jnp.float32)
        self.compress_rate = ratio
        self.rope_dim = c.rope_dim
        self.rope_theta = c.compress_rope_theta
        self.rope_scaling = c.rope_scaling
        self.eps = c.rms_norm_eps

    @property
    def position_bias(self) -> Array:
        """**Returns:** zeros ``[m, dim]``: V4.1 has no learned position bias."""
        return jnp.zeros((self.compress_rate, self.kv_proj.shape[0]), jnp.float32)

    def project(self, x: Float[Array, "batch seq hidden"]) -> tuple[Array, Array]:
        """**Arguments:** ``x [B, S, hidden]``.

        **Returns:** per-token ``(kv, gate)`` ``[B, S, dim]`` before pooling (float32 for
        ``m > 1``, as DeepSeek pools; the gate is zeros at ratio 1)."""
        if self.gate_proj is None:
            kv = linear(x, self.kv_proj)
            return kv, jnp.zeros_like(kv)
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return linear(xf, self.kv_proj), linear(xf, self.gate_proj)

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        positions: Int[Array, "batch seq"],
        layout: EntryLayout,
        dtype=None,
    ) -> Float[Array, "batch slots both"]:
        """**Arguments:** as ``csa_eqx.Compressor``'s (``dtype``: the pooled groups' cast
        before the norm; ``None``: ``x``'s).

        **Returns:** ``[B, T, dim + index_dim]``: each slot's entry, then its index key (split
        them at ``dim``)."""
        kv, gate = self.project(x)
        if self.compress_rate == 1:  # one token per entry: no pooling
            rows = jnp.clip(layout.end, 0, x.shape[1] - 1)
            pooled = jnp.take_along_axis(kv, rows[..., None], axis=1)
        else:
            pooled = pool_windows(kv, gate, self.position_bias, layout, False)
        return self.finish(pooled, positions, layout, x.dtype if dtype is None else dtype)

    def finish(
        self, pooled: Array, positions: Int[Array, "batch seq"], layout: EntryLayout, dtype=None
    ):
        """The latent (RMSNorm of the pooled groups), then the entries and index keys roped at
        each group's first position (``csa_eqx.Compressor.finish``'s seam, which the decode
        cache's pooling calls).

        **Arguments:** ``pooled [B, T, dim]``, the tokens' ``positions [B, S]``, the layout and
        the ``dtype`` to cast the groups to first (``None``: as pooled).

        **Returns:** ``[B, T, dim + index_dim]`` (entries, then keys)."""
        pooled = pooled if dtype is None else pooled.astype(dtype)
        latent = rms_norm(pooled, self.kv_norm, self.eps)
        first = jnp.clip(layout.end - self.compress_rate + 1, 0, positions.shape[1] - 1)
        entry_pos = jnp.take_along_axis(positions, first, axis=1)
        inv_freq = rope_inv_freq(self.rope_dim, self.rope_theta, self.rope_scaling)
        keys = linear(jax.lax.stop_gradient(latent), self.key_proj)
        keys = rms_norm(keys, self.key_norm, self.eps)
        entries = apply_rope_interleaved(latent, entry_pos, inv_freq)
        keys = apply_rope_interleaved(keys, entry_pos, inv_freq)
        return jnp.concatenate([entries, keys.astype(entries.dtype)], axis=-1)


class V41Indexer(eqx.Module):
    """A V4.1 index source's indexer (docs/v41.md, "Indexer"): query heads from the attention's
    q-LoRA latent and head weights from the layer input, scoring a KV source's index keys
    (no Hadamard rotation). ``q_b_proj`` / ``weights_proj`` are DeepSeek's ``indexer.wq_b`` /
    ``indexer.weights_proj``.

    **Arguments:** the ``V41AttentionConfig``, ``key`` and ``dtype``.
    """

    q_b_proj: Float[Array, "heads_x_dim q_lora"]
    weights_proj: Float[Array, "heads hidden"]
    config: V41AttentionConfig = eqx.field(static=True)

    def __init__(self, config: V41AttentionConfig, *, key: Array, dtype=jnp.float32):
        c = config
        k1, k2 = jax.random.split(key)
        self.q_b_proj = init_linear(k1, c.index_n_heads * c.index_head_dim, c.q_lora_rank, dtype)
        self.weights_proj = init_linear(k2, c.index_n_heads, c.hidden_size, dtype)
        self.config = config

    def queries(
        self, qr: Float[Array, "batch seq q_lora"], positions: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq heads dim"]:
        """**Arguments:** the query latent ``qr [B, S, q_lora_rank]`` and ``positions [B, S]``.

        **Returns:** roped (compress table) per-head queries ``[B, S, H_I, d_I]``."""
        c = self.config
        b, s, _ = qr.shape
        q = linear(qr, self.q_b_proj).reshape(b, s, c.index_n_heads, c.index_head_dim)
        inv_freq = rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.rope_scaling)
        return apply_rope_interleaved(q, positions[..., None], inv_freq)

    def head_weights(self, x: Float[Array, "batch seq hidden"]) -> Float[Array, "batch seq heads"]:
        """**Arguments:** the layer input ``x [B, S, hidden]``.

        **Returns:** float32 per-head weights ``[B, S, H_I]``, ``H_I^-1/2`` included."""
        return linear(x, self.weights_proj).astype(jnp.float32) * self.config.index_n_heads**-0.5


class V41Attention(AbstractIndexedAttention):
    """Layer ``layer`` of a DeepSeek-V4.1 attention stack; its role (``config.role(layer)``)
    decides what it owns (docs/v41.md):

    - ``"sliding"``: the window only (RoPE ``rope_theta``);
    - ``"full"`` (a KV source): a ``V41Compressor`` and a ``V41Indexer``; publishes entries,
        index keys and its selection (and the candidates at the candidate source);
    - ``"reindex"``: a ``V41Indexer`` over the latest KV source's keys; publishes a selection;
    - ``"reuse"``: nothing of its own beyond the window: attends the published entries through
        the published selection (no compressor, indexer or top-k).

    Every layer has its own queries (no per-head norm), window KV, sinks and grouped output
    projection; compressed layers rope with the compress table. Parameter names follow
    ``V4Attention`` (DeepSeek's: ``wq_a`` = ``q_a_proj``, ``q_norm`` = ``q_a_norm``, ``wq_b``,
    ``wkv`` = ``kv_proj``, ``kv_norm``, ``wo_a`` = ``o_a_proj``, ``wo_b``, ``attn_sink`` =
    ``sinks``).

    **Arguments:** the stack's ``config``, the ``layer`` index, ``key``, ``dtype`` and
    ``execution`` (as ``AbstractIndexedAttention``; numerics ``ExactNumerics`` or
    ``DeepSeekV41Inference``).
    """

    q_a_proj: Float[Array, "q_lora hidden"]
    q_a_norm: Float[Array, " q_lora"]
    q_b_proj: Float[Array, "heads_x_dim q_lora"]
    kv_proj: Float[Array, "dim hidden"]
    kv_norm: Float[Array, " dim"]
    o_a_proj: Float[Array, "groups_x_rank group_in"]
    o_b_proj: Float[Array, "hidden groups_x_rank"]
    sinks: Float[Array, " heads"]
    compressor: V41Compressor | None
    indexer: V41Indexer | None
    config: V41AttentionConfig = eqx.field(static=True)
    layer: int = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V41_FORMATS

    def __init__(
        self,
        config: V41AttentionConfig,
        layer: int,
        *,
        key: Array,
        dtype=jnp.float32,
        execution=None,
    ):
        c = config
        if not isinstance(c, V41AttentionConfig):
            raise TypeError(f"config must be a V41AttentionConfig (got {type(c).__name__})")
        if not (isinstance(layer, int) and 0 <= layer < c.num_layers):
            raise ValueError(f"layer must be in [0, {c.num_layers}) (got {layer!r})")
        # the numerics check the formats (DeepSeekInference refuses V4.1's, as V4.1's V4's)
        execution = checked_execution(execution, c, V41_FORMATS)
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
        role = c.role(layer)
        ratio = c.compress_ratios[layer]
        full = role == "full"
        self.compressor = V41Compressor(c, ratio, key=ks[5], dtype=dtype) if full else None
        has_indexer = role in ("full", "reindex")
        self.indexer = V41Indexer(c, key=ks[6], dtype=dtype) if has_indexer else None
        self.config = config
        self.layer = layer
        self.execution = execution

    @property
    def role(self) -> str:
        """**Returns:** the layer's role, ``config.role(layer)``."""
        return self.config.role(self.layer)

    @property
    def inv_freq(self):
        """**Returns:** the RoPE inverse frequencies: plain ``rope_theta`` for a sliding layer,
        the (YaRN-scaled) ``compress_rope_theta`` for every compressed role."""
        c = self.config
        if self.role == "sliding":
            return rope_inv_freq(c.rope_dim, c.rope_theta)
        return rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.rope_scaling)

    @property
    def entry_rate(self) -> int:
        """**Returns:** the layer's compress ratio (0: sliding)."""
        return self.config.compress_ratios[self.layer]

    @property
    def context_halo(self) -> int:
        """**Returns:** ``window - 1`` rows (and a group's ``m - 1``)."""
        return max(self.config.sliding_window - 1, max(self.entry_rate - 1, 0))

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism: as ``V4Attention.head_specs`` (queries, sinks and the grouped
        output projection split over ``axis``)."""
        specs = split_specs(
            {
                "q_b_proj": P(axis, None),
                "sinks": P(axis),
                "o_a_proj": P(axis, None),
                "o_b_proj": P(None, axis),
            }
        )
        return specs, {"num_heads": self.config.num_heads, "o_groups": self.config.o_groups}

    def project_qkv(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
        """The query latent ``qr``, the roped queries ``[B, S, H, head_dim]`` (no per-head norm)
        and the roped window KV ``[B, S, head_dim]`` (as the numerics round it)."""
        c = self.config
        b, s, _ = x.shape
        qr = rms_norm(linear(x, self.q_a_proj), self.q_a_norm, c.rms_norm_eps)
        q = linear(qr, self.q_b_proj).reshape(b, s, -1, c.head_dim)
        q = apply_rope_interleaved(q, positions[..., None], self.inv_freq)
        kv = rms_norm(linear(x, self.kv_proj), self.kv_norm, c.rms_norm_eps)
        kv = apply_rope_interleaved(kv, positions, self.inv_freq)
        return qr, q, self.execution.numerics.kv(kv, c.rope_dim, self.formats)

    def project_out(self, o: Array, positions: Array) -> Array:
        """De-rotation at ``-t`` and the grouped output projection, as ``V4Attention``'s."""
        c = self.config
        b, s = o.shape[:2]
        o = apply_rope_interleaved(o, -positions[..., None], self.inv_freq)
        groups = self.o_a_proj.shape[0] // c.o_lora_rank
        o = o.reshape(b, s, groups, -1, c.head_dim).reshape(b, s, groups, -1)
        w_a = self.o_a_proj.reshape(groups, c.o_lora_rank, -1).astype(o.dtype)
        return linear(jnp.einsum("bsgi,goi->bsgo", o, w_a).reshape(b, s, -1), self.o_b_proj)

    def forward_rows(self, x, source, stage, want_loss=False, shared=None):
        """The pipeline over ``source`` (``AbstractIndexedAttention.forward_rows``), plus the
        published state: ``shared`` (``V41Shared``) in, and what this layer publishes out as a
        fifth result. ``(y, selection, (problem, target), source, shared)``: the selection the
        layer reads through (a reuse layer's is inherited; ``None`` when sliding), an index
        source's problem (within the candidates at a consumer whose filter bites) and, with
        ``want_loss``, the ``AttentionTarget`` over the published entries."""
        c, ex = self.config, self.execution
        shared = V41Shared() if shared is None else shared
        qr, q, kv = self.project_qkv(x, source.positions)
        reads, source = source.window_reads(ex.window, kv, c.sliding_window)
        selection, problem = None, None
        if self.role != "sliding":
            if self.compressor is not None:
                dtype = ex.numerics.entry_dtype(x)  # the groups' cast before their norm
                both, layout, source = source.entries(
                    "compressor", self.compressor, x, dtype, self._round_entries
                )
                stale = shared.stale_keys
                shared = V41Shared(both[..., : c.head_dim], both[..., c.head_dim :], layout)
                shared = shared._replace(stale_keys=stale)
            elif shared.entries is None:
                raise V41WiringError(f"layer {self.layer} ({self.role}) got no published entries")
            visibility = Visibility(source.query_index, source.segment, shared.layout)
            if self.indexer is not None:
                keys = shared.keys if shared.stale_keys is None else shared.stale_keys
                problem = self.indexer_problem(x, qr, source.positions, keys, visibility)
                problem = self._within_candidates(problem, shared)
                selection, candidates = self._select(problem, shared)
                shared = shared._replace(
                    selection=selection, candidates=candidates, stale_keys=None
                )
            elif shared.selection is None:
                raise V41WiringError(f"layer {self.layer} (reuse) got no published selection")
            selection = shared.selection
            entries = shared.entries.astype(kv.dtype)
            reads = reads.join(ex.entry_reads(entries, visibility, selection, stage))
        scale = c.head_dim**-0.5
        o = ex.attend(q, reads, self.sinks, scale, return_lse=want_loss)
        target = None
        if want_loss:
            o, lse = o
            target = AttentionTarget(q, entries, lse, scale)
        y = self.project_out(o, source.positions)
        return y, selection, (problem, target), source, shared

    def _round_entries(self, both: Array) -> Array:
        """A KV source's entries and index keys (side by side) as the numerics round them,
        once, as they are written."""
        c, nx = self.config, self.execution.numerics
        entries = nx.entries(both[..., : c.head_dim], c.rope_dim, self.formats)
        keys = nx.indexer(both[..., c.head_dim :], self.formats)
        return jnp.concatenate([entries, keys.astype(entries.dtype)], axis=-1)

    def _within_candidates(self, problem, shared):
        """A consumer's problem restricted to the published candidate blocks (only where the
        filter can drop anything: with ``Nb`` at least the blocks there are, it keeps every
        block holding a visible entry); any other index source's unchanged."""
        c, i = self.config, self.layer
        if not c.uses_candidates(i):
            return problem
        if shared.candidates is None:
            raise V41WiringError(f"layer {i} uses candidates but none were published")
        bc, entries = c.candidate_block_size, problem.keys.shape[1]
        if -(-entries // bc) > c.candidate_topk_blocks:
            return problem._replace(candidates=shared.candidates, candidate_block_size=bc)
        return problem

    def _select(self, problem, shared):
        """The index source's top-k by the execution's strategy, with the candidate blocks at
        the candidate source (from the same scores), and the candidates it publishes."""
        c, ex = self.config, self.execution
        if c.is_candidate_source(self.layer):
            nb, bc = c.candidate_topk_blocks, c.candidate_block_size
            return ex.select_candidates(problem, c.index_topk, nb, bc)
        return ex.select(problem, c.index_topk), shared.candidates

    @jaxtyped(typechecker=beartype)
    def __call__(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        shared: V41Shared | None = None,
        positions: Int[ArrayLike, "batch seq"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        return_aux: bool = False,
        *,
        indexer_loss: str | None = None,
    ) -> (
        tuple[Float[Array, "batch seq hidden"], V41Shared]
        | tuple[Float[Array, "batch seq hidden"], V41Shared, dict]
    ):
        """The layer's forward (docs/v41.md).

        **Arguments:**

        - ``x``: hidden states ``[B, S, hidden]``.
        - ``shared``: what the earlier layers of the stack published (``None``: nothing; a
            reindex or reuse layer needs its sources' entries, keys and selection).
        - ``positions``: RoPE positions ``[B, S]``; default the index inside each segment.
        - ``segment_ids``: packed-document ids ``[B, S]``; windows and groups restart per
            document and no token sees another document.
        - ``return_aux``: also return the aux dict.
        - ``indexer_loss``: the training stage of this call (docs/v41.md, "Training the
            indexers"): ``"off"``, ``"dense"`` (every compressed layer attends every visible
            entry; an index source distils towards that over the entries its top-k picks
            from) or ``"sparse"`` (attend the selection, distil over it); ``None`` =
            ``execution.indexer_loss``.

        **Returns:** ``(y, shared)``: ``y [B, S, hidden]`` in ``x``'s dtype and the published
        state after this layer (``shared`` unchanged by a sliding or reuse layer); with
        ``return_aux``, ``(y, shared, aux)``: ``aux["selection"]`` the int32 ``[B, S,
        index_topk]`` entry slots the layer reads through (increasing, ``-1`` = none; a reuse
        layer's inherited one, ``None`` for a sliding layer) and ``aux["indexer_loss"]`` a
        float32 scalar (``None`` when the stage is ``"off"`` or the layer runs no indexer).

        The execution's placement runs it (``Execution.heads`` / ``context``; docs/v41.md,
        "Scaling out"): ``shared`` crosses it as carried state, the selection and candidates
        per query row, the entries, keys and layout whole-sequence.
        """
        c, ex = self.config, self.execution
        stage = self.stage(indexer_loss)
        x, positions, segment_ids = checks.layer_inputs(c.hidden_size, x, positions, segment_ids)
        dtype, x = x.dtype, ex.numerics.layer_input(x)
        placement = ex.placement
        rows = self._whole_rows(placement, x, positions, segment_ids)
        want_loss = return_aux and self.indexer is not None and stage != "off"
        shared = V41Shared() if shared is None else shared
        body = partial(_body, stage, want_loss, return_aux)
        y, selection, sums, carried = placement.run(body, self, x, rows, _carried(shared._asdict()))
        published = {**carried.per_row, **carried.whole}
        if "entries" in published:  # the sequence's slots (a placement may have padded it)
            t = rows.layout.end.shape[1]
            entries, keys = published["entries"][:, :t], published["keys"][:, :t]
            published.update(entries=entries, keys=keys, layout=rows.layout)
        shared = shared._replace(**published) if published else shared
        y = y.astype(dtype)
        if not return_aux:
            return y, shared
        loss = sums[0] / jnp.maximum(sums[1], 1.0) if want_loss else None
        return y, shared, {"selection": selection, "indexer_loss": loss}

    def extend(
        self,
        x: Float[ArrayLike, "batch seq hidden"],
        cache: V4Cache,
        shared: V41Shared | None = None,
        lengths: Int[ArrayLike, " batch"] | None = None,
        segment_ids: Int[ArrayLike, "batch seq"] | None = None,
        *,
        indexer_loss: str | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], V4Cache, V41Shared]:
        """Run the chunk ``x`` after the tokens in ``cache`` (prefill, chunked prefill or a
        decode step): equal to the forward over the whole stream (docs/v41.md, "Decoding").
        A KV source's cache keeps the raw projections of its open group, so groups may span
        chunks; every layer keeps its window ring.

        **Arguments:**

        - ``x``: the chunk ``[B, T, hidden]``.
        - ``cache``: this layer's cache (``init_cache``, then what ``extend`` returned).
        - ``shared``: what the earlier layers published for this chunk (their ``extend``);
            a KV source's entries and keys are every entry its cache holds.
        - ``lengths``, ``segment_ids``: as for ``V4Attention.extend``.
        - ``indexer_loss``: the training stage whose attention to run (``"dense"`` reads every
            visible entry; no loss is computed); ``None`` = ``execution.indexer_loss``.

        **Returns:** ``(y, cache, shared)``.
        """
        stage = self.stage(indexer_loss)
        x, lengths, segment_ids = checks.chunk_inputs(self, x, cache, lengths, segment_ids)
        if x.shape[1] == 0:
            raise ValueError("V41Attention.extend needs a chunk of at least one token")
        rows = chunk_rows(cache, x.shape[1], lengths, segment_ids)
        dtype, x = x.dtype, self.execution.numerics.layer_input(x)
        source = ChunkSource.start(cache, rows)
        y, _, _, source, shared = self.forward_rows(x, source, stage, False, shared)
        return y.astype(dtype), source.cache_after(), shared

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
        """An empty decode cache: the window ring, and for a KV source the open group's raw
        projections and ``max_length // m`` entry slots (entries and index keys side by side).
        Reindex and reuse layers hold no compressed state: they read their KV source's.

        **Arguments:** ``batch_size``, ``max_length`` (tokens per row) and the buffers' ``dtype``.

        **Returns:** a ``csa_eqx.V4Cache`` (``length`` 0 in every row).
        """
        c = self.config
        check_cache_size(batch_size, max_length)
        m, own = self.entry_rate, self.compressor is not None
        slots = max_length // m if own else 0
        length, position, segment = empty_rows(batch_size)
        empty = jnp.full((batch_size, slots), -1, jnp.int32)
        ring = c.sliding_window - 1
        state = None
        if own:
            width = c.head_dim + c.index_head_dim
            state = CompressorState(
                jnp.zeros((batch_size, m, c.head_dim), dtype),
                jnp.zeros((batch_size, m, c.head_dim), dtype),
                jnp.zeros((batch_size, slots, width), dtype),
            )
        return V4Cache(
            length=length,
            position=position,
            segment=segment,
            window_kv=jnp.zeros((batch_size, ring, c.head_dim), dtype),
            window_segment=jnp.full((batch_size, ring), -1, jnp.int32),
            entry_end=empty,
            entry_segment=jnp.copy(empty),
            entry_count=jnp.zeros((batch_size,), jnp.int32),
            compressor=state,
            indexer=None,
            max_length=max_length,
        )


_PER_ROW = ("selection", "candidates")  # V41Shared's fields with a row per query


def _carried(fields: dict) -> Carried:
    """``V41Shared`` fields (by name) as a placement carries them: the selection and the
    candidates per query row, the entries, keys and layout whole-sequence."""
    per_row = {k: v for k, v in fields.items() if k in _PER_ROW}
    return Carried(per_row, {k: v for k, v in fields.items() if k not in _PER_ROW})


def _body(
    stage: str, want_loss: bool, aux: bool, layer: V41Attention, x: Array, rows: Rows, carried
) -> tuple:
    """What the placement runs (``AbstractPlacement.run``): the layer's forward over ``rows``
    from the published state, returning ``(y, selection, sums, carried)``: the selection the
    layer reads through when ``aux`` asks for it, the indexer loss sums when ``want_loss``
    (``AbstractIndexedAttention._loss_sums``) and only the state fields the layer replaced
    (none for a sliding or reuse layer: nothing travels back)."""
    given = V41Shared(**carried.per_row, **carried.whole)
    y, selection, (problem, target), _, shared = layer.forward_rows(
        x, rows, stage, want_loss, given
    )
    sums = layer._loss_sums(rows, stage, selection, problem, target) if want_loss else ()
    published = {k: v for k, v in shared._asdict().items() if v is not getattr(given, k)}
    return y, selection if aux else None, sums, _carried(published)


def run_v41_stack(
    layers: Sequence[V41Attention],
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    positions: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    return_aux: bool = False,
    indexer_loss: str | None = None,
) -> tuple[list[Array], list[V41Shared]] | tuple[list[Array], list[V41Shared], list[dict]]:
    """Run the attention layers of a V4.1 stack in order, threading what they publish.

    **Arguments:**

    - ``layers``: ``V41Attention`` layers ``0..n-1`` of one config, in order.
    - ``xs``: one input ``[B, S, hidden]`` for every layer (an attention-only stack feeds
        each layer its own input), or a single one fed to all.
    - ``positions``, ``segment_ids``: as for ``V41Attention.__call__``.
    - ``return_aux``: also return each layer's aux dict.
    - ``indexer_loss``: every layer's training stage (``None``: each layer's
        ``execution.indexer_loss``), as for ``V41Attention.__call__``.

    **Returns:** ``(ys, published)``: each layer's output and the ``V41Shared`` after it; with
    ``return_aux``, ``(ys, published, auxes)``: each layer's aux (``aux["indexer_loss"]`` is
    ``None`` but at the index sources with the loss on; the stack's indexer loss is the sum
    of the others).
    """
    xs = _check_stack(layers, xs)
    ys, published, auxes, shared = [], [], [], V41Shared()
    for layer, x in zip(layers, xs, strict=True):
        y, shared, *aux = layer(
            x, shared, positions, segment_ids, return_aux, indexer_loss=indexer_loss
        )
        ys.append(y)
        published.append(shared)
        auxes.extend(aux)
    return (ys, published, auxes) if return_aux else (ys, published)


def _check_stack(layers, xs) -> list:
    """The layers are ``0..n-1`` of one config; one input per layer (or one for all)."""
    if not layers:
        raise ValueError("a V4.1 stack needs at least one layer")
    config = layers[0].config
    for i, layer in enumerate(layers):
        if layer.config != config or layer.layer != i:
            raise V41WiringError(
                f"layers[{i}] is layer {layer.layer} of its config; a V4.1 stack needs "
                "layers 0..n-1 of one config in order"
            )
    if len(layers) != config.num_layers:
        raise V41WiringError(f"the config has {config.num_layers} layers, got {len(layers)}")
    xs = [xs] * len(layers) if not isinstance(xs, list | tuple) else list(xs)
    if len(xs) != len(layers):
        raise ValueError(f"xs has {len(xs)} inputs for {len(layers)} layers")
    return xs


def extend_v41_stack(
    layers: Sequence[V41Attention],
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    caches: Sequence[V4Cache],
    lengths: Int[Array, " batch"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    step=None,
    stale_index_keys: int | None = None,
) -> tuple[list[Array], list[V4Cache], list[V41Shared]] | tuple:
    """``run_v41_stack`` for one chunk after ``caches`` (``V41Attention.extend`` per layer).

    **Arguments:**

    - ``layers`` (as for ``run_v41_stack``), the chunk's inputs ``xs`` (one per layer, or one
        for all), each layer's cache and the chunk's ``lengths`` / ``segment_ids``.
    - ``step``: ``step(layer, x, cache, shared, lengths, segment_ids) -> (y, cache, shared)``
        (default ``V41Attention.extend``; e.g. an ``eqx.filter_jit`` of it).
    - ``stale_index_keys``: ``None`` (the default: every KV source publishes its keys on
        every call), or, to reproduce DeepSeek's inference code for comparison, the layer whose
        keys DeepSeek's global ``index_k`` last pointed to (``-1`` before the first call).
        DeepSeek republishes a KV source's keys only on calls that close one of its groups;
        on the others its own indexer and the reindex layers after it score the last
        publisher's keys (another layer's, even of another ratio). Needs a batch whose rows
        are at equal positions, without ``lengths`` or ``segment_ids``; runs eagerly.

    **Returns:** ``(ys, caches, published)`` per layer; with ``stale_index_keys``, also the
    layer the pointer points to after the chunk (pass it to the next call).
    """
    xs = _check_stack(layers, xs)
    if len(caches) != len(layers):
        raise ValueError(f"{len(caches)} caches for {len(layers)} layers")
    step = V41Attention.extend if step is None else step
    stale = stale_index_keys is not None
    if stale and (lengths is not None or segment_ids is not None):
        raise ValueError("stale_index_keys needs a chunk without lengths or segment_ids")
    pointer = stale_index_keys
    config = layers[0].config
    ys, new, published, shared = [], list(caches), [], V41Shared()
    for i, (layer, x) in enumerate(zip(layers, xs, strict=True)):
        if stale and layer.indexer is not None:
            if layer.compressor is not None and _closes_group(new[i], x.shape[1], layer):
                pointer = i  # DeepSeek's owner publishes (its own, fresh keys)
            elif pointer != config.kv_source(i) or layer.compressor is not None:
                if pointer is None or pointer < 0:
                    raise V41WiringError(f"layer {i} would read keys nobody published")
                keys = new[pointer].compressor.entries[..., config.head_dim :]
                slots = caches[config.kv_source(i)].compressor.entries.shape[1]
                keys = jnp.pad(keys, [(0, 0), (0, max(slots - keys.shape[1], 0)), (0, 0)])
                shared = shared._replace(stale_keys=keys[:, :slots])
        y, new[i], shared = step(layer, x, new[i], shared, lengths, segment_ids)
        ys.append(y)
        published.append(shared)
    return (ys, new, published, pointer) if stale else (ys, new, published)


def _closes_group(cache: V4Cache, seq: int, layer: V41Attention) -> bool:
    """Whether a chunk of ``seq`` tokens after ``cache`` closes one of ``layer``'s groups (on
    the host: the stale-key emulation decides in Python, as DeepSeek does)."""
    position = int(np.asarray(cache.position)[0])
    m = layer.entry_rate
    return (position + seq) // m > position // m
