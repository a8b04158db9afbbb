"""V4.1's candidate pre-filter as block ids (docs/v41.md, "Candidates"): the dense reference
``candidate_blocks``, the per-buffer reduction the streaming selection shares with it, and the
expansion of block ids to an entry mask (dense paths) or to each query's own entry slots
(``candidate_slots``: the streaming consumer's selection and its indexer loss).

Candidates are int32 ``[B, S, Nb]``: per query the ids of the kept blocks of ``bc`` consecutive
entry slots, in increasing order, ``-1`` past the last: 8 KiB per query at the release's
``Nb = 2048``, where a bool ``[B, S, T]`` mask of 1M entries would take 1 MiB.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._layout import EntryLayout, Visibility, entry_visibility, scatter_rows, take
from .._topk import exact_topk

__all__ = [
    "CandidateVisibility",
    "candidate_blocks",
    "candidate_mask",
    "candidate_slots",
    "block_top",
    "newest_visible",
]


def newest_visible(visible: Bool[Array, "*rows n"], first_slot=0) -> Int[Array, " *rows"]:
    """**Arguments:** a ``visible`` buffer whose first entry is slot ``first_slot``.

    **Returns:** int32 ``[*rows]``: each row's newest visible slot, ``-1`` = none."""
    slots = first_slot + jnp.arange(visible.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(visible, slots, -1), axis=-1)


