"""The indexer loss family's base (docs/concepts.md, "Training the indexer"): the main attention
an indexer learns from (``AttentionTarget``, what a layer hands its indexer loss) and
``AbstractIndexerLoss``, "how far is the indexer from the main attention?" over the
selection's ``SelectionProblem``. The strategies live one per module of this folder
(``dense.py``, ``streaming.py``, ``gathered.py``); ``auto.py`` chooses.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import equinox as eqx
from jaxtyping import Array, Float, Int

from .._selection.base import SelectionProblem

__all__ = ["AttentionTarget", "AbstractIndexerLoss"]


class AttentionTarget(NamedTuple):
    """The main attention the indexer learns from (all detached by the loss).

    **Arguments:**

    - ``q``: the attention's queries ``[B, S, H, d]``.
    - ``keys``: its keys of the candidates ``[B, T, d]`` (V4: the compressed entries; V3.2: the
        absorbed MLA keys of the tokens).
    - ``log_normalizer``: each head's float32 log softmax denominator ``[B, S, H]`` over its whole
        key set, sink included (``sparse_attention(..., return_lse=True)``).
    - ``scale``: its softmax scale.
    """

    q: Float[Array, "batch seq heads dim"]
    keys: Float[Array, "batch cands dim"]
    log_normalizer: Float[Array, "batch seq heads"]
    scale: float


class AbstractIndexerLoss(eqx.Module):
    """How the indexer's KL loss of a ``SelectionProblem`` is computed (``indexer_kl_loss``
    with the problem's scores): every strategy gives the same loss and gradients up to
    rounding. Gradient reaches the arrays ``problem.project`` closes over and
    ``problem.keys``; ``problem.rows`` and the target are constants. Scores come from
    ``problem.scorer`` in float32 (the loss does not round them to ``problem.score_dtype``).
    """

    @abc.abstractmethod
    def loss(
        self,
        problem: SelectionProblem,
        target: AttentionTarget,
        selection: Int[Array, "batch seq k"] | None = None,
    ) -> Float[Array, ""]:
        """**Arguments:**

        - ``problem``: the indexer side, exactly what the selection got; ``problem.head_chunk``
            also chunks the attention heads of the target.
        - ``target``: the main attention (detached), as in ``indexer_kl_loss``.
        - ``selection``: ``None`` for the dense warm-up (candidates = every entry
            ``problem.visibility`` lets a query pick: what a selection of the problem picks
            from), else the sparse stage's top-k ``[B, S, k]`` (``-1`` = none).

        **Returns:**

        A float32 scalar; 0 when no query has a candidate.
        """

    @staticmethod
    def sizes(problem: SelectionProblem, target: AttentionTarget) -> tuple[int, int, int, int]:
        """**Arguments:** the ``problem`` and the ``target``.

        **Returns:** ``(batch, seq, entries, heads at once)``, the heads at once being the head
        chunk or the larger of the indexer's and the attention's head counts (no computation).
        """
        b, s, t, h_i = problem.sizes()
        return b, s, t, problem.head_chunk or max(h_i, target.q.shape[2])
