"""The backend-dependent tile sizes (``TileSizes``, chosen for the backend in ``_backend.py``) and
the query / key / top-k block sizes they imply for the streaming selection and loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

__all__ = [
    "TileSizes",
    "block_starts",
    "streaming_block_sizes",
    "topk_block_size",
    "sparse_query_block",
    "power_of_two_block",
    "map_row_blocks",
]


class TileSizes(NamedTuple):
    """The backend-dependent sizes of the selection and the indexer loss (tiles, buffers,
    unrolling). ``csa_eqx._backend.backend_tiles()`` chooses them for the backend (what the layers
    use, through ``Execution.tiles``); the defaults are the CPU sizes.

    **Arguments:**

    - ``elements``: elements of the largest per-tile tensor ``[B, Qb, heads at once, Kb]`` (and
        of one top-k row buffer); also the size up to which the automatic choices stay
        dense (default 2^24: 64 MiB of float32, cache-sized on CPU).
    - ``key_block``: automatic entries per key tile (default 128).
    - ``max_query_block``: largest automatic query block (default 256).
    - ``unroll``: unroll the radix select's 32 steps (``exact_topk``; default ``False``).
    - ``attention_elements``: the elements one query block of the attention keeps (gathered
        keys and logits, ``csa_eqx._attention.base.attention_query_block``; default 2^24).
    - ``select``: how the XLA paths take an exact top-k (``csa_eqx._topk.exact_topk``'s
        ``method``): ``"radix"`` (counting halvings and a binary-search compaction; default)
        or ``"top_k"`` (``lax.top_k`` on integer order keys and a sort of the picks: no
        gather, a TPU's). The same selection either way.
    """

    elements: int = 1 << 24
    key_block: int = 128
    max_query_block: int = 256
    unroll: bool = False
    attention_elements: int = 1 << 24
    select: str = "radix"

    def topk(self) -> dict:
        """**Returns:** the keywords of ``exact_topk`` / ``select_topk`` these tiles ask for
        (``unroll``, ``method``)."""
        return dict(unroll=self.unroll, method=self.select)


_CPU_TILES = TileSizes()


def streaming_block_sizes(
    batch: int,
    seq: int,
    entries: int,
    heads_at_once: int,
    key_block: int = 0,
    query_block: int = 0,
    tiles: TileSizes = _CPU_TILES,
    multiple: int = 1,
) -> tuple[int, int]:
    """**Arguments:** the problem's sizes, the requested ``key_block`` / ``query_block``
    (0 = automatic), the backend's ``tiles`` (``TileSizes``; default the CPU sizes,
    ``csa_eqx._backend.backend_tiles()`` for the current backend) and the ``multiple`` the key
    block must be (V4.1's candidate blocks: ``bc``).

    **Returns:** ``(query_block, key_block)``, clipped to the sequence and the entries (the
    key block then rounded up to the ``multiple``).

    Automatic: key tiles of ``tiles.key_block`` entries (128 on CPU, 512 on accelerators) and
    the largest power-of-two query block (at least 16, at most ``tiles.max_query_block``: 256
    on CPU, 1024 on accelerators) whose ``[B, Qb, heads, Kb]`` tile stays within
    ``tiles.elements`` (2^24 on CPU, 2^26 on accelerators).
    """
    kb = -(-max(1, min(key_block or tiles.key_block, entries)) // multiple) * multiple
    qb = query_block
    if not qb:
        budget = max(tiles.elements // (batch * max(heads_at_once, 1) * kb), 1)
        qb = min(max(1 << (budget.bit_length() - 1), 16), tiles.max_query_block)
    return max(1, min(qb, seq)), kb


def topk_block_size(
    batch: int,
    query_block: int,
    entries: int,
    key_block: int,
    topk_block: int = 0,
    tiles: TileSizes = _CPU_TILES,
) -> int:
    """Entries per top-k pass, a multiple of ``key_block``: ``topk_block`` rounded up, or
    (0 = automatic) all entries when one ``[B, Qb, T]`` score buffer fits ``tiles.elements``
    (see ``streaming_block_sizes``), else as many key tiles as do.

    **Arguments:** the sizes, the tiles (``streaming_block_sizes``), the requested
    ``topk_block`` (0 = automatic) and the backend's ``tiles``.

    **Returns:** entries per top-k pass (int, >= ``key_block``).
    """
    n_tiles = -(-entries // key_block)
    per_pass = (
        -(-topk_block // key_block)
        if topk_block
        else tiles.elements // (batch * query_block * key_block)
    )
    return max(1, min(per_pass, n_tiles)) * key_block


def sparse_query_block(
    batch: int, heads: int, dim: int, k: int, entries: int = 0, elements: int = 1 << 24
) -> int:
    """The automatic query block of an attention over gathered picks (and dense entries; the
    sizing rule of ``csa_eqx._attention.base.attention_query_block``, here so that the
    streaming indexer loss sizes its blocks alike): keeps the gathered
    ``[B, Qb, k, dim]`` keys (and values) plus the ``[B, Qb, H, k]`` logits of one block, and
    the ``[B, Qb, H, entries]`` logits and mask of entries attended by matmul, near 64 MiB of
    float32.

    **Arguments:** the sizes (``dim``: gathered key plus value channels per pick; ``entries``:
    those attended by matmul, 0 = none) and the block's budget of ``elements``.

    **Returns:** the query block, a power of two >= 1.
    """
    return power_of_two_block(batch, k * (dim + heads) + entries * (heads + 1), elements)


def power_of_two_block(batch: int, per_row: int, elements: int = 1 << 24) -> int:
    """The largest power of two of query rows whose ``batch * per_row`` elements per row stay
    within ``elements`` (at least 1)."""
    rows = max(elements // max(batch * per_row, 1), 1)
    return 1 << (rows.bit_length() - 1)


def block_starts(n: int, block: int) -> Array:
    """Start of each block; the last one is pulled back to end at ``n`` (no padding copies)."""
    return jnp.minimum(jnp.arange(-(-n // block), dtype=jnp.int32) * block, n - block)


def map_row_blocks(fn: Callable, rows, block: int):
    """``fn(start, rows of the block)`` over blocks of ``block`` rows (axis 1 of every array of
    the pytree ``rows``) in a ``lax.map`` with a rematerialised body, the last block padded
    (integer arrays with ``-1``: padded rows see nothing; the rest with zeros); the results'
    rows joined back (axis 1). One block: ``fn(0, rows)`` directly.

    **Arguments:** ``fn``, the ``rows`` (at least one array, all ``[B, S, ...]``) and the
    ``block`` size (``>= 1``).

    **Returns:** ``fn``'s pytree of ``[B, S, ...]`` arrays.
    """
    b, s = jax.tree.leaves(rows)[0].shape[:2]
    n = -(-s // block)
    if n <= 1:
        return fn(jnp.int32(0), rows)

    def blocks(x: Array) -> Array:
        fill = -1 if jnp.issubdtype(x.dtype, jnp.integer) else 0
        pad = [(0, 0), (0, n * block - s)] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, pad, constant_values=fill)
        return jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0)

    def unblocks(y: Array) -> Array:
        return jnp.moveaxis(y, 0, 1).reshape(b, n * block, *y.shape[3:])[:, :s]

    starts = jnp.arange(n, dtype=jnp.int32) * block
    out = jax.lax.map(jax.checkpoint(lambda a: fn(*a)), (starts, jax.tree.map(blocks, rows)))
    return jax.tree.map(unblocks, out)
