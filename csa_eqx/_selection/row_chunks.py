"""The row-chunk loop the fused selection kernels share (``TritonSelection``,
``MosaicSelection``): the queries are projected ``query_chunk`` rows at a time
(``SelectionProblem.project``), one kernel call per chunk, so the ``[B, S, H, d]`` queries never
exist at once either.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._blocks import block_starts, padded_keys, take
from .._dispatch import converted_for_blocks
from .._layout import Visibility
from .._mesh import per_device
from .._ops import varying_like
from .base import SelectionProblem

__all__ = ["kernel_row_chunks"]


def kernel_row_chunks(
    problem: SelectionProblem,
    k: int,
    kernel: Callable,
    name: str,
    *,
    block: int,
    key_block: int,
    per_row: int,
    query_chunk: int = 0,
) -> Int[Array, "batch seq {k}"]:
    """The selection of ``problem`` by a fused kernel, called on a chunk of query rows at a
    time: as few calls as the rows per call allow, their chunks balanced (each ``ceil(S /
    calls)`` rows rounded up to whole blocks), the last pulled back to end at the sequence's
    end. That last call runs first, the rows it shares with the chunk before it passed to the
    kernel as seeing nothing (query index ``-1``: their blocks' key ranges are empty, so they
    are skipped); the calls after it write those rows, so each row is selected once. (Chunks
    of the most rows a call allows left the last call to redo up to a chunk of the costliest
    causal rows: 1.67x the kernel's work at 16k on a TPU v5e; balanced chunks still redid up
    to ``calls`` blocks: 3.3 % of the selection stage's time at 16k, docs/kernels.md.)

    **Arguments:**

    - ``problem``: its visibility a plain ``Visibility`` (a ``CandidateVisibility`` is refused
        with a ``TypeError`` naming the strategy, ``name``).
    - ``k``: picks per query (``> 0``).
    - ``kernel(q, w, keys, layout, query_index, query_segment)``: the ``[B, R, k]`` int32 picks
        of ``R`` projected query rows over every entry (the keys and their layout padded to
        whole ``key_block`` tiles, once for every call).
    - ``block``: the kernel's query block: a chunk is whole blocks (or the sequence).
    - ``per_row``: the elements one query row takes in a call beside its ``[H, d]`` queries
        (buffers, picks), for the automatic chunk.
    - ``query_chunk``: at most this many rows per call (0 = automatic: as many as keep ``B x
        rows x (H d + per_row)`` elements within ``problem.tiles.elements``).

    **Returns:** int32 ``[B, S, k]``, ``-1`` = none.
    """
    _check(problem, k, name)
    project, rows, keys = problem.project, problem.rows, problem.keys
    visibility = problem.visibility
    b, s, h, d = jax.eval_shape(project, *rows)[0].shape
    if s == 0 or keys.shape[1] == 0:
        return jnp.full((b, s, k), -1, jnp.int32)
    chunk = query_chunk or max(problem.tiles.elements // (b * (h * d + per_row)), block)
    chunk = _balanced(chunk, s, block)
    # Integer output: nothing here is differentiated (closed-over parameters included).
    project, consts = converted_for_blocks(project, rows, chunk)
    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))
    keys, layout = padded_keys(keys, visibility.layout, key_block)

    def picks(r0, new):
        """The picks of rows ``r0 .. r0 + chunk``, those where ``new`` is false not selected."""
        q, w = project(*(take(r, r0, chunk) for r in rows), *consts)
        seen = visibility.rows(r0, chunk)
        index = jnp.where(new, seen.query_index, -1)
        args = (q, w, keys, layout, index, seen.query_segment)
        # one device's program; nothing here is differentiated (the inputs' gradient stopped)
        return per_device(lambda args, _: kernel(*args), args, differentiable=False)

    starts = block_starts(s, chunk)
    if starts.shape[0] == 1:
        return picks(0, True)

    n = starts.shape[0]

    def call(i, out):
        # the pulled-back last chunk first: the calls after it write the rows it skips
        c = jax.lax.rem(i + n - 1, n)
        r0 = starts[c]
        new = r0 + jnp.arange(chunk, dtype=jnp.int32) >= c * chunk  # not another call's rows
        return jax.lax.dynamic_update_slice_in_dim(out, picks(r0, new[None, :]), r0, axis=1)

    out = varying_like(jnp.full((b, s, k), -1, jnp.int32), rows, keys, consts)
    return jax.lax.fori_loop(0, n, call, out)


def _check(problem: SelectionProblem, k: int, name: str) -> None:
    """Refuse a ``CandidateVisibility`` (``TypeError`` naming the strategy) and ``k <= 0``."""
    if not isinstance(problem.visibility, Visibility):
        raise TypeError(
            f"{name} scores a plain Visibility; a V4.1 consumer's "
            f"{type(problem.visibility).__name__} needs GatheredSelection (AutoSelection "
            "chooses it)"
        )
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")


def _balanced(chunk: int, s: int, block: int) -> int:
    """The rows per call for at most ``chunk`` of ``s`` rows: as few calls as that allows, each
    as short as whole ``block``s allow (or the sequence)."""
    chunk = min(-(-chunk // block) * block, s)  # whole blocks, or the sequence
    calls = -(-s // chunk)  # balanced: the fewest calls, each as short as whole blocks allow
    per_call = -(-s // calls)
    return min(-(-per_call // block) * block, s)
