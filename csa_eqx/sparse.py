"""Gather-based sparse attention with an optional per-head sink (no dense ``[S, T]`` mask).

Each query attends to the keys named by its own index list (``-1`` = no key). The sink adds
``exp(s_h)`` to the softmax denominator only. A query with no valid key returns zeros.

Non-finite values stay where they belong: key / value rows holding a NaN or Inf are zeroed
before both matmuls (``0 x NaN`` would otherwise reach every query that shares the matmul, and
every query's gradient), and exactly the queries that see such a row, or whose own query is
non-finite, return NaN (output and ``lse``). Every other query gets what it would get if the
bad rows held finite values.

Keys that *every* query may see once visible (HCA's compressed entries, CSA's entries in the
dense warm-up) are better attended with a plain matmul than gathered per query: pass them as
``dense=DenseKeys(...)``; their visibility is computed per query block from the entry layout,
and they share one softmax with the gathered keys. CSA's *selected* entries can go the same
way (``DenseKeys(picks=...)``, masked to each query's picks) while the entry count is a small
multiple of ``k``: a masked matmul over ``T`` entries is far cheaper than gathering ``k`` rows
per query, and its gradient needs no scatter-add. ``MaskedPicks`` / ``GatheredPicks`` force one
way, ``csa_eqx.auto.AutoPicks`` chooses.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Shaped

from .compressor import EntryLayout
from .selection import Visibility, entry_visibility, scatter_rows

__all__ = [
    "sparse_attention",
    "gather_keys",
    "sparse_query_block",
    "DenseKeys",
    "AbstractPicks",
    "GatheredPicks",
    "MaskedPicks",
    "AbstractWindow",
    "BandWindow",
    "GatheredWindow",
    "picked_mask",
]


class DenseKeys(NamedTuple):
    """Entries attended by matmul: ``keys [B, T, d]``, visible to query ``t`` per
    ``entry_visibility(query_index, query_segment, layout)``; ``values [B, T, vdim]`` default to
    the keys (V4) and are separate for MLA (V3.2). With ``picks [B, S, p]`` (distinct entry
    slots, ``-1`` = none) a query attends only to its visible picks (docs/concepts.md,
    "Sparse attention without a dense mask").

    Arguments:
        keys: float ``[B, T, d]``; values: float ``[B, T, vdim]`` or ``None`` (= ``keys``).
        layout: the entries' ``EntryLayout``.
        query_index, query_segment: int32 ``[B, S]``, as in ``Visibility``.
        picks: int32 ``[B, S, p]`` or ``None`` (every visible entry).
    """

    keys: Float[Array, "batch entries dim"]
    layout: EntryLayout
    query_index: Int[Array, "batch seq"]
    query_segment: Int[Array, "batch seq"]
    values: Float[Array, "batch entries vdim"] | None = None
    picks: Int[Array, "batch seq picks"] | None = None


class AbstractPicks(eqx.Module):
    """How the attention reads each query's picked entries (CSA's, V3.2's selection)."""

    @abc.abstractmethod
    def parts(
        self,
        keys: Float[Array, "batch entries dim"],
        visibility: Visibility,
        picks: Int[Array, "batch seq k"],
        values: Float[Array, "batch entries vdim"] | None = None,
    ) -> tuple[DenseKeys | None, Int[Array, "batch seq n"]]:
        """Arguments: the entries' ``keys`` (and MLA ``values``), their ``visibility`` and each
        query's distinct ``picks`` (``-1`` = none).

        Returns: ``(dense, indices)`` for ``sparse_attention``: entries attended by matmul
        (or ``None``) and per-query indices into ``keys`` to gather (``[B, S, 0]`` when none).
        """


class GatheredPicks(AbstractPicks):
    """Gather each query's ``k`` picked keys (``[B, Qb, k, d]`` per query block); cheap
    while ``k`` is small against the entry count. Arguments: none."""

    def parts(self, keys, visibility, picks, values=None):
        return None, picks


class MaskedPicks(AbstractPicks):
    """One matmul over all entries, masked to each query's visible picks; cheaper than
    gathering when ``k`` is close to the entry count (short sequences). Arguments: none."""

    def parts(self, keys, visibility, picks, values=None):
        dense = DenseKeys(keys, visibility.layout, *visibility[:2], values, picks)
        return dense, picks[..., :0]


