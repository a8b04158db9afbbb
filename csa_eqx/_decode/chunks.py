"""Chunk bookkeeping of the incremental forward (prefill, chunked prefill, decode) shared by
``V4Attention.extend`` and ``V32Attention.extend`` over the caches of ``csa_eqx._decode.cache``.

``extend`` runs a chunk ``x [B, T, D]`` that follows what the cache already holds and returns
exactly what the full forward over the whole stream returns for those tokens (docs/concepts.md,
"Decoding: prefill and decode with a cache").

* ``lengths [B]`` (integer, ``0..T``): real tokens per row in this chunk (right padding). Padded
  tokens are not written and their outputs are unspecified; each row continues at its own
  position. A chunk of ``T = 0`` tokens returns ``[B, 0, D]`` and the cache unchanged.
* ``segment_ids [B, T]`` (integer, ``>= 0`` on real tokens): packed documents, contiguous runs.
  The first token of the chunk continues the cache's last segment when its id equals it;
  positions restart at each new segment, compression windows are aligned to segment starts and
  no token sees another segment's keys or entries, as in the full forward. ``None`` continues
  the last segment. A new document may not reuse the id of a document the cache still holds
  keys or entries of (it would see them).
* Inputs are checked before any compute (``csa_eqx._checks``): ``x``'s dtype, rank,
  batch (the cache's) and hidden size, the cache's kind, ``lengths`` and ``segment_ids`` as above.
* Entry ``j`` of the cache is the ``j``-th window that closed in the row; a window closes at the
  token with ``(position + 1) % m == 0`` and is visible to that token. Its slot order is the
  closing order, so top-k ties still go to the earlier entry.
* RoPE positions are the index inside the segment (the full forward's default positions).
* Writing past ``max_length`` raises, naming the cache, its ``max_length`` and the fix
  (``init_cache`` with room for every token a row will hold): a chunk longer than
  ``max_length``, or a concrete cache (an eager call) without room, at trace time
  (``ValueError``); otherwise at run time through ``eqx.error_if`` (``EquinoxRuntimeError``
  under ``eqx.filter_jit``; a donated cache is then gone). Nothing wraps around or is silently
  dropped. Run ``extend`` under ``eqx.filter_jit``: under a plain ``jax.jit`` these run-time
  errors (overflow, ``lengths`` or ``segment_ids`` values) arrive inside an ``INTERNAL:
  CpuCallback error`` (the message after ``_EquinoxRuntimeError:``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from .._checks import checked_now, require
from .._entries.compressor import pool_windows
from .._layout import EntryLayout
from .cache import AbstractCache, CompressorState

__all__ = [
    "ChunkRows",
    "chunk_rows",
    "shift_in",
    "append_rows",
    "closing_layout",
    "compress_chunk",
    "ChunkSource",
]


class ChunkRows(eqx.Module):
    """Where each token of a chunk sits: ``valid``, segment, RoPE position and stream index
    (all ``[B, T]``), plus the cache's bookkeeping after the chunk (``[B]``)."""

    valid: Bool[Array, "batch seq"]
    segment: Int[Array, "batch seq"]
    position: Int[Array, "batch seq"]
    index: Int[Array, "batch seq"]
    lengths: Int[Array, " batch"]
    new_length: Int[Array, " batch"]
    new_position: Int[Array, " batch"]
    new_segment: Int[Array, " batch"]


