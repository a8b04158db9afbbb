"""The automatic execution choices: every size heuristic of the library lives here.

``AutoSelection`` picks the dense or the streaming top-k from the sizes of a selection
problem; ``AutoPicks`` picks a masked matmul or a gather for the attention over each query's
picked entries (docs/memory.md, "Streaming top-k" and "Masked picks"); ``attention_query_block``
sizes the attention kernel's query blocks. Force a path by passing a concrete strategy instead
(``DenseSelection()``, ``StreamingSelection(...)``, ``MaskedPicks()``, ``GatheredPicks()``,
``Execution(query_block=...)``).
"""

from __future__ import annotations

from jaxtyping import Array, Int

from ._picks import AbstractPicks, GatheredPicks, MaskedPicks
from ._reads import Reads
from .selection import AbstractSelection, DenseSelection, SelectionProblem
from .streaming import StreamingSelection, tile_elements

__all__ = ["AutoSelection", "AutoPicks", "attention_query_block", "sparse_query_block"]


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

    def reads(self, keys, visibility, picks, values=None):
        return self.choose(keys.shape[1], picks.shape[-1]).reads(keys, visibility, picks, values)


_BLOCK_ELEMENTS = 1 << 24


def sparse_query_block(batch: int, heads: int, dim: int, k: int, entries: int = 0) -> int:
    """Automatic query block: keeps the gathered ``[B, Qb, k, dim]`` keys (and values) plus
    the ``[B, Qb, H, k]`` logits of one block, and the ``[B, Qb, H, entries]`` logits and mask
    of entries attended by matmul, near 64 MiB of float32.

    Arguments: the sizes (``dim``: gathered key plus value channels per pick; ``entries``:
    those attended by matmul, 0 = none).

    Returns: the query block, a power of two >= 1.
    """
    return _power_of_two_block(batch, k * (dim + heads) + entries * (heads + 1))


def attention_query_block(batch: int, heads: int, reads: Reads) -> int:
    """The attention kernel's automatic query block for ``reads``: as ``sparse_query_block``
    for the gathered rows (summed over the read sets) and the dense entries, and with a band
    at most the power of two above ``window - 1`` (each block reads a slab of
    ``block + window - 1`` rows: keep the block near the window).

    Arguments: the queries' ``batch`` and ``heads`` and the ``csa_eqx.Reads`` they attend.

    Returns: the query block, a power of two >= 1.
    """
    per_row = 0
    for g in reads.gathered:  # gathered keys (+ values) and logits per pick
        width = g.keys.shape[-1] + (0 if g.values is None else g.values.shape[-1])
        per_row += g.indices.shape[-1] * (width + heads)
    if reads.dense is not None:  # logits and mask per entry
        per_row += reads.dense.keys.shape[1] * (heads + 1)
    block = _power_of_two_block(batch, per_row)
    if reads.band is not None:
        block = min(block, 1 << max(reads.band.window - 1, 1).bit_length())
    return block


def _power_of_two_block(batch: int, per_row: int) -> int:
    """The largest power of two of query rows whose ``batch * per_row`` elements per row stay
    within ``_BLOCK_ELEMENTS`` (at least 1)."""
    rows = max(_BLOCK_ELEMENTS // max(batch * per_row, 1), 1)
    return 1 << (rows.bit_length() - 1)