def block_top(
    scores: Float[Array, "batch seq n"],
    visible: Bool[Array, "batch seq n"],
    newest: Int[Array, "batch seq"],
    first_slot,
    topk_blocks: int,
    block_size: int,
    unroll: bool = False,
    method: str = "radix",
) -> tuple[Float[Array, "batch seq {topk_blocks}"], Int[Array, "batch seq {topk_blocks}"]]:
    """The best ``topk_blocks`` blocks of a row buffer whose first slot, ``first_slot``, starts
    a block: each block scored by its best visible entry, the one holding ``newest`` (the
    query's newest visible slot, ``-1`` = none) at ``+inf``, never a block without a visible
    entry; ties to the lower block (``exact_topk``).

    **Arguments:** float ``scores`` and ``visible`` ``[B, S, n]``, ``newest [B, S]``, the
    buffer's ``first_slot`` (a multiple of ``block_size``), ``Nb``, ``bc``, ``unroll`` and
    ``method`` (``exact_topk``'s).

    **Returns:** ``(block scores, block ids)`` ``[B, S, Nb]`` in increasing id order,
    ``(-inf, -1)`` past the last: the running list ``_selection_streaming`` merges.
    """
    b, s, n = scores.shape
    nblk = -(-n // block_size)
    masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    masked = jnp.pad(masked, [(0, 0), (0, 0), (0, nblk * block_size - n)], constant_values=-jnp.inf)
    best = jnp.max(masked.reshape(b, s, nblk, block_size), axis=-1)
    first = first_slot // block_size
    ids = first + jnp.arange(nblk, dtype=jnp.int32)
    pinned = (newest >= 0)[..., None] & (ids == (newest // block_size)[..., None])
    best = jnp.where(pinned, jnp.inf, best)
    val, pos = exact_topk(best, best > -jnp.inf, topk_blocks, unroll=unroll, method=method)
    return val, jnp.where(pos >= 0, pos + first, -1)


def candidate_blocks(
    scores: Float[Array, "batch seq entries"],
    visible: Bool[Array, "batch seq entries"],
    topk_blocks: int,
    block_size: int,
    *,
    unroll: bool = False,
    method: str = "radix",
) -> Int[Array, "batch seq {topk_blocks}"]:
    """V4.1's candidate pre-filter (docs/v41.md, "Candidates"), the dense reference: the entry
    slots in blocks of ``block_size``, each block scored by its best visible entry; per query
    the block holding its newest visible entry is always kept, then the best ``topk_blocks``
    blocks in all (ties to the lower block), never a block without a visible entry.

    **Arguments:** float index ``scores [B, S, T]``, their ``visible`` mask, ``Nb``, ``bc`` and
    ``unroll`` and ``method`` (as for ``exact_topk``; same result).

    **Returns:** int32 ``[B, S, Nb]``: the kept block ids in increasing order, ``-1`` past the
    last (``candidate_mask`` expands them to entries; the pinned block's slots past the query's
    newest visible one belong to it too, visibility still applies).
    """
    newest = newest_visible(visible)
    return block_top(scores, visible, newest, 0, topk_blocks, block_size, unroll, method)[1]


def candidate_mask(
    blocks: Int[Array, "batch seq blocks"], block_size: int, entries: int
) -> Bool[Array, "batch seq {entries}"]:
    """**Arguments:** candidate ``blocks [B, S, Nb]`` (``-1`` = none), ``bc`` and the number
    of ``entries`` ``T``.

    **Returns:** bool ``[B, S, T]``: every slot of a kept block (dense paths only)."""
    nblk = -(-entries // block_size)
    index = jnp.where(blocks < 0, nblk, blocks)  # out of range: dropped
    kept = scatter_rows(index, jnp.ones(blocks.shape, bool), nblk, False)
    return jnp.repeat(kept, block_size, axis=-1)[..., :entries]


def candidate_slots(
    blocks: Int[Array, "batch queries blocks"],
    block_size: int,
    query_index: Int[Array, "batch queries"],
    query_segment: Int[Array, "batch queries"],
    layout: EntryLayout,
) -> Int[Array, "batch queries n"]:
    """Each query's own candidate entries, without the ``[B, S, T]`` mask: the slots of its
    kept blocks in increasing order, ``-1`` where a slot is in no kept block, past the last
    entry or invisible to the query.

    **Arguments:** candidate ``blocks [B, Q, Nb]`` of a block of queries (``-1`` = none),
    ``bc``, the queries' ``query_index`` and ``query_segment`` ``[B, Q]`` and the entries'
    ``layout`` (``[B, T]``, ``T > 0``).

    **Returns:** int32 ``[B, Q, Nb·bc]``.
    """
    b, q, nb = blocks.shape
    t, n = layout.end.shape[1], nb * block_size
    slots = blocks[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    kept = ((blocks >= 0)[..., None] & (slots < t)).reshape(b, q, n)
    slots = jnp.where(kept, slots.reshape(b, q, n), 0)
    # each query's own slots, as one-query rows of entry_visibility
    end, segment = (jnp.take_along_axis(a, slots.reshape(b, -1), 1) for a in layout[:2])
    own = EntryLayout(end.reshape(b * q, n), segment.reshape(b * q, n), None)
    rows = (a.reshape(b * q, 1) for a in (query_index, query_segment))
    visible = entry_visibility(*rows, own).reshape(b, q, n)
    return jnp.where(kept & visible, slots, -1)


class CandidateVisibility(eqx.Module):
    """What a V4.1 consumer's queries may pick from (docs/v41.md, "Candidates"): the entries
    ``base`` shows them, within each query's candidate blocks. It answers what a strategy asks
    of a ``csa_eqx.Visibility`` (``mask``, ``rows``, ``tile``, ``slots``, ...), so the
    selection and the indexer loss need no candidate path of their own; ``slots`` lists each
    query's candidate entries (``Nb·bc`` per query, never ``[B, S, T]``), which is what
    ``csa_eqx.GatheredSelection`` scores.

    **Arguments:**

    - ``query_index``, ``query_segment``, ``layout``: the queries' ``Visibility`` (``base``).
    - ``candidates``: int32 ``[B, S, Nb]`` kept block ids per query, increasing, ``-1`` past
        the last (``candidate_blocks``).
    - ``block_size``: the blocks' size ``bc``.
    """

    query_index: Int[Array, "batch seq"]
    query_segment: Int[Array, "batch seq"]
    layout: EntryLayout
    candidates: Int[Array, "batch seq blocks"]
    block_size: int = eqx.field(static=True)

    @classmethod
    def within(cls, base: Visibility, candidates, block_size: int) -> CandidateVisibility:
        """**Returns:** what ``base`` shows, within the ``candidates``' blocks of ``block_size``."""
        return cls(*base, candidates, block_size)

    @property
    def base(self) -> Visibility:
        """**Returns:** the visibility without the pre-filter."""
        return Visibility(self.query_index, self.query_segment, self.layout)

    def mask(self) -> Bool[Array, "batch seq entries"]:
        """**Returns:** bool ``[B, S, T]``: visible and in a kept block (dense paths only)."""
        visible = self.base.mask()
        return visible & candidate_mask(self.candidates, self.block_size, visible.shape[-1])

    def rows(self, start, size: int) -> CandidateVisibility:
        """As ``Visibility.rows``: query rows ``start .. start + size``, with their blocks."""
        rows = take(self.candidates, start, size)
        return self.within(self.base.rows(start, size), rows, self.block_size)

    def pad_rows(self, n: int) -> CandidateVisibility:
        """As ``Visibility.pad_rows``: ``n`` more rows that see no entry (and keep no block)."""
        pad = [(0, 0), (0, n), (0, 0)]
        blocks = jnp.pad(self.candidates, pad, constant_values=-1)
        return self.within(self.base.pad_rows(n), blocks, self.block_size)

    def with_layout(self, layout: EntryLayout) -> CandidateVisibility:
        """As ``Visibility.with_layout``."""
        return self.within(self.base.with_layout(layout), self.candidates, self.block_size)

    def tile(self, start, width: int) -> Bool[Array, "batch seq {width}"]:
        """As ``Visibility.tile``, within the kept blocks: the blocks that slots ``start ..
        start + width`` touch are marked per query (``[B, S, ~width / bc]``, no ``[B, S, T]``
        mask)."""
        bc = self.block_size
        first, n = start // bc, -(-(width + bc - 1) // bc)
        local = self.candidates - first
        local = jnp.where((self.candidates >= 0) & (local >= 0) & (local < n), local, n)
        kept = scatter_rows(local, jnp.ones(local.shape, bool), n, False)
        block = (start - first * bc + jnp.arange(width, dtype=jnp.int32)) // bc
        shape = (*kept.shape[:-1], width)
        return self.base.tile(start, width) & jnp.take_along_axis(
            kept, jnp.broadcast_to(block, shape), axis=-1
        )

    def slots(self) -> Int[Array, "batch seq n"]:
        """**Returns:** int32 ``[B, S, Nb·bc]``: each query's visible candidate slots
        (``candidate_slots``), ``-1`` elsewhere."""
        return candidate_slots(
            self.candidates, self.block_size, self.query_index, self.query_segment, self.layout
        )
