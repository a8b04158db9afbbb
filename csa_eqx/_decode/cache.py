"""Decode caches: fixed-size pytrees, so one compiled decode step serves every position
(docs/concepts.md, "Decoding: prefill and decode with a cache").

Every buffer has a static shape fixed by ``max_length``; per-row progress lives in int32
arrays. A step therefore compiles once and reuses its executable, and the cache can be donated
(``eqx.filter_jit(step, donate="all-except-first")`` with the layer as first argument).

Row bookkeeping (all ``[batch]``): ``length`` tokens written so far (the *stream index* of the
next token), ``position`` the next token's position inside its segment (its RoPE position) and
``segment`` the segment id of the last written token (decoding continues it). Segment ids must
be ``>= 0``; ``-1`` marks empty slots.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._entries.compressor import AbstractCompressor

__all__ = [
    "AbstractCache",
    "CompressorState",
    "V4Cache",
    "V32Cache",
    "empty_rows",
    "check_cache_size",
    "compressor_state",
    "cache_bytes",
]


class CompressorState(eqx.Module):
    """One compressor's state: per-token ``(C, Z)`` of the last ``ring`` tokens (``2m`` for
    CSA, which covers the open window and the previous window's overlap halves; ``m`` for HCA)
    and the entries emitted so far, in closing order (docs/concepts.md, "Compressed entries").

    **Arguments:**

    - ``kv``, ``gate``: float ``[B, ring, width]`` per-token projections ``C`` and gate logits ``Z``
        (``width`` = 2 x entry dim for CSA's overlapping windows, the entry dim for HCA).
    - ``entries``: float ``[B, slots, dim]`` closed entries; slots past the count are zero.
    """

    kv: Float[Array, "batch ring width"]
    gate: Float[Array, "batch ring width"]
    entries: Float[Array, "batch slots dim"]


class AbstractCache(eqx.Module):
    """What every layer's cache holds besides its buffers: each row's progress and the
    static capacity (the module docstring's row bookkeeping).

    **Arguments:**

    - ``length``, ``position``, ``segment``: int32 ``[B]`` tokens written, the next token's position
        and the current segment of each row.
    - ``max_length``: static; the most tokens the cache holds.
    """

    length: Int[Array, " batch"]
    position: Int[Array, " batch"]
    segment: Int[Array, " batch"]
    max_length: int = eqx.field(static=True)

    @abc.abstractmethod
    def held_segments(self) -> Int[Array, "batch keys"]:
        """**Returns:** the segment ids of every key and entry the cache holds (``-1`` = empty),
        for the check that a chunk does not reopen a finished segment."""


class V4Cache(AbstractCache):
    """State of one V4 layer (sliding: window only; HCA: plus one compressor; CSA: plus the
    indexer's compressor at ``index_head_dim``).

    Entry ``j`` (in closing order) closed at stream index ``entry_end[j]`` in segment
    ``entry_segment[j]``; ``-1`` marks an empty slot. There are ``max_length // m`` slots, one
    per possible window, so entries can never overflow once ``length <= max_length`` holds.
    Made by ``V4Attention.init_cache``; ``extend`` returns the next one.

    **Arguments:**

    - ``length``, ``position``, ``segment``, ``max_length``: as in ``AbstractCache``.
    - ``window_kv``, ``window_segment``: the last ``sliding_window - 1`` tokens' keys (float
        ``[B, sliding_window - 1, head_dim]``) and segments (int32, ``-1`` = empty).
    - ``entry_end``, ``entry_segment``: int32 ``[B, slots]``; entry_count: int32 ``[B]``.
    - ``compressor``, ``indexer``: the main and the indexer's ``CompressorState`` (``None`` when
        the layer has none).
    """

    window_kv: Float[Array, "batch ring dim"]
    window_segment: Int[Array, "batch ring"]
    entry_end: Int[Array, "batch slots"]
    entry_segment: Int[Array, "batch slots"]
    entry_count: Int[Array, " batch"]
    compressor: CompressorState | None
    indexer: CompressorState | None

    def held_segments(self) -> Int[Array, "batch keys"]:
        return jnp.concatenate([self.window_segment, self.entry_segment], axis=1)


class V32Cache(AbstractCache):
    """State of one V3.2 layer: the MLA latent ``[c_kv ; k_rope]`` and the indexer key of every
    token so far, and each token's segment (``-1`` = not written). Made by
    ``V32Attention.init_cache``; ``extend`` returns the next one.

    **Arguments:**

    - ``length``, ``position``, ``segment``, ``max_length``: as in ``AbstractCache``.
    - ``latent``: float ``[B, max_length, kv_lora_rank + qk_rope_head_dim]``.
    - ``index_keys``: float ``[B, max_length, index_head_dim]``.
    - ``token_segment``: int32 ``[B, max_length]``, ``-1`` = not written.
    """

    latent: Float[Array, "batch max_length latent"]
    index_keys: Float[Array, "batch max_length index_dim"]
    token_segment: Int[Array, "batch max_length"]

    def held_segments(self) -> Int[Array, "batch keys"]:
        return self.token_segment


def empty_rows(batch: int) -> tuple[Array, Array, Array]:
    """Fresh ``length``, ``position`` and ``segment`` (distinct buffers, so each is donatable)."""
    return tuple(jnp.zeros((batch,), jnp.int32) for _ in range(3))


def check_cache_size(batch_size: int, max_length: int) -> None:
    """``ValueError`` unless both sizes are positive."""
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(
            f"batch_size and max_length must be positive (got {batch_size}, {max_length})"
        )


def compressor_state(
    compressor: AbstractCompressor | None, batch: int, slots: int, dtype
) -> CompressorState | None:
    """An empty state of ``compressor`` with ``slots`` entry slots (``None`` for no compressor):
    its ``ring`` of projected tokens and its entries (``AbstractCompressor.widths``)."""
    if compressor is None:
        return None
    width, dim = compressor.widths()
    return CompressorState(
        jnp.zeros((batch, compressor.ring, width), dtype),
        jnp.zeros((batch, compressor.ring, width), dtype),
        jnp.zeros((batch, slots, dim), dtype),
    )


def cache_bytes(cache: eqx.Module) -> int:
    """Bytes held by a cache's arrays."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
