"""The rows a layer's forward runs on: the integer side of a batch of token rows (positions,
segments, stream indices, the entry layout) and how those rows reach what other devices hold.

A placement (``csa_eqx._placement``) hands a layer its ``Rows``: on one device the whole batch
and sequence; under context parallelism one batch row per chunk, halo first, whose entries
are all-gathered with ``gather``; under head parallelism the same rows, with ``all_heads``
gathering per-head arrays over the heads' axis. The layer never asks which placement runs.

``Rows`` is also the forward's *source of the keys seen so far*: a layer writes its pipeline
once against ``positions`` / ``segment`` / ``query_index`` and four reads, and ``extend`` runs
the same pipeline over ``csa_eqx._decode.chunks.ChunkSource`` (the cache and the chunk):

* ``window_reads(window, kv, width)``: the sliding window's ``Reads`` over the token keys;
* ``entries(name, compressor, x, dtype, finish)``: the compressed entries of every slot and
  their ``EntryLayout``;
* ``tokens(name, values)``: per-token keys of every token (V3.2) and their layout;
* ``cache_after()``: what a decode cache holds afterwards (``None`` for the forward).

Each read returns the source next to its value (the forward's is unchanged; a chunk's records
what it wrote), so the pipeline threads it functionally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jaxtyping import Array, Int

from ._layout import EntryLayout, entry_layout, token_rows

__all__ = ["Rows", "whole_rows"]


def _same(a: Array, *axis: int) -> Array:
    return a


class Rows(NamedTuple):
    """The integer side of the rows a forward runs on (all ``[B', L]``).

    **Arguments:**

    - ``positions``, ``segment``, ``query_index``: RoPE positions, segment ids and stream row
        indices (``-1``: a row that queries nothing, e.g. a context-parallel halo row).
    - ``own``: the entry slots these rows compress, window ends as row indices of these rows
        (``None`` without a compressor).
    - ``layout``: every entry slot of the sequence (window ends as stream rows), for visibility.
    - ``gather``: the entries of ``own`` ``[B', T_own, d]`` -> those of every slot of
        ``layout`` (identity on one device).
    - ``all_heads``: ``all_heads(a, axis)``: a per-head array of this device's heads (heads on
        ``axis``) -> every head's (identity unless the heads are split over devices).
    """

    positions: Int[Array, "batch rows"]
    segment: Int[Array, "batch rows"]
    query_index: Int[Array, "batch rows"]
    own: EntryLayout | None
    layout: EntryLayout | None
    gather: Callable[[Array], Array] = _same
    all_heads: Callable[..., Array] = _same

    def window_reads(self, window, kv: Array, width: int) -> tuple:
        """**Arguments:** the layer's window strategy, the rows' keys ``kv [B', L, d]`` and the
        window length.

        **Returns:** ``(reads, self)``: the window over these rows (halo rows first under context
        parallelism)."""
        return window.reads(kv, token_rows(kv, None)[1], self.segment, width), self

    def entries(self, name: str, compressor, x: Array, dtype, finish, numerics) -> tuple:
        """**Arguments:** a name for the entries (what a cache calls their state), the
        ``compressor``, its input ``x [B', L, hidden]``, the numerics' ``dtype`` (the cast
        before the norm), ``finish`` (their rounding) and the layer's ``numerics``.

        **Returns:** ``(entries, layout, self)``: the entries of every slot of ``layout``
        (``[B', T, d]``; this device's own ones gathered from every device's)."""
        own = finish(compressor(x, self.positions, self.own, dtype, numerics))
        return self.gather(own), self.layout, self

    def tokens(self, name: str, values: Array) -> tuple:
        """**Arguments:** a name for the values (what a cache calls them) and per-row ``values
        [B', L, d]`` (V3.2: every token is an entry).

        **Returns:** ``(values of every token, layout, self)``."""
        return self.gather(values), self.layout, self

    def cache_after(self) -> None:
        """**Returns:** ``None``: a forward writes no cache."""
        return None


def whole_rows(
    positions: Int[Array, "batch seq"],
    segment: Int[Array, "batch seq"],
    query_index: Int[Array, "batch seq"],
    rate: int,
) -> Rows:
    """**Arguments:** the whole sequence's positions, segments and row indices and the tokens per
    entry (``rate``; 0: no entries).

    **Returns:** the ``Rows`` of a forward over the whole sequence: each row compresses all of its
    windows."""
    layout = entry_layout(segment, rate) if rate else None
    return Rows(positions, segment, query_index, layout, layout)
