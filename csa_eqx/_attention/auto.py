"""The attention family's automatic choices: ``AutoPicks`` (a masked matmul or a gather for the
attention over each query's picked entries; docs/memory.md, "Masked picks") and
``AutoAttention`` (the Pallas attention kernel on a GPU, XLA's elsewhere; docs/kernels.md), and
the query blocks the kernels size their work by (``attention_query_block``,
``expanded_query_block``; ``Execution(query_block=...)`` forces one).
"""

from __future__ import annotations

from .._backend import uses_kernels
from .._tiles import power_of_two_block
from .base import AbstractAttentionKernel
from .pallas import PallasAttention
from .picks import AbstractPicks, GatheredPicks, MaskedPicks
from .reads import Reads
from .xla import XlaAttention

__all__ = ["AutoAttention", "AutoPicks", "attention_query_block", "expanded_query_block"]


class AutoPicks(AbstractPicks):
    """A masked matmul over all entries while there are at most ``ratio`` entries per pick
    (``T <= ratio * k``), else a gather of the picks: a matmul over ``T`` entries is far
    cheaper than gathering ``k`` rows per query, and its gradient needs no scatter-add.

    **Arguments:**

    - ``ratio``: entries per pick up to which the picks are attended by a masked matmul.
    """

    ratio: int = 4

    def choose(self, entries: int, picks: int) -> AbstractPicks:
        """**Arguments:** the entry count ``T`` and picks per query ``k``.

        **Returns:** ``MaskedPicks()`` when ``T <= ratio * k``, else ``GatheredPicks()``.
        """
        return MaskedPicks() if entries <= self.ratio * picks else GatheredPicks()

    def reads(self, keys, visibility, picks, values=None):
        return self.choose(keys.shape[1], picks.shape[-1]).reads(keys, visibility, picks, values)


class AutoAttention(AbstractAttentionKernel):
    """The attention kernel for the backend: ``PallasAttention()`` on a GPU (``uses_kernels``;
    it reads every kind of ``Reads``), ``XlaAttention()`` elsewhere and under numerics that
    round the attention (``exact_softmax`` false: ``DeepSeekInference``). The same outputs
    either way up to float32 rounding. **Arguments:** none."""

    def choose(self, numerics=None) -> AbstractAttentionKernel:
        """**Arguments:** the layer's numerics (``None``: exact).

        **Returns:** ``PallasAttention()`` on a GPU under exact-softmax numerics, else
        ``XlaAttention()``."""
        exact = numerics is None or numerics.exact_softmax
        return PallasAttention() if uses_kernels() and exact else XlaAttention()

    def attend(self, q, reads, sinks, scale, *, return_lse=False, query_block, numerics=None):
        kernel = self.choose(numerics)
        kw = dict(return_lse=return_lse, query_block=query_block, numerics=numerics)
        return kernel.attend(q, reads, sinks, scale, **kw)


def attention_query_block(batch: int, heads: int, reads: Reads, elements: int = 1 << 24) -> int:
    """The attention kernel's automatic query block for ``reads``: as ``sparse_query_block``
    for the gathered rows (summed over the read sets) and the dense entries, and with a band
    at most the power of two above ``window - 1`` (each block reads a slab of
    ``block + window - 1`` rows: keep the block near the window).

    **Arguments:** the queries' ``batch`` and ``heads``, the ``csa_eqx.Reads`` they attend and the
    block's budget of ``elements`` (``TileSizes.attention_elements``).

    **Returns:** the query block, a power of two >= 1.
    """
    per_row = 0
    for g in reads.gathered:  # gathered keys (+ values) and logits per pick
        width = g.keys.shape[-1] + (0 if g.values is None else g.values.shape[-1])
        per_row += g.indices.shape[-1] * (width + heads)
    if reads.dense is not None:  # logits and mask per entry
        per_row += reads.dense.keys.shape[1] * (heads + 1)
    block = power_of_two_block(batch, per_row, elements)
    if reads.band is not None:
        block = min(block, 1 << max(reads.band.window - 1, 1).bit_length())
    return block


def expanded_query_block(batch: int, heads: int, entries: int, elements: int = 1 << 24) -> int:
    """The query block of an attention whose keys and values are expanded per head (V3.2 under
    ``DeepSeekInference``: ``[B, block, H, T]`` scores and masks per block).

    **Arguments:** the queries' ``batch`` and ``heads``, the ``entries`` each query may read and
    the block's budget of ``elements`` (``TileSizes.attention_elements``).

    **Returns:** the query block, a power of two >= 1.
    """
    return power_of_two_block(batch, entries * (heads + 1), elements)