def chunk_rows(
    cache: AbstractCache,
    seq: int,
    lengths: Int[ArrayLike, " batch"] | None,
    segment_ids: Int[ArrayLike, "batch seq"] | None,
) -> ChunkRows:
    """Segments, positions and stream indices of a chunk of ``seq`` tokens after ``cache``;
    checks that the chunk fits in ``max_length`` (static shapes, then the rows' lengths: now
    when they are concrete, else at run time)."""
    cache_name = f"the {type(cache).__name__}'s max_length={cache.max_length}"
    fix = (
        "make the cache with room for every token a row will hold: "
        "layer.init_cache(batch_size, max_length=...) (in generate: max_length=...)"
    )
    if seq > cache.max_length:
        raise ValueError(
            f"decode cache overflow: a chunk of {seq} tokens is longer than {cache_name}; {fix}"
        )
    b = cache.length.shape[0]
    idx = jnp.arange(seq, dtype=jnp.int32)
    with checked_now(cache.length, lengths):
        n = jnp.full((b,), seq, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        n = jnp.clip(n, 0, seq)
        after = cache.length + n
        message = f"decode cache overflow: a row would hold more tokens than {cache_name}; {fix}"
        new_length = require(after, after > cache.max_length, message, after, "row lengths ")
    valid = idx < n[:, None]
    if segment_ids is None:
        seg = jnp.broadcast_to(cache.segment[:, None], (b, seq))
    else:
        seg = jnp.asarray(segment_ids, jnp.int32)
    previous = jnp.concatenate([cache.segment[:, None], seg[:, :-1]], axis=1)
    starts = seg != previous
    first = jnp.maximum(
        jax.lax.cummax(jnp.where(starts, idx, -(2**30)), axis=1), -cache.position[:, None]
    )
    pos = idx - first
    seg = jnp.where(valid, seg, -1)
    last = jnp.maximum(n - 1, 0)[:, None]
    some = n > 0
    return ChunkRows(
        valid=valid,
        segment=seg,
        position=pos,
        index=cache.length[:, None] + idx,
        lengths=n,
        new_length=new_length,
        new_position=jnp.where(some, jnp.take_along_axis(pos, last, 1)[:, 0] + 1, cache.position),
        new_segment=jnp.where(some, jnp.take_along_axis(seg, last, 1)[:, 0], cache.segment),
    )


def shift_in(old: Array, new: Array, n: Int[Array, " batch"]) -> Array:
    """The last ``old.shape[1]`` rows of ``concat(old, new[:, :n])`` per row (a ring as a
    shift register: the newest row last)."""
    ring = old.shape[1]
    both = jnp.concatenate([old, new.astype(old.dtype)], axis=1)
    rows = n[:, None] + jnp.arange(ring, dtype=jnp.int32)
    shape = rows.shape + (1,) * (both.ndim - 2)
    return jnp.take_along_axis(both, rows.reshape(shape), axis=1)


def append_rows(
    buffer: Array, values: Array, start: Int[Array, " batch"], count: Int[Array, " batch"]
) -> Array:
    """Write ``values[:, i]`` to ``buffer[:, start + i]`` for ``i < count`` (per row)."""
    i = jnp.arange(values.shape[1], dtype=jnp.int32)
    slot = jnp.where(i < count[:, None], start[:, None] + i, buffer.shape[1])
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, slot].set(values.astype(buffer.dtype), mode="drop")


