"""The automatic execution choices: every size heuristic of the library lives here.

``AutoSelection`` picks the dense or the streaming top-k from the sizes of a selection
problem; ``AutoPicks`` picks a masked matmul or a gather for the attention over each query's
picked entries (docs/memory.md, "Streaming top-k" and "Masked picks"). Force a path by
passing a concrete strategy instead (``DenseSelection()``, ``StreamingSelection(...)``,
``MaskedPicks()``, ``GatheredPicks()``).
"""

from __future__ import annotations

from jaxtyping import Array, Int

from .selection import AbstractSelection, DenseSelection, SelectionProblem
from .sparse import AbstractPicks, GatheredPicks, MaskedPicks
from .streaming import StreamingSelection, tile_elements

__all__ = ["AutoSelection", "AutoPicks"]


class AutoSelection(AbstractSelection):
    """Dense while the largest score tensor ``[B, S, heads at once, T]`` fits one automatic
    tile (``csa_eqx.streaming.tile_elements``: 2^24 elements on CPU, 2^26 on accelerators),
    streaming beyond.

    Arguments:
        query_block: queries per block when it streams (0 = automatic).
    """

    query_block: int = 0

    def tiling(self, batch: int, seq: int, entries: int, heads: int) -> AbstractSelection:
        if batch * seq * entries * max(heads, 1) > tile_elements():
            return StreamingSelection(query_block=self.query_block)
        return DenseSelection()

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        return self.tiling(*problem.sizes()).select(problem, k)


class AutoPicks(AbstractPicks):
    """A masked matmul over all entries while there are at most ``ratio`` entries per pick
    (``T <= ratio * k``), else a gather of the picks: a matmul over ``T`` entries is far
    cheaper than gathering ``k`` rows per query, and its gradient needs no scatter-add.

    Arguments:
        ratio: entries per pick up to which the picks are attended by a masked matmul.
    """

    ratio: int = 4

    def choose(self, entries: int, picks: int) -> AbstractPicks:
        """Arguments: the entry count ``T`` and picks per query ``k``.

        Returns: ``MaskedPicks()`` when ``T <= ratio * k``, else ``GatheredPicks()``.
        """
        return MaskedPicks() if entries <= self.ratio * picks else GatheredPicks()

    def parts(self, keys, visibility, picks, values=None):
        return self.choose(keys.shape[1], picks.shape[-1]).parts(keys, visibility, picks, values)
