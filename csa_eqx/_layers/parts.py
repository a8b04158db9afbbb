"""Where a V4-family layer's compressed entries and its selection come from (docs/v41.md, "The
sharing schedule"): two small families of parts a layer kind is composed of.

*Entries* (``AbstractEntries``): the layer's own compressor(s) (``OwnEntries``: V4's CSA and
HCA layers; a V4.1 KV source, which also publishes them) or what an earlier layer published
(``PublishedEntries``: V4.1's reindex and reuse layers). *Selection*
(``AbstractSelectionSource``): every visible entry (``AllEntries``: HCA), the layer's own
indexer (``OwnSelection``: V4's CSA layers; a V4.1 index source, which publishes its top-k;
with V4.1's pre-filter as a ``CandidateRule``) or what an earlier layer published
(``PublishedSelection``: V4.1's reuse layers). A sliding layer has neither.

The parts hold no arrays: they act on the layer's own (``layer.compress``,
``layer.indexer_problem``) and on the state published so far (``V41Shared``), and say what
the layer publishes as a dict of ``V41Shared`` fields.
"""

from __future__ import annotations

import abc
from typing import ClassVar, NamedTuple

import equinox as eqx
from jaxtyping import Array, Float, Int

from .._layout import EntryLayout, Visibility
from .._selection.candidates import CandidateVisibility
from .forward import V41Shared
from .v41_config import V41WiringError

__all__ = [
    "Compressed",
    "AbstractEntries",
    "OwnEntries",
    "PublishedEntries",
    "AbstractSelectionSource",
    "AllEntries",
    "OwnSelection",
    "PublishedSelection",
    "CandidateRule",
]


class Compressed(NamedTuple):
    """A layer's compressed entries as its attention and indexer read them.

    **Arguments:** the ``entries [B, T, head_dim]``, their index ``keys [B, T, index_dim]``
    (``None`` without an indexer) and their slots' ``layout``.
    """

    entries: Float[Array, "batch slots dim"]
    keys: Float[Array, "batch slots index_dim"] | None
    layout: EntryLayout


class AbstractEntries(eqx.Module):
    """Where a layer's compressed entries come from."""

    @abc.abstractmethod
    def entries(self, layer, x: Array, source, shared: V41Shared) -> tuple:
        """**Arguments:** the ``layer``, its (numerics') input ``x [B', L, hidden]``, the
        ``source`` of the keys seen so far (``csa_eqx._rows``) and the state published so far.

        **Returns:** ``(Compressed, source, published)``: the entries, the source after
        reading them and the ``V41Shared`` fields this publishes (by name).
        """


class OwnEntries(AbstractEntries):
    """The layer's own compressor(s) (``layer.compress``).

    **Arguments:** ``publishes``: publish the entries, keys and layout (a V4.1 KV source),
    which starts a new sharing group: the earlier selection and candidates are over other
    entries, so they are withdrawn.
    """

    publishes: bool = False

    def entries(self, layer, x, source, shared):
        compressed, source = layer.compress(x, source)
        if not self.publishes:
            return compressed, source, {}
        fields = dict(compressed._asdict(), selection=None, candidates=None)
        return compressed, source, fields


class PublishedEntries(AbstractEntries):
    """The entries, index keys and layout an earlier layer published (``shared``).

    **Arguments:** ``who``: the layer, for the error when nothing was published (e.g.
    ``"layer 2 (reuse)"``).
    """

    who: str

    def entries(self, layer, x, source, shared):
        if shared.entries is None:
            raise V41WiringError(f"{self.who} got no published entries")
        return Compressed(shared.entries, shared.keys, shared.layout), source, {}


class CandidateRule(eqx.Module):
    """An index source's part in V4.1's pre-filter (docs/v41.md, "Candidates").

    **Arguments:**

    - ``role``: ``"none"`` (no pre-filter), ``"source"`` (the candidate source: publishes its
        best ``topk_blocks`` blocks of ``block_size`` entries, from the scores of its own
        top-k) or ``"within"`` (a later index source: picks among the published blocks).
    - ``topk_blocks``, ``block_size``: ``Nb`` and ``bc``.
    - ``who``: the layer, for the error when no candidates were published.
    """

    role: str = "none"
    topk_blocks: int = 0
    block_size: int = 0
    who: str = ""

    def visibility(self, visibility: Visibility, shared: V41Shared):
        """**Returns:** what the layer's queries may pick: ``visibility``, within the published
        candidates for ``"within"`` (a ``CandidateVisibility``)."""
        if self.role != "within":
            return visibility
        if shared.candidates is None:
            raise V41WiringError(f"{self.who} uses candidates but none were published")
        return CandidateVisibility.within(visibility, shared.candidates, self.block_size)

    def select(self, execution, problem, k: int) -> tuple[Array, dict]:
        """**Returns:** the top-k of ``problem`` by ``execution`` and the fields published
        besides it (the candidate source's blocks)."""
        if self.role != "source":
            return execution.select(problem, k), {}
        nb, bc = self.topk_blocks, self.block_size
        selection, candidates = execution.select_candidates(problem, k, nb, bc)
        return selection, {"candidates": candidates}


class AbstractSelectionSource(eqx.Module):
    """Where a layer's selection comes from. ``selects``: whether the layer reads through one
    (``aux["selection"]`` is an array)."""

    selects: ClassVar[bool] = True

    @abc.abstractmethod
    def select(
        self,
        layer,
        x: Array,
        qr: Array,
        positions: Int[Array, "batch rows"],
        compressed: Compressed,
        visibility: Visibility,
        shared: V41Shared,
    ) -> tuple:
        """**Arguments:** the ``layer``, its input ``x``, query latent ``qr`` and RoPE
        ``positions`` (``[B', L, ...]``), its ``Compressed`` entries, their ``visibility`` and the
        state published so far.

        **Returns:** ``(selection or None, problem or None, published)``: the selection the
        attention reads through (``None``: every visible entry), the indexer's
        ``SelectionProblem`` (``None`` without an indexer) and the fields this publishes.
        """


class AllEntries(AbstractSelectionSource):
    """No selection: the attention reads every visible entry (HCA)."""

    selects: ClassVar[bool] = False

    def select(self, layer, x, qr, positions, compressed, visibility, shared):
        return None, None, {}


class OwnSelection(AbstractSelectionSource):
    """The layer's own indexer over the entries' index keys (``layer.indexer_problem``, the
    execution's selection strategy).

    **Arguments:**

    - ``publishes``: publish the top-k (a V4.1 index source).
    - ``candidates``: its part in V4.1's pre-filter (``CandidateRule``; default none).
    """

    publishes: bool = False
    candidates: CandidateRule = CandidateRule()

    def select(self, layer, x, qr, positions, compressed, visibility, shared):
        # DeepSeek's stale-key emulation (extend_v41_stack) may hand other keys to score
        keys = compressed.keys if shared.stale_keys is None else shared.stale_keys
        seen = self.candidates.visibility(visibility, shared)
        problem = layer.indexer_problem(x, qr, positions, keys, seen)
        k = layer.config.index_topk
        selection, fields = self.candidates.select(layer.execution, problem, k)
        if self.publishes:
            fields = dict(fields, selection=selection, stale_keys=None)
        return selection, problem, fields


class PublishedSelection(AbstractSelectionSource):
    """The selection an earlier index source published (V4.1's reuse layers).

    **Arguments:** ``who``: the layer, for the error when nothing was published.
    """

    who: str

    def select(self, layer, x, qr, positions, compressed, visibility, shared):
        if shared.selection is None:
            raise V41WiringError(f"{self.who} got no published selection")
        return shared.selection, None, {}
