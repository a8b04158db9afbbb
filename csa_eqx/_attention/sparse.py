"""Gather-based sparse attention with an optional per-head sink (no dense ``[S, T]`` mask).

Each query attends to the keys named by its own index list (``-1`` = no key). The sink adds
``exp(s_h)`` to the softmax denominator only. A query with no valid key returns zeros.

Non-finite values stay where they belong: key / value rows holding a NaN or Inf are zeroed
before both matmuls (``0 x NaN`` would otherwise reach every query that shares the matmul, and
every query's gradient), and exactly the queries that see such a row, or whose own query is
non-finite, return NaN (output and ``lse``). Every other query gets what it would get if the
bad rows held finite values.

Keys that *every* query may see once visible (HCA's compressed entries, CSA's entries in the
dense warm-up) are better attended with a plain matmul than gathered per query: pass them as
``dense=DenseKeys(...)``; their visibility is computed per query block from the entry layout,
and they share one softmax with the gathered keys. CSA's *selected* entries can go the same
way (``DenseKeys(picks=...)``, masked to each query's picks) while the entry count is a small
multiple of ``k``: a masked matmul over ``T`` entries is far cheaper than gathering ``k`` rows
per query, and its gradient needs no scatter-add. ``MaskedPicks`` / ``GatheredPicks`` force one
way, ``csa_eqx.AutoPicks`` chooses.

``sparse_attention`` is the functional form: it describes its arguments as ``csa_eqx.Reads``
and runs the kernel the attention chooser picks for the backend (``csa_eqx.AutoAttention``:
``csa_eqx.XlaAttention``, the reference, on the CPU), as the layers run their
``Execution.attention``.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from .auto import AutoAttention
from .picks import AbstractPicks, GatheredPicks, MaskedPicks
from .reads import BandRows, DenseKeys, GatheredRows, Reads, gather_keys, picked_mask
from .window import AbstractWindow, BandWindow, GatheredWindow

__all__ = [
    "sparse_attention",
    "gather_keys",
    "DenseKeys",
    "AbstractPicks",
    "GatheredPicks",
    "MaskedPicks",
    "AbstractWindow",
    "BandWindow",
    "GatheredWindow",
    "picked_mask",
]


def sparse_attention(
    q: Float[Array, "batch seq heads dim"],
    kv: Float[Array, "batch keys dim"],
    indices: Int[Array, "batch seq k"],
    sinks: Float[Array, " heads"] | None,
    scale: float,
    values: Float[Array, "batch keys vdim"] | None = None,
    return_lse: bool = False,
    *,
    query_block: int = 0,
    dense: DenseKeys | None = None,
    window: int = 0,
    segment: Int[Array, "batch seq"] | None = None,
    window_history: Int[Array, "batch ring"] | None = None,
) -> (
    Float[Array, "batch seq heads vdim"]
    | tuple[Float[Array, "batch seq heads vdim"], Float[Array, "batch seq heads"]]
):
    """Softmax attention of each query over its selected keys (shared across heads).

    ``values`` defaults to ``kv`` (V4's key = value); pass it for MLA's separate values.
    ``return_lse=True`` also returns each head's float32 log-normaliser (log of the softmax
    denominator, sink included; ``-inf`` for a row with neither keys nor sink), which the
    indexer's KL target needs to rebuild the attention probabilities.

    Queries are processed ``query_block`` rows at a time (0 = the kernel's automatic block,
    ``AbstractAttentionKernel.query_block_for``) in a ``lax.map`` with a rematerialised body,
    so the gathered ``[B, S, k, dim]`` keys never exist at once, in the forward or the backward
    pass (``csa_eqx.XlaAttention``, which the chooser runs on the CPU).

    ``dense`` adds entries every query attends to (when visible) through a matmul, in the
    same softmax (their values: ``dense.values``, else the keys as in V4).

    ``window > 0`` adds a sliding window by a banded matmul instead of a gather: query ``t``
    also sees tokens ``t - window < j <= t`` in its own ``segment`` (ids ``[B, S]``); rows
    ``0..S-1`` of ``kv`` (and ``values``) must be the queries' own tokens. With
    ``window_history`` (segment ids ``[B, window - 1]`` of the tokens just before the
    queries, ``-1`` = none: ``extend``'s ring) those tokens are rows ``0..window-2`` of
    ``kv`` and the queries' own follow. Each query block then reads one slab of
    ``query_block + window - 1`` rows.

    **Arguments:**

    - ``q``: queries ``[B, S, H, d]``.
    - ``kv``: keys ``[B, N, d]`` shared by all heads (V4: also the values).
    - ``indices``: int ``[B, S, k]`` rows of ``kv`` each query gathers (``-1`` = none).
    - ``sinks``: per-head sink logits ``[H]`` (denominator only), or ``None``.
    - ``scale``: softmax scale.
    - ``values``: ``[B, N, vdim]`` (MLA), default ``kv``.
    - ``return_lse``: also return the log-normalisers.
    - ``query_block``, ``dense``, ``window``, ``segment``, ``window_history``: as above
        (docs/concepts.md,
        "Sparse attention without a dense mask").

    **Returns:**

    ``[B, S, H, vdim]`` in ``q``'s dtype (zeros for a query with no key); with
    ``return_lse``, ``(out, lse)`` with float32 ``lse`` ``[B, S, H]``.
    """
    if window and segment is None:
        raise ValueError("a sliding window needs the tokens' segment ids (segment=...)")
    reads = Reads(dense=dense)
    if indices.shape[-1] or not (window or dense):
        reads = Reads((GatheredRows(kv, indices, values),), dense=dense)
    if window:
        band = BandRows(kv, segment, window, window_history, values)
        reads = reads.join(Reads(band=band))
    return AutoAttention()(q, reads, sinks, scale, return_lse=return_lse, query_block=query_block)
