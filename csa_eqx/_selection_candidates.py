"""The top-k of a V4.1 candidate consumer without a score matrix: per query block, each query's
own candidate entries are gathered and scored, never the ``[B, S, T]`` scores
(docs/v41.md, "Memory").

Why gather rather than stream over every key tile with a per-tile candidate mask: a query's
candidates are at most ``Nb·bc`` entries (the release: 2048 blocks of 8, 16,384 entries),
while the key tiles would score all ``T`` visible ones (up to 1M at the release's context), so
at 1M entries streaming scores 64x more (``2·T·H·d`` against ``2·Nb·bc·H·d`` flops per
query: 8.6 GFLOP against 0.13 GFLOP with the release's 32 index heads of 128) and runs its
radix select over 64x more entries. Gathering costs ``Nb·bc·d`` key reads per query (8 MiB in
float32), and one query block holds its ``[B, Qb, Nb·bc, d]`` keys and ``[B, Qb, H, Nb·bc]``
head logits within the tile budget (``TileSizes.elements``; ``Qb`` from
``sparse_query_block``: 16 at the release's sizes on an accelerator). Up to ``Nb·bc``
entries the filter keeps every block holding a visible entry and the V4.1 layer does not
restrict at all (``V41Attention``), so short rows never gather.

Slots are gathered block by block in increasing block order, so ties go to the lower entry and
the picks are those of :func:`csa_eqx.select_topk` on the scores masked to the candidates,
bitwise given the same scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._blocks import block_starts, take
from ._layout import EntryLayout, entry_visibility
from ._problem import SelectionProblem
from ._tiles import sparse_query_block
from ._topk import exact_topk

__all__ = ["candidate_topk"]


def candidate_topk(
    problem: SelectionProblem, k: int, query_block: int = 0
) -> Int[Array, "batch seq {k}"]:
    """The ``k`` best visible entries per query among its ``problem.candidates``' blocks.

    **Arguments:** the ``problem`` (with ``candidates`` and ``candidate_block_size``),
    ``k > 0`` and the ``query_block`` (0 = automatic: the gathered keys and head logits of a
    block within ``problem.tiles.elements``).

    **Returns:** int32 ``[B, S, k]`` entry slots in increasing order, ``-1`` = none.
    """
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    project, rows, keys = problem.project, problem.rows, problem.keys
    query_index, query_segment, layout = problem.visibility
    bc = problem.candidate_block_size
    b, s, h, d = jax.eval_shape(project, *rows)[0].shape
    t, n = keys.shape[1], problem.candidates.shape[-1] * bc
    if t == 0 or s == 0:
        return jnp.full((b, s, k), -1, jnp.int32)
    heads = problem.head_chunk or h
    qb = min(query_block or sparse_query_block(b, heads, d, n, 0, problem.tiles.elements), s)
    # Integer output: nothing here is differentiated (closed-over parameters included).
    block = [jax.ShapeDtypeStruct((r.shape[0], qb, *r.shape[2:]), r.dtype) for r in rows]
    project, consts = jax.closure_convert(project, *block)
    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))
    q_starts = block_starts(s, qb)

    def query_block_body(i, out):
        r0 = q_starts[i]
        qx, wx = project(*(take(r, r0, qb) for r in rows), *consts)
        cand = take(problem.candidates, r0, qb)
        slots = (cand[..., None] * bc + jnp.arange(bc, dtype=jnp.int32)).reshape(b, qb, n)
        slots = jnp.where((cand[..., None] >= 0).repeat(bc, -1).reshape(b, qb, n), slots, t)
        safe = jnp.minimum(slots, t - 1)
        gathered = jax.vmap(lambda k, i: k[i])(keys, safe)  # [B, Qb, n, d]
        # each query's own slots, as one-query rows of entry_visibility
        end, seg = (jnp.take_along_axis(a, safe.reshape(b, -1), 1) for a in layout[:2])
        own = EntryLayout(end.reshape(b * qb, n), seg.reshape(b * qb, n), None)
        rows_of = (take(a, r0, qb).reshape(b * qb, 1) for a in (query_index, query_segment))
        visible = entry_visibility(*rows_of, own).reshape(b, qb, n) & (slots < t)
        _, pos = exact_topk(
            problem.gathered_scores(qx, wx, gathered), visible, k, unroll=problem.tiles.unroll
        )
        picks = jnp.take_along_axis(slots, jnp.maximum(pos, 0), axis=-1)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(pos >= 0, picks, -1), r0, 1)

    out = jnp.full((b, s, k), -1, jnp.int32)
    return jax.lax.fori_loop(0, q_starts.shape[0], query_block_body, out)
