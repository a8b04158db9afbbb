"""V4.1's parts (docs/v41.md, "The sharing schedule"): the state a V4.1 stack's layers publish to
the later ones (``V41Shared``), where a V4.1 layer's entries and selection come from by its
role, and its indexer's candidate rules (docs/v41.md, "Candidates").

*Entries*: a KV source's own ``V41Compressor`` (``SourceEntries``, which publishes them) or what
the latest KV source published (``PublishedEntries``: reindex and reuse layers). *Selection*:
its own indexer over the published index keys (``IndexSource``: full and reindex layers, which
publish their top-k) or the latest index source's (``PublishedSelection``: reuse layers). An
index source's indexer picks among every visible entry (``NoCandidates``), publishes the
candidate blocks from the scores of its own top-k (``CandidateSource``, the candidate source) or
picks within the published blocks (``WithinCandidates``, the index sources after it).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._entries.v41 import V41Compressor
from .._indexer.base import AbstractCandidateRule
from .._indexer.heads import IndexerHeads
from .._layout import EntryLayout
from .._selection.auto import candidate_source
from .._selection.candidates import CandidateVisibility
from .parts import AbstractEntries, AbstractSelectionSource, Compressed
from .v41_config import V41WiringError

__all__ = [
    "V41Shared",
    "SourceEntries",
    "PublishedEntries",
    "IndexSource",
    "PublishedSelection",
    "CandidateSource",
    "WithinCandidates",
]


class V41Shared(NamedTuple):
    """What the layers of a V4.1 stack publish to the later ones (docs/v41.md, "The sharing
    schedule"): a V4.1 layer's stack state. A field is ``None`` until a layer publishes it.
    Every V4.1 layer takes it (``layer(x, ..., shared=...)``, ``layer.extend(...,
    shared=...)``) and returns it with what it published; other layers pass it on.

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

    per_row = ("selection", "candidates")  # the fields with a row per query


class SourceEntries(AbstractEntries):
    """A KV source's entries and index keys, from its ``V41Compressor``, rounded once as they
    are written; published, which starts a new sharing group: the earlier selection and
    candidates are over other entries, so they are withdrawn. The groups pool in the
    numerics' compressor precision (``compressor_input``, which knows DeepSeek's bf16 ratio-1
    compressor).

    **Arguments:** the ``compressor``.
    """

    compressor: V41Compressor

    def entries(self, x, source, state, execution, formats):
        nx, compressor = execution.numerics, self.compressor
        dim, rope_dim = compressor.kv_proj.shape[0], compressor.rope.dim
        pooled_input = nx.compressor_input(x, compressor.compress_rate, formats)

        def rounded(both):
            entries = nx.entries(both[..., :dim], rope_dim, formats)
            keys = nx.indexer(both[..., dim:], formats)
            return jnp.concatenate([entries, keys.astype(entries.dtype)], axis=-1)

        both, layout, source = source.entries(
            "compressor", compressor, pooled_input, nx.entry_dtype(x), rounded, nx
        )
        compressed = Compressed(both[..., :dim], both[..., dim:], layout)
        return compressed, source, dict(compressed._asdict(), selection=None, candidates=None)


class PublishedEntries(AbstractEntries):
    """The entries, index keys and layout the latest KV source published.

    **Arguments:** ``who``: the layer, for the error when nothing was published (e.g.
    ``"layer 2 (reuse)"``).
    """

    who: str = eqx.field(static=True)
    compressor: ClassVar[None] = None

    def entries(self, x, source, state, execution, formats):
        if state.entries is None:
            raise V41WiringError(f"{self.who} got no published entries")
        return Compressed(state.entries, state.keys, state.layout), source, {}


class IndexSource(AbstractSelectionSource):
    """An index source's own indexer over the published index keys (or, in DeepSeek's
    stale-key emulation, ``state.stale_keys``); publishes its top-k (and, as the candidate
    source, the candidate blocks).

    **Arguments:** the ``indexer`` (an ``IndexerHeads`` with the layer's candidate rule).
    """

    indexer: IndexerHeads

    def select(self, x, qr, positions, compressed, visibility, source, state, execution, formats):
        # DeepSeek's stale-key emulation (extend_v41_stack) may hand other keys to score
        keys = compressed.keys if state.stale_keys is None else state.stale_keys
        args = (x, qr, positions, keys, visibility, execution, formats)
        selection, problem, fields = self.indexer(*args, state=state)
        return selection, problem, dict(fields, selection=selection, stale_keys=None), source


class PublishedSelection(AbstractSelectionSource):
    """The selection the latest index source published (V4.1's reuse layers).

    **Arguments:** ``who``: the layer, for the error when nothing was published.
    """

    who: str = eqx.field(static=True)
    indexer: ClassVar[None] = None

    def select(self, x, qr, positions, compressed, visibility, source, state, execution, formats):
        if state.selection is None:
            raise V41WiringError(f"{self.who} got no published selection")
        return state.selection, None, {}, source


class CandidateSource(AbstractCandidateRule):
    """The candidate source's rule: its queries pick among every visible entry, and the scores
    of its top-k also give each query's best ``topk_blocks`` blocks of ``block_size`` entries,
    which it publishes (the execution's selection routed to its candidate source by the
    selection's chooser, ``csa_eqx._selection.auto.candidate_source``).

    **Arguments:** ``topk_blocks`` and ``block_size``: ``Nb`` and ``bc``.
    """

    topk_blocks: int
    block_size: int

    def visibility(self, visibility, state):
        return visibility

    def select(self, indexer, problem, execution):
        source = candidate_source(execution.selection, problem)
        k, nb, bc = indexer.topk, self.topk_blocks, self.block_size

        def both(p):
            return source.select_candidates(p, k, nb, bc)

        selection, candidates = indexer.run(problem, execution, both)
        return selection, {"candidates": candidates}


class WithinCandidates(AbstractCandidateRule):
    """The rule of an index source after the candidate source: its queries pick within the
    published candidate blocks (a ``CandidateVisibility``).

    **Arguments:** the blocks' ``block_size`` (``bc``) and ``who``: the layer, for the error
    when no candidates were published.
    """

    block_size: int
    who: str

    def visibility(self, visibility, state):
        if state.candidates is None:
            raise V41WiringError(f"{self.who} uses candidates but none were published")
        return CandidateVisibility.within(visibility, state.candidates, self.block_size)
