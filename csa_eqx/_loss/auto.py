"""The indexer loss family's automatic choice, ``AutoIndexerLoss``: the selection's rules
(``csa_eqx._selection.auto``) for the dense, the streaming or the gathered KL loss."""

from __future__ import annotations

from .._selection.auto import DenseOrStreaming, filter_bites, unfiltered
from .base import AbstractIndexerLoss
from .dense import DenseIndexerLoss
from .gathered import GatheredIndexerLoss
from .streaming import StreamingIndexerLoss

__all__ = ["AutoIndexerLoss"]


class AutoIndexerLoss(DenseOrStreaming, AbstractIndexerLoss):
    """The dense KL loss while its largest tensor ``[B, S, heads at once, T]`` fits one tile,
    beyond it streaming, or gathered where a V4.1 consumer's pre-filter bites: the rules of
    ``AutoSelection`` (``streams``, ``filter_bites``), with the heads at once counting the
    attention's heads too (``AbstractIndexerLoss.sizes``): ``DenseIndexerLoss``,
    ``StreamingIndexerLoss`` or ``GatheredIndexerLoss``. **Arguments:** as for
    ``AutoSelection``.
    """

    dense = DenseIndexerLoss
    streaming = StreamingIndexerLoss
    gathered = GatheredIndexerLoss

    def loss(self, problem, target, selection=None):
        problem = unfiltered(problem)
        filtered = filter_bites(problem.visibility, problem.keys.shape[1])
        method = self.choose(*self.sizes(problem, target), problem.tiles, filtered)
        return method.loss(problem, target, selection)
