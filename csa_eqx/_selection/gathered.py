"""``GatheredSelection``: score only each query's own entries, gathered by index.

Per query block, each query's entry slots come from the visibility (``visibility.slots()``: a
V4.1 consumer's visible candidate entries, ``Nb·bc`` per query; every entry for a plain
``Visibility``); their keys are gathered and scored (``SelectionProblem.gathered_scores``),
never the ``[B, S, T]`` scores, and one exact top-k runs over them.

Why gather rather than stream every key tile within the candidates: a query has at most
``Nb·bc`` candidates (the release: 2048 blocks of 8, 16,384 entries), while the key tiles would
score all ``T`` visible entries (up to 1M at the release's context): 64x the flops there
(``2·T·H·d`` against ``2·Nb·bc·H·d`` per query, 8.6 against 0.13 GFLOP with the release's 32
index heads of 128) and a radix select over 64x the entries. Gathering reads ``Nb·bc·d`` key
values per query (8 MiB in float32); a query block holds its ``[B, Qb, n, d]`` keys and
``[B, Qb, H, n]`` head logits within the tile budget (``TileSizes.elements``; ``Qb`` from
``sparse_query_block``, 16 at the release's sizes on an accelerator). ``csa_eqx.AutoSelection``
chooses it where a V4.1 consumer's filter drops entries (``csa_eqx._selection.auto``).

Slots are listed in increasing order, so ties go to the lower entry: the picks of
``select_topk`` on the scores masked to the visibility, bitwise given the same scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._blocks import block_starts, take
from .._dispatch import converted_for_blocks
from .._layout import gather_keys
from .._ops import varying_like
from .._tiles import sparse_query_block
from .._topk import exact_topk
from .base import AbstractSelection, SelectionProblem

__all__ = ["GatheredSelection"]


class GatheredSelection(AbstractSelection):
    """Exact top-k over each query's own entries (``visibility.slots()``), gathered and scored
    one query block at a time (module docstring); no ``[B, S, T]`` scores.

    **Arguments:**

    - ``query_block``: queries per block (0 = automatic: the gathered keys and head logits of a
        block within ``problem.tiles.elements``).
    """

    query_block: int = 0

    def __check_init__(self):
        value = self.query_block
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"GatheredSelection.query_block must be an int >= 0 (got {value!r})")

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        return gathered_topk(problem, k, self.query_block)[0]


def gathered_topk(
    problem: SelectionProblem, k: int, query_block: int = 0, blocks: tuple[int, int] | None = None
) -> tuple[Array, ...]:
    """The gathered top-k of ``problem``, ``query_block`` queries per block (0 = automatic):
    ``(selection,)``, or with ``blocks = (Nb, bc)`` also the best blocks of the same gathered
    scores (``_best_blocks``: V4.1's candidate source, ``csa_eqx._selection.candidate_source``)."""
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    project, rows, keys, visibility = (
        problem.project,
        problem.rows,
        problem.keys,
        problem.visibility,
    )
    b, s, h, d = jax.eval_shape(project, *rows)[0].shape
    t = keys.shape[1]
    widths = (k,) if blocks is None else (k, blocks[0])
    if t == 0 or s == 0:
        return tuple(jnp.full((b, s, w), -1, jnp.int32) for w in widths)
    n = jax.eval_shape(lambda v: v.rows(0, 1).slots(), visibility).shape[-1]
    heads = problem.head_chunk or h
    budget = problem.tiles.elements
    qb = min(query_block or sparse_query_block(b, heads, d, n, 0, budget), s)
    # Integer output: nothing here is differentiated (closed-over parameters included).
    project, consts = converted_for_blocks(project, rows, qb)
    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))
    q_starts = block_starts(s, qb)
    topk = problem.tiles.topk()

    def query_block_body(i, outs):
        r0 = q_starts[i]
        qx, wx = project(*(take(r, r0, qb) for r in rows), *consts)
        slots = visibility.rows(r0, qb).slots()  # [B, Qb, n], -1 = none
        scores = problem.gathered_scores(qx, wx, gather_keys(keys, slots))
        _, pos = exact_topk(scores, slots >= 0, k, **topk)
        picks = jnp.take_along_axis(slots, jnp.maximum(pos, 0), axis=-1)
        new = (jnp.where(pos >= 0, picks, -1),)
        if blocks is not None:
            new += (_best_blocks(scores, slots, t, *blocks, topk),)
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(o, a, r0, 1) for o, a in zip(outs, new, strict=True)
        )

    outs = tuple(varying_like(jnp.full((b, s, w), -1, jnp.int32), rows, keys) for w in widths)
    return jax.lax.fori_loop(0, q_starts.shape[0], query_block_body, outs)


def _best_blocks(
    scores: Array, slots: Array, entries: int, topk_blocks: int, block_size: int, topk: dict
) -> Array:
    """The best ``Nb`` blocks of ``bc`` slots among a query block's gathered ``scores``
    (``csa_eqx.candidate_blocks``' rule: a block scores its best listed slot, the block of the
    newest listed slot is pinned, ties to the lower block), from the listed slots' scores
    scattered into every block's (``[B, Qb, ceil(T / bc)]``)."""
    nblk = -(-entries // block_size)
    listed = slots >= 0
    block = jnp.where(listed, slots // block_size, nblk)  # unlisted: dropped
    lead = [jnp.arange(n).reshape((n,) + (1,) * (2 - i)) for i, n in enumerate(slots.shape[:2])]
    best = jnp.full((*slots.shape[:2], nblk), -jnp.inf, jnp.float32)
    best = best.at[(*lead, block)].max(jnp.where(listed, scores, -jnp.inf), mode="drop")
    newest = jnp.max(jnp.where(listed, slots, -1), axis=-1) // block_size
    pinned = (newest >= 0)[..., None] & (jnp.arange(nblk) == newest[..., None])
    best = jnp.where(pinned, jnp.inf, best)
    _, ids = exact_topk(best, best > -jnp.inf, topk_blocks, **topk)
    return ids
