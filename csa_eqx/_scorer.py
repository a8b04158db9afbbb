"""The indexer-scoring kernel seam: ``AbstractScorer`` computes the lightning indexer's scores
``I[t, s] = d^-1/2 Σ_h w[t, h] ReLU(q[t, h] · k[s])`` (docs/concepts.md, "The lightning
indexer"). Every selection strategy and the indexer loss score through the
``SelectionProblem``'s scorer (``Execution.scorer``), so a new kernel (a Pallas kernel, a
quantised scorer) is one new subclass; ``XlaScorer`` is the reference.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
from jaxtyping import Array, Float

__all__ = ["AbstractScorer"]


class AbstractScorer(eqx.Module):
    """How the indexer's scores are computed. Every scorer gives the scores of
    ``csa_eqx.indexer_scores`` (float32, ``head_chunk`` and ``score_dtype`` as there; up to
    float32 rounding of the contraction order), so selections are bitwise equal across
    scorers wherever their scores are (ties to the lower index); it must be differentiable in
    ``q``, ``weights`` and ``keys`` (the indexer loss trains through it).
    """

    @abc.abstractmethod
    def scores(
        self,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch entries dim"],
        *,
        head_chunk: int = 0,
        score_dtype: str | None = None,
    ) -> Float[Array, "batch seq entries"]:
        """Scores of every query against every key, no masking.

        Arguments:
            q: indexer queries ``[B, S, H, d]``.
            weights: head weights ``[B, S, H]`` including ``H^-1/2`` (``d^-1/2`` is applied
                here).
            keys: ``[B, T, d]``, shared by all heads.
            head_chunk: heads scored at once (0 = all); must divide ``H``.
            score_dtype: ``None`` (float32) or the dtype the scores are rounded to, as
                ``csa_eqx.indexer_scores`` rounds them.

        Returns:
            float32 ``[B, S, T]``.
        """

    def gathered_scores(
        self,
        q: Float[Array, "batch seq heads dim"],
        weights: Float[Array, "batch seq heads"],
        keys: Float[Array, "batch seq picks dim"],
        *,
        head_chunk: int = 0,
    ) -> Float[Array, "batch seq picks"]:
        """Scores of each query against its own keys (the sparse stage of the indexer loss,
        float32). By default ``scores`` mapped over the queries; a kernel may override it.

        Arguments:
            q, weights: as for ``scores``.
            keys: ``[B, S, k, d]``, each query's gathered keys.
            head_chunk: as for ``scores``.

        Returns:
            float32 ``[B, S, k]``.
        """

        def one(q, w, k):  # a single query row: [1, 1, H, d], [1, 1, H], [1, k, d]
            return self.scores(q[None, None], w[None, None], k[None], head_chunk=head_chunk)[0, 0]

        return jax.vmap(jax.vmap(one))(q, weights, keys)
