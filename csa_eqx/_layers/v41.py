"""DeepSeek-V4.1 attention (docs/v41.md): V4's attention block with the compressed KV, the index
keys and the selections shared across the layers of a stack.

``V41Attention`` is a V4-family layer (``csa_eqx._layers.v4_family``) whose role
(``config.role(layer)``) decides the parts its constructor builds (``csa_eqx._layers.v41_parts``)
and whose stack state is ``V41Shared``. ``run_v41_stack`` / ``extend_v41_stack``
(``csa_eqx._stack``) check a stack's wiring and thread the published state through it.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._entries.v41 import V41Compressor
from .._execution import Execution
from .._indexer.base import AbstractCandidateRule, NoCandidates
from .._indexer.heads import IndexerHeads
from .._numerics.base import V41_FORMATS, DeepSeekFormats
from .block import V4Block
from .parts import AbstractEntries, AbstractSelectionSource, AllEntries
from .v4_family import AbstractV4Attention
from .v41_config import V41AttentionConfig
from .v41_parts import (
    CandidateSource,
    IndexSource,
    PublishedEntries,
    PublishedSelection,
    SourceEntries,
    V41Shared,
    WithinCandidates,
)

__all__ = ["V41Attention"]


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
        kind = f"V4.1 layer {self.layer} of {self.config.num_layers}, {self.role}"
        return kind, self._summary_sizes(*(("index_topk",) if self.selects else ()))

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
