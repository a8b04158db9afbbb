"""DeepSeek-V4.1 attention (docs/v41.md): V4's attention block with the compressed KV, the index
keys and the selections shared across the layers of a stack.

``V41Attention`` is composed of the V4 family's parts (``V4Block``, ``V41Compressor``,
``IndexerHeads``) and of the parts its role (``config.role(layer)``) picks for where its
entries and selection come from (``csa_eqx._sources``); it runs the family's pipeline under the
one layer protocol. ``run_v41_stack`` / ``extend_v41_stack`` check a stack's wiring and thread
the published ``V41Shared`` through it (``csa_eqx._stack``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._entries.v41 import V41Compressor
from .._indexer.heads import IndexerHeads
from .._numerics.base import V41_FORMATS, DeepSeekFormats
from .base import AbstractIndexedAttention
from .block import V4Block
from .cache import V4Cache
from .execution import Execution, checked_execution
from .forward import V41Shared
from .parts import (
    AbstractEntries,
    AbstractSelectionSource,
    AllEntries,
    CandidateRule,
    Compressed,
    OwnEntries,
    OwnSelection,
    PublishedEntries,
    PublishedSelection,
)
from .stack import extend_stack, run_stack, stack_inputs
from .v4_family import v4_cache, v4_entry_attention, v4_forward, v4_head_specs
from .v41_config import V41AttentionConfig, V41WiringError

__all__ = ["V41Attention", "run_v41_stack", "extend_v41_stack"]


def _sources(config: V41AttentionConfig, i: int) -> tuple:
    """Where layer ``i``'s entries and selection come from, by its role."""
    role = config.role(i)
    who = f"layer {i} ({role})"
    if role == "sliding":
        return None, AllEntries()
    entries = OwnEntries(publishes=True) if role == "full" else PublishedEntries(who)
    if role == "reuse":
        return entries, PublishedSelection(who)
    rule = CandidateRule()
    if config.is_candidate_source(i) or config.uses_candidates(i):
        kind = "source" if config.is_candidate_source(i) else "within"
        rule = CandidateRule(
            kind, config.candidate_topk_blocks, config.candidate_block_size, f"layer {i}"
        )
    return entries, OwnSelection(publishes=True, candidates=rule)


