"""Decode caches: fixed-size pytrees, so one compiled decode step serves every position (SPEC §3).

Every buffer has a static shape fixed by ``max_length``; per-row progress lives in int32
arrays. A step therefore compiles once and reuses its executable, and the cache can be donated
(``eqx.filter_jit(step, donate="all-except-first")`` with the layer as first argument).

Row bookkeeping (all ``[batch]``): ``length`` tokens written so far (the *stream index* of the
next token), ``position`` the next token's position inside its segment (its RoPE position) and
``segment`` the segment id of the last written token (decoding continues it). Segment ids must
be ``>= 0``; ``-1`` marks empty slots.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = [
    "CompressorState",
    "V4Cache",
    "V32Cache",
    "init_v4_cache",
    "init_v32_cache",
    "cache_bytes",
]


class CompressorState(eqx.Module):
    """One compressor's state: per-token ``(C, Z)`` of the last ``ring`` tokens (``2m`` for
    CSA, which covers the open window and the previous window's overlap halves; ``m`` for HCA)
    and the entries emitted so far, in closing order."""

    kv: Float[Array, "batch ring width"]
    gate: Float[Array, "batch ring width"]
    entries: Float[Array, "batch slots dim"]


class V4Cache(eqx.Module):
    """State of one V4 layer (sliding: window only; HCA: plus one compressor; CSA: plus the
    indexer's compressor at ``index_head_dim``).

    Entry ``j`` (in closing order) closed at stream index ``entry_end[j]`` in segment
    ``entry_segment[j]``; ``-1`` marks an empty slot. There are ``max_length // m`` slots, one
    per possible window, so entries can never overflow once ``length <= max_length`` holds.
    """

    length: Int[Array, " batch"]
    position: Int[Array, " batch"]
    segment: Int[Array, " batch"]
    window_kv: Float[Array, "batch ring dim"]
    window_segment: Int[Array, "batch ring"]
    entry_end: Int[Array, "batch slots"]
    entry_segment: Int[Array, "batch slots"]
    entry_count: Int[Array, " batch"]
    compressor: CompressorState | None
    indexer: CompressorState | None
    max_length: int = eqx.field(static=True)


class V32Cache(eqx.Module):
    """State of one V3.2 layer: the MLA latent ``[c_kv ; k_rope]`` and the indexer key of every
    token so far, and each token's segment (``-1`` = not written)."""

    length: Int[Array, " batch"]
    position: Int[Array, " batch"]
    segment: Int[Array, " batch"]
    latent: Float[Array, "batch max_length latent"]
    index_keys: Float[Array, "batch max_length index_dim"]
    token_segment: Int[Array, "batch max_length"]
    max_length: int = eqx.field(static=True)


def _rows(batch: int) -> tuple[Array, Array, Array]:
    """Fresh ``length``, ``position`` and ``segment`` (distinct buffers, so each is donatable)."""
    return tuple(jnp.zeros((batch,), jnp.int32) for _ in range(3))


def _compressor_state(compressor, batch: int, slots: int, dtype) -> CompressorState:
    m = compressor.compress_rate
    width, dim = compressor.kv_proj.shape[0], compressor.kv_norm.shape[0]
    ring = 2 * m if compressor.overlap else m
    return CompressorState(
        jnp.zeros((batch, ring, width), dtype),
        jnp.zeros((batch, ring, width), dtype),
        jnp.zeros((batch, slots, dim), dtype),
    )


def init_v4_cache(layer, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
    """An empty ``V4Cache`` for ``layer`` (a ``V4Attention``)."""
    c = layer.config
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(
            f"batch_size and max_length must be positive (got {batch_size}, {max_length})"
        )
    ring = c.sliding_window - 1
    slots = max_length // c.compress_rate if c.compress_rate else 0
    length, position, segment = _rows(batch_size)
    empty = jnp.full((batch_size, slots), -1, jnp.int32)  # copied below: distinct buffers
    return V4Cache(
        length=length,
        position=position,
        segment=segment,
        window_kv=jnp.zeros((batch_size, ring, c.head_dim), dtype),
        window_segment=jnp.full((batch_size, ring), -1, jnp.int32),
        entry_end=empty,
        entry_segment=jnp.copy(empty),
        entry_count=jnp.zeros((batch_size,), jnp.int32),
        compressor=None
        if layer.compressor is None
        else _compressor_state(layer.compressor, batch_size, slots, dtype),
        indexer=None
        if layer.indexer is None
        else _compressor_state(layer.indexer.compressor, batch_size, slots, dtype),
        max_length=max_length,
    )


def init_v32_cache(layer, batch_size: int, max_length: int, dtype=jnp.float32) -> V32Cache:
    """An empty ``V32Cache`` for ``layer`` (a ``V32Attention``)."""
    c = layer.config
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(
            f"batch_size and max_length must be positive (got {batch_size}, {max_length})"
        )
    length, position, segment = _rows(batch_size)
    return V32Cache(
        length=length,
        position=position,
        segment=segment,
        latent=jnp.zeros((batch_size, max_length, c.kv_lora_rank + c.qk_rope_head_dim), dtype),
        index_keys=jnp.zeros((batch_size, max_length, c.index_head_dim), dtype),
        token_segment=jnp.full((batch_size, max_length), -1, jnp.int32),
        max_length=max_length,
    )


def cache_bytes(cache: eqx.Module) -> int:
    """Bytes held by a cache's arrays."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
