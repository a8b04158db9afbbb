"""``DenseSelection``: score every query against every entry at once, then one exact top-k."""

from __future__ import annotations

from jaxtyping import Array, Int

from .._topk import select_topk
from .base import AbstractSelection, SelectionProblem

__all__ = [
    "DenseSelection",
]


class DenseSelection(AbstractSelection):
    """Score every query against every entry (``[B, S, T]`` float32), then one exact top-k over
    the visible ones (``visibility.mask()``). Fastest while that tensor is small; see
    ``csa_eqx.AutoSelection``.

    **Arguments:** none. ``select`` returns int32 ``[B, S, k]``, ``-1`` = none.
    """

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        scores = problem.scores(*problem.queries(), problem.keys)
        return select_topk(scores, problem.visibility.mask(), k, **problem.tiles.topk())
