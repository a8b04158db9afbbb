"""DeepSeek-V4.1 attention (docs/v41.md): V4's attention block with the compressed KV, the index
keys and the selections shared across the layers of a stack.

``V41Attention`` is a V4-family layer (``csa_eqx._layers.v4_family``) whose role
(``config.role(layer)``) decides the parts its constructor builds (``csa_eqx._layers.v41_parts``)
and whose stack state is ``V41Shared``. ``run_v41_stack`` / ``extend_v41_stack`` check a
stack's wiring and thread the published state through it (``csa_eqx._layers.stack``).
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
from .._indexer.base import AbstractCandidateRule, NoCandidates
from .._indexer.heads import IndexerHeads
from .._numerics.base import V41_FORMATS, DeepSeekFormats
from .block import V4Block
from .cache import V4Cache
from .execution import Execution
from .parts import AbstractEntries, AbstractSelectionSource, AllEntries
from .stack import extend_stack, run_stack, stack_inputs
from .v4_family import AbstractV4Attention
from .v41_config import V41AttentionConfig, V41WiringError
from .v41_parts import (
    CandidateSource,
    IndexSource,
    PublishedEntries,
    PublishedSelection,
    SourceEntries,
    V41Shared,
    WithinCandidates,
)

__all__ = ["V41Attention", "run_v41_stack", "extend_v41_stack"]


def _candidate_rule(config: V41AttentionConfig, i: int) -> AbstractCandidateRule:
    """Layer ``i``'s part in the pre-filter: the candidate source's, a later index source's or
    none."""
    c = config
    if c.is_candidate_source(i):
        return CandidateSource(c.candidate_topk_blocks, c.candidate_block_size)
    if c.uses_candidates(i):
        return WithinCandidates(c.candidate_block_size, f"layer {i}")
    return NoCandidates()


def _parts(config: V41AttentionConfig, i: int, keys, dtype) -> tuple:
    """Where layer ``i``'s entries and selection come from, by its role: ``(entry_source,
    selection_source)``, with the compressor and indexer its role owns (PRNG ``keys``)."""
    c, role = config, config.role(i)
    who = f"layer {i} ({role})"
    if role == "sliding":
        return None, AllEntries()
    if role == "full":
        entries = SourceEntries(V41Compressor(c, c.compress_ratios[i], key=keys[0], dtype=dtype))
    else:
        entries = PublishedEntries(who)
    if role == "reuse":
        return entries, PublishedSelection(who)
    rule = _candidate_rule(c, i)
    indexer = IndexerHeads(c, key=keys[1], dtype=dtype, candidates=rule)
    return entries, IndexSource(indexer)


class V41Attention(AbstractV4Attention):
    """Layer ``layer`` of a DeepSeek-V4.1 attention stack; its role (``config.role(layer)``)
    decides the parts it is built of (docs/v41.md):

    - ``"sliding"``: the ``block`` only (RoPE ``rope_theta``);
    - ``"full"`` (a KV source): its ``V41Compressor`` (``entry_source``) and its indexer heads
        (``selection_source``); publishes entries, index keys and its selection (and the
        candidates at the candidate source);
    - ``"reindex"``: its indexer heads over the latest KV source's keys; publishes a selection
        (restricted to the candidates after the candidate source);
    - ``"reuse"``: nothing of its own beyond the block: attends the published entries through
        the published selection.

    Every layer's block has no per-head query norm; compressed roles rope with the compress
    table. Its pytree paths are the parts' (``.entry_source.compressor.key_proj``,
    ``.selection_source.indexer.q_b_proj``, ...; ``csa_eqx.hf.parameter_paths`` maps
    DeepSeek's names to them); ``compressor`` and ``indexer`` read the parts' own.

    **Arguments:** the stack's ``config``, the ``layer`` index, ``key``, ``dtype`` and
    ``execution`` (as ``AbstractIndexedAttention``; numerics ``ExactNumerics`` or
    ``DeepSeekV41Inference``).
    """

    block: V4Block
    entry_source: AbstractEntries | None
    selection_source: AbstractSelectionSource
    config: V41AttentionConfig = eqx.field(static=True)
    layer: int = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V41_FORMATS
    stack_state: ClassVar[type] = V41Shared

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
        execution = Execution.checked(execution, c, V41_FORMATS)
        ks = jax.random.split(key, 3)
        compressed = c.role(layer) != "sliding"
        self.block = V4Block(c, compressed=compressed, query_norm=False, key=ks[0], dtype=dtype)
        self.entry_source, self.selection_source = _parts(c, layer, ks[1:], dtype)
        self.config, self.layer, self.execution = config, layer, execution

    @property
    def role(self) -> str:
        """**Returns:** the layer's role, ``config.role(layer)``."""
        return self.config.role(self.layer)

    @property
    def entry_rate(self) -> int:
        """**Returns:** the layer's compress ratio (0: sliding)."""
        return self.config.compress_ratios[self.layer]

    def summary(self) -> tuple[str, dict[str, int]]:
        """See ``AbstractIndexedAttention.summary``: its place and role in the stack, its
        compress ratio, ``index_topk`` when it reads a selection, the window and the
        attention's sizes."""
        c = self.config
        kind = f"V4.1 layer {self.layer} of {c.num_layers}, {self.role}"
        picks = dict(index_topk=c.index_topk) if self.selects else {}
        return kind, dict(
            compress_rate=self.entry_rate,
            **picks,
            sliding_window=c.sliding_window,
            num_heads=c.num_heads,
            head_dim=c.head_dim,
            hidden_size=c.hidden_size,
        )

    @property
    def context_halo(self) -> int:
        """**Returns:** ``window - 1`` rows (and a group's ``m - 1``)."""
        return max(self.config.sliding_window - 1, max(self.entry_rate - 1, 0))

    def entry_attention(
        self,
        x: Float[Array, "batch seq hidden"],
        segment_ids: Int[Array, "batch seq"] | None = None,
        shared: V41Shared | None = None,
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """As ``V4Attention.entry_attention``, for an index source (full or reindex), from the
        state ``shared`` published before it (a consumer's mass is over its candidates;
        ``None`` or another layer kind's state: nothing published)."""
        return self._entry_attention(x, segment_ids, self._state(shared))


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
        return layer._state(shared)._replace(stale_keys=keys[:, :slots])  # the first: StackState()

    ys, new, published = extend_stack(layers, xs, caches, step=step, before=stale)
    return ys, new, published, pointer[0]


def _closes_group(cache: V4Cache, seq: int, layer: V41Attention) -> bool:
    """Whether a chunk of ``seq`` tokens after ``cache`` closes one of ``layer``'s groups (on
    the host: the stale-key emulation decides in Python, as DeepSeek does)."""
    position = int(np.asarray(cache.position)[0])
    m = layer.entry_rate
    return (position + seq) // m > position // m