def closing_layout(rows: ChunkRows, ring: int, m: int) -> tuple[EntryLayout, Array]:
    """Windows closing in this chunk, in ``ceil(T/m)`` slots (closes are ``>= m`` apart), as an
    ``EntryLayout`` over ``concat(ring, chunk)``; also how many closed per row."""
    b, seq = rows.valid.shape
    slots = -(-seq // m)
    closes = rows.valid & ((rows.position + 1) % m == 0)
    rank = jnp.where(closes, jnp.cumsum(closes, axis=1, dtype=jnp.int32) - 1, slots)
    batch = jnp.arange(b)[:, None]

    def scatter(values: Array) -> Array:
        return jnp.full((b, slots), -1, jnp.int32).at[batch, rank].set(values, mode="drop")

    end = scatter(ring + jnp.arange(seq, dtype=jnp.int32))
    has_prior = (end >= 0) & (scatter(rows.position) >= 2 * m - 1)
    # int32 counts, the cache's, under jax_enable_x64 too
    return EntryLayout(end, scatter(rows.segment), has_prior), jnp.sum(closes, 1, dtype=jnp.int32)


def compress_chunk(
    compressor: eqx.Module,
    state: CompressorState,
    x: Array,
    rows: ChunkRows,
    cache_position: Int[Array, " batch"],
    layout: EntryLayout,
    start: Array,
    count: Array,
    dtype,
    finish: Callable[[Array], Array],
    numerics,
) -> CompressorState:
    """Pool the windows closing in this chunk, append them, and shift the chunk into the ring.
    ``compressor`` is a ``csa_eqx.Compressor`` or anything with its ``project``, ``finish``,
    ``position_bias``, ``overlap`` and ``compress_rate`` (V4.1's ``V41Compressor``).
    ``dtype`` and ``finish`` are the layer numerics' (``Compressor.finish``'s cast before the
    norm, then the entries' rounding), applied once, as entries are written; ``numerics`` the
    layer's (the compressor's projections)."""
    kv, gate = compressor.project(x, numerics)
    ring = state.kv.shape[1]
    both_kv = jnp.concatenate([state.kv, kv.astype(state.kv.dtype)], axis=1)
    both_gate = jnp.concatenate([state.gate, gate.astype(state.gate.dtype)], axis=1)
    # ring tokens that can start a window here belong to the cache's current segment
    ring_pos = cache_position[:, None] - ring + jnp.arange(ring, dtype=jnp.int32)
    positions = jnp.concatenate([ring_pos, rows.position], axis=1)
    pooled = pool_windows(both_kv, both_gate, compressor.position_bias, layout, compressor.overlap)
    entries = finish(compressor.finish(pooled, positions, layout, dtype, numerics))
    return CompressorState(
        kv=shift_in(state.kv, kv, rows.lengths),
        gate=shift_in(state.gate, gate, rows.lengths),
        entries=append_rows(state.entries, entries, start, count),
    )


class ChunkSource(eqx.Module):
    """The keys seen so far for ``extend``: what ``cache`` holds and the chunk's own
    (``[cache ; chunk]``), read through the same calls as the forward's ``Rows`` (see
    ``csa_eqx._rows``), so each layer writes its pipeline once. Each read returns the source
    with what the chunk wrote; ``cache_after()`` is the cache after the chunk.

    **Arguments:**

    - ``cache``: the layer's cache before the chunk.
    - ``rows``: the chunk's ``ChunkRows``.
    - ``new``: the cache fields written so far (``dataclasses.replace`` of ``cache``).
    - ``closing``: the windows closing in the chunk (``closing_layout``) once the first
        compressor has pooled them, else ``None``.
    """

    cache: AbstractCache
    rows: ChunkRows
    new: dict
    closing: tuple[EntryLayout, Array] | None = None

    @classmethod
    def start(cls, cache: AbstractCache, rows: ChunkRows) -> ChunkSource:
        """**Arguments:** the ``cache`` and the chunk's ``rows``.

        **Returns:** the source of a chunk, the rows' bookkeeping (length, position, segment)
        already written."""
        return cls(
            cache,
            rows,
            dict(length=rows.new_length, position=rows.new_position, segment=rows.new_segment),
        )

    @property
    def positions(self) -> Int[Array, "batch seq"]:
        """**Returns:** the chunk's RoPE positions ``[B, T]``."""
        return self.rows.position

    @property
    def segment(self) -> Int[Array, "batch seq"]:
        """**Returns:** the chunk's segment ids ``[B, T]`` (``-1``: padding)."""
        return self.rows.segment

    @property
    def query_index(self) -> Int[Array, "batch seq"]:
        """**Returns:** the chunk's stream indices ``[B, T]``."""
        return self.rows.index

    def _with(self, **new) -> ChunkSource:
        return dataclasses.replace(self, new={**self.new, **new})

    def window_reads(self, window, kv: Array, width: int) -> tuple:
        """The sliding window over ``[ring ; chunk]`` rows (``BandRows(history=...)``).

        **Arguments:** the layer's window strategy, the chunk's keys ``kv [B, T, d]`` and the
        window length.

        **Returns:** ``(reads, source)``, the chunk shifted into the ring.
        """
        cache, rows = self.cache, self.rows
        b, seq = rows.segment.shape
        local = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
        keys = jnp.concatenate([cache.window_kv, kv.astype(cache.window_kv.dtype)], axis=1)
        reads = window.reads(
            keys.astype(kv.dtype), local, rows.segment, width, cache.window_segment
        )
        return reads, self._with(
            window_kv=shift_in(cache.window_kv, kv, rows.lengths),
            window_segment=shift_in(cache.window_segment, rows.segment, rows.lengths),
        )

    def entries(
        self, name: str, compressor: eqx.Module, x: Array, dtype, finish, numerics
    ) -> tuple:
        """Every compressed entry so far: the cache's and the windows closing in this chunk,
        pooled from the compressor state ``cache.<name>`` and the chunk (``compress_chunk``).

        **Arguments:** the cache field of the compressor's state, the ``compressor``, its input
        ``x [B, T, hidden]``, the numerics' ``dtype``, ``finish`` and the layer's ``numerics``
        (as ``compress_chunk``).

        **Returns:** ``(entries [B, slots, d], layout, source)``: entries in closing order over
        the stream's rows, the new state and the entry bookkeeping written.
        """
        cache, rows = self.cache, self.rows
        state = getattr(cache, name)
        source = self if self.closing is not None else self._closed(state.kv.shape[1], compressor)
        closing, count = source.closing
        args = (x, rows, cache.position, closing, cache.entry_count, count, dtype, finish, numerics)
        state = compress_chunk(compressor, state, *args)
        end = source.new["entry_end"]
        layout = EntryLayout(end, source.new["entry_segment"], end >= 0)
        return state.entries, layout, source._with(**{name: state})

    def _closed(self, ring: int, compressor: eqx.Module) -> ChunkSource:
        """The windows closing in this chunk and the entry bookkeeping after it, once per chunk
        (every compressor of a layer closes the same windows)."""
        cache, rows = self.cache, self.rows
        closing, count = closing_layout(rows, ring, compressor.compress_rate)
        start = cache.entry_count
        end = jnp.where(closing.end >= 0, closing.end - ring + cache.length[:, None], -1)
        source = self._with(
            entry_end=append_rows(cache.entry_end, end, start, count),
            entry_segment=append_rows(cache.entry_segment, closing.segment, start, count),
            entry_count=start + count,
        )
        return dataclasses.replace(source, closing=(closing, count))

    def tokens(self, name: str, values: Array) -> tuple:
        """Every token's ``values`` so far: the chunk's appended to the buffer ``cache.<name>``
        (V3.2's latents and indexer keys; every token is an entry).

        **Arguments:** the cache field and the chunk's ``values [B, T, d]``.

        **Returns:** ``(values [B, max_length, d], layout, source)``: the written slots are the
        stream indices.
        """
        cache, rows = self.cache, self.rows
        buffer = append_rows(getattr(cache, name), values, cache.length, rows.lengths)
        token_segment = self.new.get("token_segment")  # written once per chunk
        if token_segment is None:
            token_segment = append_rows(
                cache.token_segment, rows.segment, cache.length, rows.lengths
            )
        slots = jnp.arange(buffer.shape[1], dtype=jnp.int32)
        written = slots < rows.new_length[:, None]
        layout = EntryLayout(jnp.where(written, slots, -1), token_segment, written)
        return buffer, layout, self._with(**{name: buffer}, token_segment=token_segment)

    def cache_after(self) -> AbstractCache:
        """**Returns:** the cache after the chunk."""
        return dataclasses.replace(self.cache, **self.new)
