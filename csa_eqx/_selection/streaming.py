"""Streaming indexer selection: exact top-k over key blocks, no score matrix.

Queries are processed in blocks. For each query block a loop visits only the key tiles that
can hold a visible entry (a dynamic trip count, so fully invisible tiles cost nothing under
``jit``) and scores each ``[B, Qb, Kb]`` tile with the problem's scorer
(``SelectionProblem.scores``, head-chunked when asked) into a row buffer of ``topk_block``
entries; each buffer gets one top-k (``exact_topk`` as the tiles' ``select`` says: the radix
select, or on a TPU ``lax.top_k`` and a sort of the picks, with no gather), merged into the
running top-k of each query. The buffer holds all entries unless ``[B, Qb, T]`` would pass the
tile budget (``TileSizes.elements``: 64 MiB of float32 on CPU), so at usual sizes there is one
top-k per query row and no merge loop at all. Neither ``[B, H, S, T]`` nor ``[B, S, T]`` is
ever formed: memory is linear in the sequence length.
The indexer queries are projected one query block at a time (``SelectionProblem.project``), so
the ``[B, S, H, d]`` queries (the largest remaining tensor at V4 sizes) never exist either.

Given the same scores this is exactly :func:`csa_eqx.select_topk`: buffers are merged in
increasing order with the running list first, so ties keep the lower index and picks stay in
increasing index order; invisible picks become ``-1``. Each tile's visibility is the problem's
(``visibility.tile``: within V4.1 candidates too). A V4.1 candidate source also reduces
each buffer to its best blocks (``csa_eqx._selection.candidates.block_top``, after an
integer-only pass for each query's newest visible slot), merged the same way: exactly
:func:`csa_eqx.candidate_blocks`, with key tiles a multiple of the block size. The selection
is integer-valued, so its inputs are ``stop_gradient``-ed and the loops never need
differentiating.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._blocks import block_starts, key_block_ranges, padded_keys, take
from .._dispatch import converted_for_blocks
from .._ops import varying_like
from .._tiles import streaming_block_sizes, topk_block_size
from .._topk import exact_topk, merge_topk
from .base import AbstractSelection, SelectionProblem
from .candidates import block_top, newest_visible

__all__ = ["StreamingSelection", "stream_topk"]


def _top_of(scores: Array, visible: Array, offset: Array, k: int, topk: dict):
    """``(values, slots)`` of the ``k`` best visible scores of a row buffer whose first entry
    is slot ``offset``, as ``exact_topk`` with the ``topk`` keywords (``(-inf, -1)`` fill)."""
    val, pos = exact_topk(scores, visible, k, **topk)
    return val, jnp.where(pos >= 0, pos + offset, -1)


class StreamingSelection(AbstractSelection):
    """Exact indexer top-k without a score matrix: tiles of ``query_block x key_block``
    scored into row buffers of ``topk_block`` entries, merged into a running top-k.

    Tiles are scored by the problem's scorer (``SelectionProblem.scores``); automatic sizes
    come from its ``tiles``. A V4.1 candidate source's blocks come from the same buffers
    (``stream_topk``).

    **Arguments:**

    - ``key_block``: entries per tile (0 = automatic, see ``streaming_block_sizes``).
    - ``query_block``: queries per block (0 = automatic).
    - ``topk_block``: entries scored into one row buffer per top-k (0 = automatic, see
        ``topk_block_size``); more entries are merged into a running top-k.

    Valid ``layout.end`` values must be nondecreasing for invisible tiles to be skipped.
    """

    key_block: int = 0
    query_block: int = 0
    topk_block: int = 0

    def __check_init__(self):
        for name in ("key_block", "query_block", "topk_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StreamingSelection.{name} must be an int >= 0 (got {value!r})")

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        return stream_topk(problem, k, self.key_block, self.query_block, self.topk_block)[0]


def _newest(visibility, tiles: tuple[Array, Array], kb: int) -> Array:
    """``[B, Qb]`` each query's newest visible slot (``-1`` = none) of a query block's
    ``visibility``, over the key tiles ``tiles = (lo, hi)`` (integers only: no scores)."""

    def tile(j, newest):
        return jnp.maximum(newest, newest_visible(visibility.tile(j * kb, kb), j * kb))

    init = varying_like(jnp.full(visibility.query_index.shape, -1, jnp.int32), visibility)
    return jax.lax.fori_loop(*tiles, tile, init)


def stream_topk(
    problem: SelectionProblem,
    k: int,
    key_block: int,
    query_block: int,
    topk_block: int,
    blocks: tuple[int, int] | None = None,
) -> tuple[Array, ...]:
    """The streaming top-k of ``problem`` with the given sizes (0 = automatic): ``(selection,)``,
    or with ``blocks = (Nb, bc)`` ``(selection, candidate blocks)`` from the same row buffers
    (``block_top`` on each, merged like the entries: V4.1's candidate source,
    ``csa_eqx._selection.candidate_source``)."""
    project, rows, keys = problem.project, problem.rows, problem.keys
    visibility, sizes, topk = problem.visibility, problem.tiles, problem.tiles.topk()
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    b, s, h, _ = jax.eval_shape(project, *rows)[0].shape
    t = keys.shape[1]
    widths = (k,) if blocks is None else (k, blocks[0])
    if t == 0 or s == 0:
        return tuple(jnp.full((b, s, w), -1, jnp.int32) for w in widths)
    multiple = 1 if blocks is None else blocks[1]
    heads = problem.head_chunk or h
    qb, kb = streaming_block_sizes(b, s, t, heads, key_block, query_block, sizes, multiple)
    group = topk_block_size(b, qb, t, kb, topk_block, sizes)
    # Integer output: nothing here is differentiated (closed-over parameters included).
    project, consts = converted_for_blocks(project, rows, qb)
    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))
    keys, layout = padded_keys(keys, visibility.layout, group)
    visibility = visibility.with_layout(layout)
    tiles_per_group, last_group = group // kb, keys.shape[1] // group - 1
    lo, hi = key_block_ranges(visibility.query_index, visibility.query_segment, layout, qb, kb)
    q_starts = block_starts(s, qb)

    def query_block_body(i, outs):
        r0 = q_starts[i]
        seen = visibility.rows(r0, qb)
        qx, wx = project(*(take(r, r0, qb) for r in rows), *consts)
        newest = None if blocks is None else _newest(seen, (lo[i], hi[i]), kb)

        def group_top(g):
            block = (qx, wx), seen, newest
            return _group_top(problem, block, keys, (lo, hi, i), g, (k, kb, group), blocks)

        def merge(g, running):
            new = group_top(g)
            return tuple(
                merge_topk(r, n, w, **topk) for r, n, w in zip(running, new, widths, strict=True)
            )

        # Groups before lo hold nothing visible; the first needed one starts the running list
        # (with one group, the whole row buffer, there is nothing to merge: no merge loop).
        g_lo, g_hi = lo[i] // tiles_per_group, -(-hi[i] // tiles_per_group)
        running = group_top(jnp.minimum(g_lo, last_group))
        if last_group > 0:
            running = jax.lax.fori_loop(g_lo + 1, g_hi, merge, running)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(o, r[1], r0, axis=1)
            for o, r in zip(outs, running, strict=True)
        )

    outs = tuple(varying_like(jnp.full((b, s, w), -1, jnp.int32), rows, keys) for w in widths)
    return jax.lax.fori_loop(0, q_starts.shape[0], query_block_body, outs)


def _group_top(problem: SelectionProblem, block, keys, ranges, g, sizes, blocks):
    """Score the needed key tiles of group ``g`` for one query block into one row buffer ``[B,
    Qb, group]``, then its top-k (and with ``blocks`` its best blocks): ``block = ((qx, wx),
    seen, newest)`` (its projected queries, its visibility, each query's newest visible slot),
    ``ranges = (lo, hi, i)`` (its key tiles ``lo[i] .. hi[i]``), ``sizes = (k, kb, group)``."""
    ((qx, wx), seen, newest), (lo, hi, i), (k, kb, group) = block, ranges, sizes
    b, qb = qx.shape[:2]
    topk = problem.tiles.topk()
    first = g * (group // kb)

    def tile(j, buffer):
        scores = problem.scores(qx, wx, take(keys, j * kb, kb))
        return jax.lax.dynamic_update_slice_in_dim(buffer, scores, (j - first) * kb, 2)

    tiles = (jnp.maximum(lo[i], first), jnp.minimum(hi[i], first + group // kb))
    buffer = varying_like(jnp.zeros((b, qb, group), jnp.float32), (qx, keys))
    buffer = jax.lax.fori_loop(*tiles, tile, buffer)
    c0 = first * kb
    visible = seen.tile(c0, group)
    tops = (_top_of(buffer, visible, c0, k, topk),)
    if blocks is None:
        return tops
    return (*tops, block_top(buffer, visible, newest, c0, *blocks, **topk))