class V41Attention(AbstractIndexedAttention):
    """Layer ``layer`` of a DeepSeek-V4.1 attention stack; its role (``config.role(layer)``)
    decides what it owns (docs/v41.md):

    - ``"sliding"``: the ``block`` only (RoPE ``rope_theta``);
    - ``"full"`` (a KV source): a ``V41Compressor`` and the ``indexer`` heads; publishes
        entries, index keys and its selection (and the candidates at the candidate source);
    - ``"reindex"``: the ``indexer`` heads over the latest KV source's keys; publishes a
        selection (restricted to the candidates after the candidate source);
    - ``"reuse"``: nothing of its own beyond the block: attends the published entries through
        the published selection.

    Every layer's block has no per-head query norm; compressed roles rope with the compress
    table. Parameter names follow ``V4Attention`` (``csa_eqx.hf.v41_parameter_names`` maps
    DeepSeek's).

    **Arguments:** the stack's ``config``, the ``layer`` index, ``key``, ``dtype`` and
    ``execution`` (as ``AbstractIndexedAttention``; numerics ``ExactNumerics`` or
    ``DeepSeekV41Inference``).
    """

    block: V4Block
    compressor: V41Compressor | None
    indexer: IndexerHeads | None
    config: V41AttentionConfig = eqx.field(static=True)
    layer: int = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    entry_source: AbstractEntries | None = eqx.field(static=True)
    selection_source: AbstractSelectionSource = eqx.field(static=True)
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
        execution = checked_execution(execution, c, V41_FORMATS)
        role, ratio = c.role(layer), c.compress_ratios[layer]
        ks = jax.random.split(key, 3)
        self.block = V4Block(
            c, compressed=role != "sliding", query_norm=False, key=ks[0], dtype=dtype
        )
        full = role == "full"
        self.compressor = V41Compressor(c, ratio, key=ks[1], dtype=dtype) if full else None
        has_indexer = role in ("full", "reindex")
        self.indexer = IndexerHeads(c, key=ks[2], dtype=dtype) if has_indexer else None
        self.entry_source, self.selection_source = _sources(c, layer)
        self.config, self.layer, self.execution = config, layer, execution

    @property
    def role(self) -> str:
        """**Returns:** the layer's role, ``config.role(layer)``."""
        return self.config.role(self.layer)

    @property
    def selects(self) -> bool:
        """**Returns:** whether the layer reads through a selection (every compressed role)."""
        return self.entry_source is not None

    @property
    def entry_rate(self) -> int:
        """**Returns:** the layer's compress ratio (0: sliding)."""
        return self.config.compress_ratios[self.layer]

    @property
    def context_halo(self) -> int:
        """**Returns:** ``window - 1`` rows (and a group's ``m - 1``)."""
        return max(self.config.sliding_window - 1, max(self.entry_rate - 1, 0))

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism: as ``V4Attention.head_specs``."""
        return v4_head_specs(self.config, axis)

    def forward_rows(self, x, source, stage, want_loss=False, shared=None):
        """The V4 family's pipeline over ``source`` (``csa_eqx._v4_family.v4_forward``; see
        ``AbstractIndexedAttention.forward_rows``)."""
        shared = V41Shared() if shared is None else shared
        return v4_forward(self, x, source, stage, want_loss, shared)

    def entry_attention(
        self,
        x: Float[Array, "batch seq hidden"],
        segment_ids: Int[Array, "batch seq"] | None = None,
        shared: V41Shared | None = None,
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """As ``V4Attention.entry_attention``, for an index source (full or reindex), from the
        state ``shared`` published before it (a consumer's mass is over its candidates)."""
        shared = V41Shared() if shared is None else shared
        return v4_entry_attention(self, x, segment_ids, shared)

    def compress(self, x: Array, source) -> tuple[Compressed, object]:
        """A KV source's entries and index keys, from its ``V41Compressor``, rounded once as
        they are written (``OwnEntries``' call). The groups pool in the numerics' compressor
        precision (``compressor_input``, which knows DeepSeek's bf16 ratio-1 compressor)."""
        c, nx = self.config, self.execution.numerics
        pooled_input = nx.compressor_input(x, self.entry_rate, self.formats)

        def rounded(both):
            entries = nx.entries(both[..., : c.head_dim], c.rope_dim, self.formats)
            keys = nx.indexer(both[..., c.head_dim :], self.formats)
            return jnp.concatenate([entries, keys.astype(entries.dtype)], axis=-1)

        both, layout, source = source.entries(
            "compressor", self.compressor, pooled_input, nx.entry_dtype(x), rounded, nx
        )
        return Compressed(both[..., : c.head_dim], both[..., c.head_dim :], layout), source

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
        """An empty decode cache: the window ring, and for a KV source the open group's raw
        projections and ``max_length // m`` entry slots (entries and index keys side by side).
        Reindex and reuse layers hold no compressed state: they read their KV source's.

        **Arguments:** ``batch_size``, ``max_length`` (tokens per row) and the buffers' ``dtype``.

        **Returns:** a ``csa_eqx.V4Cache`` (``length`` 0 in every row).
        """
        return v4_cache(self, batch_size, max_length, dtype)


def _check_stack(layers: Sequence[V41Attention], xs) -> list:
    """The layers are ``0..n-1`` of one config; one input per layer (or one for all)."""
    xs = stack_inputs(layers, xs)
    config = layers[0].config
    for i, layer in enumerate(layers):
        if layer.config != config or layer.layer != i:
            raise V41WiringError(
                f"layers[{i}] is layer {layer.layer} of its config; a V4.1 stack needs "
                "layers 0..n-1 of one config in order"
            )
    if len(layers) != config.num_layers:
        raise V41WiringError(f"the config has {config.num_layers} layers, got {len(layers)}")
    return xs


def run_v41_stack(
    layers: Sequence[V41Attention],
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    positions: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    return_aux: bool = False,
    indexer_loss: str | None = None,
):
    """Run the attention layers of a V4.1 stack in order, threading what they publish
    (``csa_eqx.run_stack`` once the wiring is checked).

    **Arguments:** ``layers`` (``V41Attention`` layers ``0..n-1`` of one config, in order) and
    the rest as for ``run_stack``.

    **Returns:** as ``run_stack``: ``(ys, published)`` or ``(ys, published, auxes)``
    (``aux["indexer_loss"]`` is ``None`` but at the index sources with the loss on; the
    stack's indexer loss is the sum of the others).
    """
    xs = _check_stack(layers, xs)
    kw = dict(return_aux=return_aux, indexer_loss=indexer_loss)
    return run_stack(layers, xs, positions, segment_ids, **kw)


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
    """``run_v41_stack`` for one chunk after ``caches`` (``csa_eqx.extend_stack``).

    **Arguments:**

    - ``layers`` (as for ``run_v41_stack``), the chunk's inputs ``xs`` (one per layer, or one
        for all), each layer's cache and the chunk's ``lengths`` / ``segment_ids``; ``step``
        as for ``extend_stack``.
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
    if stale_index_keys is None:
        return extend_stack(layers, xs, caches, lengths, segment_ids, step=step)
    if lengths is not None or segment_ids is not None:
        raise ValueError("stale_index_keys needs a chunk without lengths or segment_ids")
    config, pointer = layers[0].config, [stale_index_keys]

    def stale(i, x, caches_now, shared):  # DeepSeek's index_k pointer, before layer i
        layer = layers[i]
        if layer.indexer is None:
            return shared
        if layer.compressor is not None and _closes_group(caches_now[i], x.shape[1], layer):
            pointer[0] = i  # DeepSeek's owner publishes (its own, fresh keys)
            return shared
        if pointer[0] == config.kv_source(i) and layer.compressor is None:
            return shared
        if pointer[0] is None or pointer[0] < 0:
            raise V41WiringError(f"layer {i} would read keys nobody published")
        keys = caches_now[pointer[0]].compressor.entries[..., config.head_dim :]
        slots = caches[config.kv_source(i)].compressor.entries.shape[1]
        keys = jnp.pad(keys, [(0, 0), (0, max(slots - keys.shape[1], 0)), (0, 0)])
        return shared._replace(stale_keys=keys[:, :slots])

    ys, new, published = extend_stack(layers, xs, caches, step=step, before=stale)
    return ys, new, published, pointer[0]


def _closes_group(cache: V4Cache, seq: int, layer: V41Attention) -> bool:
    """Whether a chunk of ``seq`` tokens after ``cache`` closes one of ``layer``'s groups (on
    the host: the stale-key emulation decides in Python, as DeepSeek does)."""
    position = int(np.asarray(cache.position)[0])
    m = layer.entry_rate
    return (position + seq) // m > position // m
