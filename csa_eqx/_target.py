"""``AttentionTarget``: the main attention an indexer learns from (docs/concepts.md, "Training
the indexer"), what a layer hands its indexer loss.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Array, Float

__all__ = [
    "AttentionTarget",
]


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
