"""The rows a layer's forward runs on: the integer side of a batch of token rows (positions,
segments, stream indices, the entry layout) and how those rows reach what other devices hold.

A placement (``csa_eqx._placement``) hands a layer its ``Rows``: on one device the whole batch
and sequence; under context parallelism one batch row per chunk, halo first, whose entries
are all-gathered with ``gather``; under head parallelism the same rows, with ``all_heads``
gathering per-head arrays over the heads' axis. The layer never asks which placement runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jaxtyping import Array, Int

from ._layout import EntryLayout, entry_layout

__all__ = ["Rows", "whole_rows"]


def _same(a: Array, *axis: int) -> Array:
    return a


class Rows(NamedTuple):
    """The integer side of the rows a forward runs on (all ``[B', L]``).

    Arguments:
        positions, segment, query_index: RoPE positions, segment ids and stream row indices
            (``-1``: a row that queries nothing, e.g. a context-parallel halo row).
        own: the entry slots these rows compress, window ends as row indices of these rows
            (``None`` without a compressor).
        layout: every entry slot of the sequence (window ends as stream rows), for visibility.
        gather: the entries of ``own`` ``[B', T_own, d]`` -> those of every slot of
            ``layout`` (identity on one device).
        all_heads: ``all_heads(a, axis)``: a per-head array of this device's heads (heads on
            ``axis``) -> every head's (identity unless the heads are split over devices).
    """

    positions: Int[Array, "batch rows"]
    segment: Int[Array, "batch rows"]
    query_index: Int[Array, "batch rows"]
    own: EntryLayout | None
    layout: EntryLayout | None
    gather: Callable[[Array], Array] = _same
    all_heads: Callable[..., Array] = _same


def whole_rows(
    positions: Int[Array, "batch seq"],
    segment: Int[Array, "batch seq"],
    query_index: Int[Array, "batch seq"],
    rate: int,
) -> Rows:
    """Arguments: the whole sequence's positions, segments and row indices and the tokens per
    entry (``rate``; 0: no entries).

    Returns: the ``Rows`` of a forward over the whole sequence: each row compresses all of its
    windows."""
    layout = entry_layout(segment, rate) if rate else None
    return Rows(positions, segment, query_index, layout, layout)
