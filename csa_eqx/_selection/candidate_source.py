"""V4.1's candidate source (docs/v41.md, "Candidates"): the index source whose queries'
scores also pick the candidate blocks the later index sources choose within. A capability of
its own (``AbstractCandidateSource.select_candidates``: the top-k and the best blocks from one
scoring of the problem), given by the selection strategies able to produce it: the dense, the
streaming and the gathered ones, and a split selection over its parts. The selection's chooser
routes an execution's selection to its candidate source
(``csa_eqx._selection.auto.candidate_source``).
"""

from __future__ import annotations

import abc

import equinox as eqx
from jaxtyping import Array, Int

from .._topk import select_topk
from .base import AbstractSplitSelection, SelectionProblem
from .candidates import candidate_blocks
from .gathered import gathered_topk
from .streaming import stream_topk

__all__ = [
    "AbstractCandidateSource",
    "DenseCandidates",
    "StreamingCandidates",
    "GatheredCandidates",
    "SplitCandidates",
]


class AbstractCandidateSource(eqx.Module):
    """A selection that also gives V4.1's candidate blocks (``candidate_blocks``' rule,
    bitwise) from the same scores as its top-k."""

    @abc.abstractmethod
    def select_candidates(
        self, problem: SelectionProblem, k: int, topk_blocks: int, block_size: int
    ) -> tuple[Int[Array, "batch seq {k}"], Int[Array, "batch seq {topk_blocks}"]]:
        """**Arguments:** the ``problem``, ``k > 0``, ``Nb`` and ``bc``.

        **Returns:** ``(selection [B, S, k], blocks [B, S, Nb])``, int32, ``-1`` = none.
        """


class DenseCandidates(AbstractCandidateSource):
    """``DenseSelection``'s: one ``[B, S, T]`` score matrix, its top-k and its best blocks.
    **Arguments:** none."""

    def select_candidates(self, problem, k, topk_blocks, block_size):
        scores = problem.scores(*problem.queries(), problem.keys)
        visible, topk = problem.visibility.mask(), problem.tiles.topk()
        selection = select_topk(scores, visible, k, **topk)
        return selection, candidate_blocks(scores, visible, topk_blocks, block_size, **topk)


class StreamingCandidates(AbstractCandidateSource):
    """``StreamingSelection``'s: the best blocks of each row buffer, merged as the entries are
    (``stream_topk``). **Arguments:** its ``key_block``, ``query_block`` and ``topk_block``."""

    key_block: int = 0
    query_block: int = 0
    topk_block: int = 0

    def select_candidates(self, problem, k, topk_blocks, block_size):
        sizes = (self.key_block, self.query_block, self.topk_block)
        return stream_topk(problem, k, *sizes, (topk_blocks, block_size))


class GatheredCandidates(AbstractCandidateSource):
    """``GatheredSelection``'s: the best blocks of each query's gathered scores
    (``gathered_topk``). **Arguments:** its ``query_block``."""

    query_block: int = 0

    def select_candidates(self, problem, k, topk_blocks, block_size):
        return gathered_topk(problem, k, self.query_block, (topk_blocks, block_size))


class SplitCandidates(AbstractCandidateSource):
    """A split selection's (``ShardedSelection``): ``inner`` on each part of the rows, joined
    by ``selection.split``. **Arguments:** the split ``selection`` and the ``inner`` candidate
    source its parts run."""

    selection: AbstractSplitSelection
    inner: AbstractCandidateSource

    def select_candidates(self, problem, k, topk_blocks, block_size):
        def run(part):
            return self.inner.select_candidates(part, k, topk_blocks, block_size)

        return self.selection.split(problem, run)