class AbstractWindow(eqx.Module):
    """How the attention reads each query's sliding window of raw tokens: the forward over
    the sequence's own rows, ``extend`` over ``[ring ; chunk]`` rows (the ``window - 1``
    cached tokens before the chunk, then the chunk's own)."""

    @abc.abstractmethod
    def parts(
        self,
        query_index: Int[Array, "batch seq"],
        segment: Int[Array, "batch seq"],
        window: int,
        history: Int[Array, "batch ring"] | None = None,
    ) -> tuple[Int[Array, "batch seq n"], int]:
        """Arguments: the queries' own token rows and segments, the window length and the
        segments of the ``window - 1`` earlier tokens stored before the queries' rows
        (``extend``'s ring, ``-1`` = empty; ``None``: nothing precedes them).

        Returns: ``(indices, band)`` for ``sparse_attention``: per-query indices of window
        tokens to gather (``[B, S, 0]`` when none; ``-1`` = none; rows counted from the first
        ``history`` row) and the ``window=`` of a banded matmul (0 = none; pass ``history`` as
        its ``window_history``).
        """


class BandWindow(AbstractWindow):
    """One banded matmul per query block over a slab of ``block + window - 1`` token rows
    (for a single decoded token: its ``window`` rows, what a gather reads). Arguments: none."""

    def parts(self, query_index, segment, window, history=None):
        return jnp.zeros((*query_index.shape, 0), jnp.int32), window


class GatheredWindow(AbstractWindow):
    """Gather each query's ``window`` token rows (``t - window < j <= t``, same segment).
    Arguments: none."""

    def parts(self, query_index, segment, window, history=None):
        b, s = query_index.shape
        before = 0 if history is None else history.shape[1]
        keys = segment if history is None else jnp.concatenate([history, segment], axis=1)
        idx = before + query_index[..., None] - jnp.arange(window, dtype=jnp.int32)
        flat = jnp.clip(idx, 0, before + s - 1).reshape(b, -1)
        key_segment = jnp.take_along_axis(keys, flat, axis=1).reshape(idx.shape)
        keep = (idx >= 0) & (key_segment == segment[..., None])
        return jnp.where(keep, idx, -1), 0


def picked_mask(
    picks: Int[Array, "batch seq p"], entries: int
) -> Bool[Array, "batch seq {entries}"]:
    """Arguments: int32 ``picks [B, S, p]`` (``-1`` picks nothing) and the entry count ``T``.

    Returns: bool ``[B, S, T]``, ``mask[b, s, j]`` = entry ``j`` is among ``picks[b, s]``.
    """
    slot = jnp.where(picks >= 0, picks, entries)  # out of range: dropped
    return scatter_rows(slot, jnp.ones(picks.shape, bool), entries, False)


_BLOCK_ELEMENTS = 1 << 24


def gather_keys(kv: Shaped[Array, "batch keys dim"], indices: Int[Array, "batch seq k"]) -> Array:
    """Arguments: ``kv [B, N, dim]`` and int32 ``indices [B, S, k]``.

    Returns: ``kv[b, indices[b, s, i]]`` as ``[B, S, k, dim]`` (``-1`` reads row 0; mask it).
    """
    b, s, k = indices.shape
    flat = jnp.clip(indices, 0, kv.shape[1] - 1).reshape(b, s * k)
    return jnp.take_along_axis(kv, flat[..., None], axis=1).reshape(b, s, k, kv.shape[-1])


