"""``DenseIndexerLoss``: the indexer KL loss over the whole ``[B, S, T]`` scores."""

from __future__ import annotations

import jax

from .base import AbstractIndexerLoss
from .kl import indexer_kl_loss, selection_mask

__all__ = ["DenseIndexerLoss"]


class DenseIndexerLoss(AbstractIndexerLoss):
    """Score every query against every entry (the problem's scorer, float32 ``[B, S, T]``),
    then ``indexer_kl_loss`` over the visible (warm-up: ``visibility.mask()``) or selected
    candidates. Fastest while those tensors are small;
    see ``csa_eqx.AutoIndexerLoss``.

    **Arguments:** none.
    """

    def loss(self, problem, target, selection=None):
        rows = jax.lax.stop_gradient(problem.rows)
        keys, head_chunk = problem.keys, problem.head_chunk
        if selection is None:
            candidates = problem.visibility.mask()
        else:
            candidates = selection_mask(selection, keys.shape[1])
        scores = problem.scorer.scores(*problem.project(*rows), keys, head_chunk=head_chunk)
        return indexer_kl_loss(*target[:3], scores, candidates, target.scale, head_chunk=head_chunk)
