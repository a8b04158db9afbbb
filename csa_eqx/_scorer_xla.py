"""``XlaScorer``: the reference indexer scorer (``csa_eqx.indexer_scores``, plain XLA)."""

from __future__ import annotations

from ._scorer import AbstractScorer
from .indexer import indexer_scores

__all__ = ["XlaScorer"]


class XlaScorer(AbstractScorer):
    """The reference scorer: ``csa_eqx.indexer_scores`` over all keys at once (per-head
    logits ``[B, S, heads at once, T]``, then the weighted head sum).

    Arguments: none.
    """

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        return indexer_scores(q, weights, keys, head_chunk=head_chunk, score_dtype=score_dtype)
