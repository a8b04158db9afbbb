"""``projected_indexer_kl_loss``: the indexer KL loss of a selection problem, by a loss
strategy (automatic by default)."""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from .._selection.base import SelectionProblem
from .auto import AutoIndexerLoss
from .base import AbstractIndexerLoss, AttentionTarget

__all__ = ["projected_indexer_kl_loss"]


_AUTO = AutoIndexerLoss()


def projected_indexer_kl_loss(
    problem: SelectionProblem,
    target: AttentionTarget,
    selection: Int[Array, "batch seq k"] | None = None,
    *,
    method: AbstractIndexerLoss = _AUTO,
) -> Float[Array, ""]:
    """``indexer_kl_loss`` with the indexer scores of a selection problem, streaming when the
    dense ``[B, S, T]`` tensors would be large (``method``'s choice).

    **Arguments:**

    - ``problem``: the indexer side, exactly what the selection got (``SelectionProblem``):
        ``project`` runs one query block at a time; gradient reaches the arrays it closes
        over and ``problem.keys``; ``problem.rows`` are treated as constants.
        ``problem.head_chunk`` also chunks the attention heads of the target; its
        ``scorer`` scores and its ``tiles`` size the automatic tiles.
    - ``target``: the main attention (detached), as in ``indexer_kl_loss``.
    - ``selection``: ``None`` for the dense warm-up (candidates = every entry
        ``problem.visibility`` lets a query pick), else the sparse stage's top-k ``[B, S, k]``
        (``-1`` = none).
    - ``method``: the loss strategy (``AutoIndexerLoss()``, ``DenseIndexerLoss()``,
        ``StreamingIndexerLoss(key_block, query_block)``); the layers use
        ``Execution.indexer_kl``.

    **Returns:**

    A float32 scalar; 0 when no query has a candidate.
    """
    return method.loss(problem, target, selection)
