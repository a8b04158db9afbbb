"""The selection family's automatic choice (``AutoSelection``) and the rules it shares with the
indexer loss's (``csa_eqx._loss.auto``): one size rule (``streams``) and one rule for V4.1's
pre-filter (``filter_bites``). The fused indexer of the platform's kernels
(``csa_eqx._backend.kernel_platform``: the Mosaic ``MosaicSelection`` on a TPU); elsewhere,
a GPU included, the dense, the streaming or the gathered top-k (docs/memory.md, "Streaming
top-k").
Force a path by passing a concrete strategy instead (``DenseSelection()``,
``StreamingSelection(...)``, ``GatheredSelection()``, ``TritonSelection(...)``,
``MosaicSelection(...)``) and tile sizes by ``Execution(tiles=TileSizes(...))``.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Int

from .._backend import CPU_TILES, kernel_platform
from .._tiles import TileSizes
from .base import AbstractSelection, AbstractSplitSelection, SelectionProblem
from .candidate_source import (
    AbstractCandidateSource,
    DenseCandidates,
    GatheredCandidates,
    SplitCandidates,
    StreamingCandidates,
)
from .candidates import CandidateVisibility
from .dense import DenseSelection
from .gathered import GatheredSelection
from .mosaic import MosaicSelection
from .streaming import StreamingSelection
from .triton import TritonSelection

__all__ = [
    "AutoSelection",
    "candidate_source",
    "streams",
    "filter_bites",
    "unfiltered",
    "DenseOrStreaming",
]


def streams(batch: int, seq: int, entries: int, heads: int, tiles: TileSizes) -> bool:
    """The one size rule of the automatic selection and indexer loss.

    **Arguments:** the problem's ``batch``, ``seq``, ``entries``, ``heads`` at once and the
    backend's ``tiles``.

    **Returns:** whether the largest dense score tensor ``[B, S, heads, T]`` passes one tile
    (``tiles.elements``), so the computation should stream.
    """
    return batch * seq * entries * max(heads, 1) > tiles.elements


def filter_bites(visibility, entries: int) -> bool:
    """The one rule for V4.1's pre-filter (docs/v41.md, "Candidates").

    **Arguments:** a problem's ``visibility`` and its number of ``entries`` ``T``.

    **Returns:** whether it is a ``CandidateVisibility`` whose filter can drop a visible entry:
    with ``Nb`` at least the ``ceil(T / bc)`` blocks there are, the filter keeps every block
    holding a visible entry, and the plain visibility picks the same.
    """
    if not isinstance(visibility, CandidateVisibility):
        return False
    return -(-entries // visibility.block_size) > visibility.candidates.shape[-1]


def unfiltered(problem: SelectionProblem) -> SelectionProblem:
    """``problem`` with a pre-filter that cannot bite dropped (same answers, cheaper paths)."""
    visibility = problem.visibility
    if isinstance(visibility, CandidateVisibility) and not filter_bites(
        visibility, problem.keys.shape[1]
    ):
        return problem._replace(visibility=visibility.base)
    return problem


class DenseOrStreaming(eqx.Module):
    """What ``AutoSelection`` and ``AutoIndexerLoss`` share: the strategy ``dense()`` while
    ``streams`` says the problem fits one tile, else ``gathered(query_block=query_block)``
    where V4.1's pre-filter bites (``filter_bites``: each query's candidates are far fewer
    than the entries) and ``streaming(query_block=query_block)`` otherwise.

    **Arguments:**

    - ``query_block``: queries per block when it streams (0 = automatic).
    """

    query_block: int = 0
    dense: ClassVar[type]
    streaming: ClassVar[type]
    gathered: ClassVar[type]

    def choose(
        self,
        batch: int,
        seq: int,
        entries: int,
        heads: int,
        tiles: TileSizes = CPU_TILES,
        filtered: bool = False,
    ):
        """**Arguments:** the sizes (``SelectionProblem.sizes``; for the loss
        ``AbstractIndexerLoss.sizes``), the ``tiles`` and whether a pre-filter bites
        (``filtered``).

        **Returns:** ``dense()`` (``DenseSelection()`` / ``DenseIndexerLoss()``) unless
        ``streams``; else ``gathered(query_block=query_block)`` when ``filtered``
        (``GatheredSelection`` / ``GatheredIndexerLoss``), ``streaming(query_block=...)``
        (``StreamingSelection`` / ``StreamingIndexerLoss``) otherwise.
        """
        if not streams(batch, seq, entries, heads, tiles):
            return self.dense()
        return (self.gathered if filtered else self.streaming)(query_block=self.query_block)


class AutoSelection(DenseOrStreaming, AbstractSelection):
    """The fused indexer of the platform's kernels (``kernel_platform``: ``MosaicSelection()``
    on a TPU where the problem's keys fit its VMEM) for a problem whose visibility has no
    biting V4.1 pre-filter (a GPU has none yet: ``TritonSelection()`` runs there when forced by
    name, not yet measured on one). Otherwise dense while the largest score tensor
    ``[B, S, heads at once, T]`` fits one automatic tile (``SelectionProblem.tiles.elements``:
    2^24 elements on CPU, 2^26 on accelerators), beyond it streaming (``streams``), or gathered
    where a V4.1 consumer's pre-filter bites (``filter_bites``): ``DenseSelection``,
    ``StreamingSelection`` or ``GatheredSelection``. A pre-filter that cannot bite is dropped
    first (the same picks). Every choice selects the same entries (bitwise where the scores
    are).

    **Arguments:**

    - ``query_block``: queries per block when it streams (0 = automatic).
    """

    dense = DenseSelection
    streaming = StreamingSelection
    gathered = GatheredSelection

    def strategy(self, problem: SelectionProblem, backend: str | None = None) -> AbstractSelection:
        """**Arguments:** the ``problem`` and the ``backend`` to choose for (``None``: the one
        it is traced for; ``Execution.describe`` names another).

        **Returns:** unless a V4.1 pre-filter bites, ``MosaicSelection()`` on a TPU (where
        ``MosaicSelection.fits``); else ``choose`` of its
        sizes, tiles and pre-filter (of the problem with a pre-filter that cannot bite
        dropped).
        """
        problem = unfiltered(problem)
        filtered = filter_bites(problem.visibility, problem.keys.shape[1])
        if not filtered and kernel_platform(backend) == "tpu" and MosaicSelection().fits(problem):
            return MosaicSelection()
        return self.choose(*problem.sizes(), problem.tiles, filtered)

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        return self.strategy(problem).select(unfiltered(problem), k)


def candidate_source(selection: AbstractSelection, problem: SelectionProblem):
    """Where a V4.1 candidate source's top-k and candidate blocks come from, for an execution's
    ``selection`` strategy (docs/v41.md, "Candidates"): a strategy that is a candidate source
    itself; else the same strategy's (``DenseSelection``, ``StreamingSelection`` and
    ``GatheredSelection`` with their sizes), ``AutoSelection``'s choice for ``problem``, a
    split selection's (``ShardedSelection``) over its parts, each running its inner
    strategy's; the fused kernels' (``TritonSelection``, ``MosaicSelection``) blocks are not
    fused yet: streamed.

    **Arguments:** the ``selection`` strategy and the candidate source's ``problem``.

    **Returns:** an ``AbstractCandidateSource``; a ``TypeError`` for a strategy that gives none.
    """
    if isinstance(selection, AbstractCandidateSource):
        return selection
    if isinstance(selection, AutoSelection):
        selection = selection.strategy(problem)
    if isinstance(selection, AbstractSplitSelection):
        return SplitCandidates(selection, candidate_source(selection.inner, problem))
    if isinstance(selection, DenseSelection):
        return DenseCandidates()
    if isinstance(selection, StreamingSelection):
        sizes = (selection.key_block, selection.query_block, selection.topk_block)
        return StreamingCandidates(*sizes)
    if isinstance(selection, GatheredSelection):
        return GatheredCandidates(selection.query_block)
    if isinstance(selection, TritonSelection | MosaicSelection):
        return StreamingCandidates(query_block=selection.query_chunk)
    raise TypeError(
        f"{type(selection).__name__} cannot give a V4.1 candidate source its candidate blocks: "
        "use a DenseSelection, StreamingSelection, GatheredSelection (or AutoSelection), or "
        "make the strategy an AbstractCandidateSource too"
    )
