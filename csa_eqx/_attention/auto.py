"""The attention family's automatic choices: ``AutoPicks`` (a masked matmul or a gather for the
attention over each query's picked entries; docs/memory.md, "Masked picks") and
``AutoAttention`` (the Mosaic attention kernel on a TPU, XLA's elsewhere, a GPU included,
DeepSeek's expanded MLA under its numerics; docs/kernels.md). Each kernel sizes its own query
blocks (``AbstractAttentionKernel.query_block_for``; ``Execution(query_block=...)`` forces one).
"""

from __future__ import annotations

from .._backend import kernel_dtypes, kernel_platform
from .base import AbstractAttentionKernel, LatentUp
from .expanded import ExpandedAttention
from .mosaic import MosaicAttention
from .picks import AbstractPicks, GatheredPicks, MaskedPicks
from .xla import XlaAttention

__all__ = ["AutoAttention", "AutoPicks"]


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

    def reads(self, keys, visibility, picks, values=None, value_width=None):
        strategy = self.choose(keys.shape[1], picks.shape[-1])
        return strategy.reads(keys, visibility, picks, values, value_width)


class AutoAttention(AbstractAttentionKernel):
    """The attention kernel for the backend (``kernel_platform``): ``MosaicAttention()`` on a
    TPU (it reads every kind of ``Reads`` and chooses its gather, blocks and VMEM use per
    call), ``XlaAttention()`` elsewhere (a GPU included: ``TritonAttention()`` runs there when
    forced by name, not yet measured on one) and under
    numerics that round the attention (``exact_softmax`` false: ``DeepSeekInference``); for
    MLA (``latent``) under numerics that follow DeepSeek's expanded prefill
    (``LatentUp.expanded``), ``ExpandedAttention()``. The same outputs up to rounding (up to
    the numerics' own for the expanded one). **Arguments:** none."""

    def choose(
        self,
        numerics=None,
        up: LatentUp | None = None,
        backend: str | None = None,
        dtype=None,
    ) -> AbstractAttentionKernel:
        """**Arguments:** the layer's numerics (``None``: exact), for MLA its up-projection, the
        ``backend`` to choose for (``None``: the one it is traced for) and the queries'
        ``dtype`` (``None``: 32 bits or fewer).

        **Returns:** ``ExpandedAttention()`` for an expanded MLA, else under exact-softmax
        numerics and for 32-bit queries (``kernel_dtypes``) ``MosaicAttention()`` on a TPU,
        else ``XlaAttention()``."""
        if up is not None and up.expanded:
            return ExpandedAttention()
        if numerics is not None and not numerics.exact_softmax:
            return XlaAttention()
        if dtype is not None and not kernel_dtypes(dtype):
            return XlaAttention()
        return MosaicAttention() if kernel_platform(backend) == "tpu" else XlaAttention()

    def __call__(self, q, reads, sinks, scale, *, return_lse=False, numerics=None, **blocks):
        kernel = self.choose(numerics, dtype=q.dtype)
        return kernel(q, reads, sinks, scale, return_lse=return_lse, numerics=numerics, **blocks)

    def attend(self, q, reads, sinks, scale, *, return_lse=False, query_block, numerics=None):
        kw = dict(return_lse=return_lse, query_block=query_block, numerics=numerics)
        return self.choose(numerics, dtype=q.dtype).attend(q, reads, sinks, scale, **kw)

    def latent(self, q_nope, q_rope, reads, up, scale, *, numerics=None, **kw):
        kernel = self.choose(numerics, up, dtype=q_nope.dtype)
        return kernel.latent(q_nope, q_rope, reads, up, scale, numerics=numerics, **kw)


def resolved(
    attention: AbstractAttentionKernel, numerics=None, up=None, dtype=None
) -> AbstractAttentionKernel:
    """**Returns:** the kernel ``attention`` runs: ``AutoAttention``'s choice for ``numerics``,
    the MLA ``up`` and the queries' ``dtype``, any other kernel itself."""
    if isinstance(attention, AutoAttention):
        return attention.choose(numerics, up, dtype=dtype)
    return attention
