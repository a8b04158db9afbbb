"""``GatheredIndexerLoss``: the indexer KL loss over each query's own entries, gathered.

Per query block, the entries a query's loss runs over are gathered by index: the sparse
stage's selection, or for the warm-up the visibility's own slots (``visibility.slots()``: a
V4.1 consumer's visible candidate entries); their indexer keys and main-attention entries
are scored and weighed there only, in a ``lax.scan`` with a rematerialised body. Nothing
``[B, S, T]``-sized is formed (``csa_eqx._loss.kl.gathered_kl``, which
``StreamingIndexerLoss``'s sparse stage is too).
"""

from __future__ import annotations

from .base import AbstractIndexerLoss
from .kl import gathered_kl

__all__ = ["GatheredIndexerLoss"]


class GatheredIndexerLoss(AbstractIndexerLoss):
    """The indexer KL loss over each query block's gathered entries (module docstring): the
    sparse stage over the selection, the warm-up over ``visibility.slots()``.
    ``csa_eqx.AutoIndexerLoss`` chooses it where a V4.1 consumer's filter drops entries.

    **Arguments:**

    - ``query_block``: queries per block (0 = automatic, ``csa_eqx._tiles.sparse_query_block``).
    """

    query_block: int = 0

    def __check_init__(self):
        value = self.query_block
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"GatheredIndexerLoss.query_block must be an int >= 0 (got {value!r})")

    def loss(self, problem, target, selection=None):
        sizes = self.sizes(problem, target)
        return gathered_kl(problem, target, selection, sizes, self.query_block)