def sparse_query_block(batch: int, heads: int, dim: int, k: int, entries: int = 0) -> int:
    """Automatic query block: keeps the gathered ``[B, Qb, k, dim]`` keys (and values) plus
    the ``[B, Qb, H, k]`` logits of one block, and the ``[B, Qb, H, entries]`` logits and mask
    of entries attended by matmul, near 64 MiB of float32.

    Arguments: the sizes (``entries``: those attended by matmul, 0 = none).

    Returns: the query block, a power of two >= 1.
    """
    per_row = k * (dim + heads) + entries * (heads + 1)
    rows = max(_BLOCK_ELEMENTS // max(batch * per_row, 1), 1)
    return 1 << (rows.bit_length() - 1)


def sparse_attention(
    q: Float[Array, "batch seq heads dim"],
    kv: Float[Array, "batch keys dim"],
    indices: Int[Array, "batch seq k"],
    sinks: Float[Array, " heads"] | None,
    scale: float,
    values: Float[Array, "batch keys vdim"] | None = None,
    return_lse: bool = False,
    *,
    query_block: int = 0,
    dense: DenseKeys | None = None,
    window: int = 0,
    segment: Int[Array, "batch seq"] | None = None,
    window_history: Int[Array, "batch ring"] | None = None,
) -> (
    Float[Array, "batch seq heads vdim"]
    | tuple[Float[Array, "batch seq heads vdim"], Float[Array, "batch seq heads"]]
):
    """Softmax attention of each query over its selected keys (shared across heads).

    ``values`` defaults to ``kv`` (V4's key = value); pass it for MLA's separate values.
    ``return_lse=True`` also returns each head's float32 log-normaliser (log of the softmax
    denominator, sink included; ``-inf`` for a row with neither keys nor sink), which the
    indexer's KL target needs to rebuild the attention probabilities.

    Queries are processed ``query_block`` rows at a time (0 = automatic, see
    ``sparse_query_block``) in a ``lax.map`` with a rematerialised body, so the gathered
    ``[B, S, k, dim]`` keys never exist at once, in the forward or the backward pass.

    ``dense`` adds entries every query attends to (when visible) through a matmul, in the
    same softmax (their values: ``dense.values``, else the keys as in V4).

    ``window > 0`` adds a sliding window by a banded matmul instead of a gather: query ``t``
    also sees tokens ``t - window < j <= t`` in its own ``segment`` (ids ``[B, S]``); rows
    ``0..S-1`` of ``kv`` (and ``values``) must be the queries' own tokens. With
    ``window_history`` (segment ids ``[B, window - 1]`` of the tokens just before the
    queries, ``-1`` = none: ``extend``'s ring) those tokens are rows ``0..window-2`` of
    ``kv`` and the queries' own follow. Each query block then reads one slab of
    ``query_block + window - 1`` rows.

    Arguments:
        q: queries ``[B, S, H, d]``.
        kv: keys ``[B, N, d]`` shared by all heads (V4: also the values).
        indices: int ``[B, S, k]`` rows of ``kv`` each query gathers (``-1`` = none).
        sinks: per-head sink logits ``[H]`` (denominator only), or ``None``.
        scale: softmax scale.
        values: ``[B, N, vdim]`` (MLA), default ``kv``.
        return_lse: also return the log-normalisers.
        query_block, dense, window, segment, window_history: as above (docs/concepts.md,
            "Sparse attention without a dense mask").

    Returns:
        ``[B, S, H, vdim]`` in ``q``'s dtype (zeros for a query with no key); with
        ``return_lse``, ``(out, lse)`` with float32 ``lse`` ``[B, S, H]``.
    """
    b, s, h, d = q.shape
    if window and segment is None:
        raise ValueError("a sliding window needs the tokens' segment ids (segment=...)")
    width = d if values is None else d + values.shape[-1]  # gathered keys (+ values) per pick
    entries = 0 if dense is None else dense.keys.shape[1]
    qb = query_block or sparse_query_block(b, h, width, indices.shape[-1], entries)
    if window and not query_block:  # a slab of qb + window - 1 rows: keep qb near the window
        qb = min(qb, 1 << max(window - 1, 1).bit_length())
    qb = min(qb, s) if s else 1
    n = -(-s // qb)
    # non-finite rows: zeroed for the matmuls, flagged to poison exactly the queries seeing them
    q_bad = ~jnp.all(jnp.isfinite(q), axis=(2, 3))
    q = _zero_rows(q, q_bad)
    kv_bad = _nonfinite_rows(kv, values)
    kv, values = _zero_rows(kv, kv_bad), _zero_rows(values, kv_bad)
    if dense is not None:
        dense_bad = _nonfinite_rows(dense.keys, dense.values)
        dense = dense._replace(
            keys=_zero_rows(dense.keys, dense_bad), values=_zero_rows(dense.values, dense_bad)
        )
    band = None
    if window:  # kv rows (and segments) padded so that every block's slab is in range
        before = 0 if window_history is None else window - 1  # rows before the queries' own
        if before and window_history.shape[1] != before:
            raise ValueError(
                f"window_history must have window - 1 = {before} rows "
                f"(got shape {tuple(window_history.shape)})"
            )
        pad = [(0, 0), (window - 1 - before, n * qb - s)]
        key_segment = segment if not before else jnp.concatenate([window_history, segment], 1)
        band = (
            jnp.pad(kv[:, : before + s], pad + [(0, 0)]),
            None if values is None else jnp.pad(values[:, : before + s], pad + [(0, 0)]),
            jnp.pad(key_segment, pad, constant_values=-1),
            jnp.pad(kv_bad[:, : before + s], pad),
            before,
        )

    def body(start: Array, r: dict[str, Array]):
        parts = []
        if indices.shape[-1] or not (window or dense):
            keys = gather_keys(kv, r["indices"])
            vals = keys if values is None else gather_keys(values, r["indices"])
            bad = gather_keys(kv_bad[..., None], r["indices"])[..., 0]
            parts.append((keys, vals, r["indices"] >= 0, bad, True))
        if band is not None:
            parts.append(_band_part(band, start, r["segment"], window, s))
        if dense is not None:
            visible = entry_visibility(r["query_index"], r["query_segment"], dense.layout)
            if dense.picks is not None:
                visible &= picked_mask(r["picks"], dense.keys.shape[1])
            vals = dense.keys if dense.values is None else dense.values
            parts.append((dense.keys, vals, visible, dense_bad, False))
        return _attend(r["q"], r["q_bad"], parts, sinks, scale, return_lse)

    rows = {"q": q, "q_bad": q_bad, "indices": indices}
    if window:
        rows["segment"] = segment
    if dense is not None:
        rows.update(query_index=dense.query_index, query_segment=dense.query_segment)
        if dense.picks is not None:
            rows["picks"] = dense.picks
    if n <= 1:
        return body(jnp.int32(0), rows)

    def blocks(x: Array) -> Array:
        fill = -1 if jnp.issubdtype(x.dtype, jnp.integer) else 0  # padded rows see no key
        x = jnp.pad(x, [(0, 0), (0, n * qb - s)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(b, n, qb, *x.shape[2:]), 1, 0)

    def unblocks(y: Array) -> Array:
        return jnp.moveaxis(y, 0, 1).reshape(b, n * qb, *y.shape[3:])[:, :s]

    starts = jnp.arange(n, dtype=jnp.int32) * qb
    blocked = {name: blocks(x) for name, x in rows.items()}
    out = jax.lax.map(jax.checkpoint(lambda x: body(*x)), (starts, blocked))
    return jax.tree.map(unblocks, out)


def _band_part(band, start: Array, query_segment: Array, window: int, seq: int):
    """Keys, values and mask of the sliding-window slab of the query block starting at row
    ``start``: padded rows ``start .. start + rows + window - 2``, i.e. tokens
    ``start - window + 1 .. start + rows - 1`` (those before the first query are real rows
    only for the ``before`` rows of a window history)."""
    kv, values, key_segment, key_bad, before = band
    rows = query_segment.shape[1]
    size = rows + window - 1
    keys = jax.lax.dynamic_slice_in_dim(kv, start, size, axis=1)
    vals = keys if values is None else jax.lax.dynamic_slice_in_dim(values, start, size, axis=1)
    key_segment = jax.lax.dynamic_slice_in_dim(key_segment, start, size, axis=1)
    key_bad = jax.lax.dynamic_slice_in_dim(key_bad, start, size, axis=1)
    row = start + jnp.arange(rows)
    token = start - window + 1 + jnp.arange(size)
    lag = row[:, None] - token[None, :]  # [rows, size]
    mask = (token >= -before) & (lag >= 0) & (lag < window) & (row < seq)[:, None]
    mask = mask[None] & (key_segment[:, None, :] == query_segment[:, :, None])
    return keys, vals, mask, key_bad, False


def _nonfinite_rows(keys: Array, values: Array | None) -> Bool[Array, "batch rows"]:
    """Rows of ``keys`` (or of ``values``) holding a NaN or an Inf."""
    bad = ~jnp.all(jnp.isfinite(keys), axis=-1)
    return bad if values is None else bad | ~jnp.all(jnp.isfinite(values), axis=-1)


def _zero_rows(x: Array | None, bad: Array) -> Array | None:
    """``x`` with the rows flagged in ``bad`` (its leading axes) set to zero."""
    if x is None:
        return None
    return jnp.where(bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim)), 0, x)


def _attend(q, q_bad, parts, sinks, scale, return_lse):
    """Attention of one block of queries over ``parts``: ``(keys, values, mask, bad,
    per_query)`` with keys ``[B, S, n, d]`` gathered per query (``per_query``) or ``[B, n, d]``
    shared by the block, mask ``[B, S, n]`` and ``bad`` the (zeroed) non-finite key rows; one
    softmax over all parts (see ``sparse_attention``). Queries flagged in ``q_bad`` or seeing a
    bad row return NaN."""
    acc = jnp.promote_types(q.dtype, jnp.float32)
    poisoned = q_bad
    logits = []
    for keys, _, mask, bad, per_query in parts:
        poisoned |= jnp.any(mask & (bad if per_query else bad[:, None, :]), axis=-1)
        spec = "bshd,bskd->bshk" if per_query else "bshd,bkd->bshk"
        part = jnp.einsum(spec, q, keys.astype(q.dtype), preferred_element_type=acc) * scale
        logits.append(jnp.where(mask[:, :, None, :], part, -jnp.inf))
    logits = jnp.concatenate(logits, axis=-1)
    peak = jnp.max(logits, axis=-1)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(peak.dtype), peak.shape)
        peak = jnp.maximum(peak, sink)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - peak)
    probs = p / jnp.where(denom > 0, denom, 1.0)[..., None]
    out, offset = 0.0, 0
    for keys, vals, _, _, per_query in parts:
        n = keys.shape[-2]
        spec = "bshk,bskd->bshd" if per_query else "bshk,bkd->bshd"
        p_part = probs[..., offset : offset + n].astype(vals.dtype)
        out = out + jnp.einsum(spec, p_part, vals, preferred_element_type=probs.dtype)
        offset += n
    out = jnp.where(poisoned[:, :, None, None], jnp.nan, out).astype(q.dtype)
    if return_lse:
        return out, jnp.where(poisoned[..., None], jnp.nan, peak + jnp.log(denom))
    return out
