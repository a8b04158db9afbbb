"""The reference attention kernel: XLA gathers, banded and dense matmuls, one softmax per
block of queries in a rematerialised ``lax.map`` (docs/concepts.md, "Sparse attention without
a dense mask"; docs/memory.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._layout import entry_visibility
from .._ops import round_to
from .._tiles import map_row_blocks
from .base import AbstractAttentionKernel, require_keys
from .reads import Reads, gather_keys, nonfinite_rows, picked_mask, zero_rows

__all__ = ["XlaAttention"]


class XlaAttention(AbstractAttentionKernel):
    """The reference kernel (the default ``Execution.attention``). Queries run
    ``query_block`` rows at a time in a ``lax.map`` with a rematerialised body, so the
    gathered ``[B, S, n, d]`` keys never exist at once, in the forward or the backward pass;
    each block gathers its ``GatheredRows``, slices its band slab of ``block + window - 1``
    rows and masks the dense entries' visibility (and picks) for its queries; all of them share
    one softmax. Non-finite key / value rows are zeroed before both matmuls (``0 x NaN`` would
    reach every query of the matmul) and flagged to poison exactly the queries that see them.
    **Arguments:** none."""

    def attend(
        self, q, reads: Reads, sinks, scale, *, return_lse=False, query_block, numerics=None
    ):
        b, s, h, d = q.shape
        require_keys(reads)
        qb = min(query_block, s) if s else 1
        n = -(-s // qb)
        # non-finite rows: zeroed for the matmuls, flagged to poison exactly the queries seeing them
        q_bad = ~jnp.all(jnp.isfinite(q), axis=(2, 3))
        q = zero_rows(q, q_bad)
        # the band's and the gathered sets' key rows: one zeroed table (one gather per block)
        band = reads.band
        sources = [] if band is None else [(band.keys, band.values)]
        sources += [(g.keys, g.value_rows()) for g in reads.gathered]
        tables, slots = _key_tables(sources)
        gathered, indices = {}, {}  # per table: its arrays and the concatenated indices
        gathered_slots = slots[len(sources) - len(reads.gathered) :]
        for g, (table, offset) in zip(reads.gathered, gathered_slots, strict=True):
            idx = g.indices if not offset else jnp.where(g.indices >= 0, g.indices + offset, -1)
            gathered[table] = tables[table]
            indices[table] = indices.get(table, ()) + (idx,)
        indices = [jnp.concatenate(i, axis=-1) if len(i) > 1 else i[0] for i in indices.values()]
        gathered = list(gathered.values())
        rows = {"q": q, "q_bad": q_bad, "indices": tuple(indices)}
        if band is not None:  # rows (and segments) padded so that every block's slab is in range
            window = band.window
            before = 0 if band.history is None else window - 1  # rows before the queries' own
            keys, values, bad = tables[slots[0][0]]  # the band's rows come first in its table
            pad = [(0, 0), (window - 1 - before, n * qb - s)]
            key_segment = band.segment
            if before:
                key_segment = jnp.concatenate([band.history, band.segment], 1)
            band = (
                jnp.pad(keys[:, : before + s], pad + [(0, 0)]),
                None if values is None else jnp.pad(values[:, : before + s], pad + [(0, 0)]),
                jnp.pad(key_segment, pad, constant_values=-1),
                jnp.pad(bad[:, : before + s], pad),
                before,
                window,
            )
            rows["segment"] = reads.band.segment
        dense = reads.dense
        if dense is not None:
            dense_values = dense.value_rows()
            dense_bad = nonfinite_rows(dense.keys, dense_values)
            dense = dense._replace(
                keys=zero_rows(dense.keys, dense_bad),
                values=zero_rows(dense_values, dense_bad),
                value_width=None,
            )
            rows.update(query_index=dense.query_index, query_segment=dense.query_segment)
            if dense.picks is not None:
                rows["picks"] = dense.picks

        def body(start: Array, r: dict):
            parts = []
            for (keys, values, bad), idx in zip(gathered, r["indices"], strict=True):
                picked = gather_keys(keys, idx)
                vals = picked if values is None else gather_keys(values, idx)
                bad = gather_keys(bad[..., None], idx)[..., 0]
                parts.append((picked, vals, idx >= 0, bad, True))
            if band is not None:
                parts.append(_band_part(band, start, r["segment"], s))
            if dense is not None:
                visible = entry_visibility(r["query_index"], r["query_segment"], dense.layout)
                if dense.picks is not None:
                    visible &= picked_mask(r["picks"], dense.keys.shape[1])
                vals = dense.keys if dense.values is None else dense.values
                parts.append((dense.keys, vals, visible, dense_bad, False))
            return _attend(r["q"], r["q_bad"], parts, sinks, scale, return_lse, numerics)

        return map_row_blocks(body, rows, qb)


def _key_tables(sources: list) -> tuple[list, list]:
    """Zeroed key tables for the ``(keys, values)`` of the band and the gathered read sets:
    one table when there are several sources of one key (and value) width and dtype
    (their rows concatenated in order, as one key array of the old single-``kv`` API), else
    one per distinct source (the same array read twice shares one).

    **Returns:** the tables ``(keys, values | None, bad rows)`` and, per source, ``(table, row
    offset)``.
    """
    unique, which = [], []
    for keys, values in sources:
        same = [i for i, (k, v) in enumerate(unique) if k is keys and v is values]
        which.append(same[0] if same else len(unique))
        if not same:
            unique.append((keys, values))

    def kind(keys, values):
        value = None if values is None else (values.shape[-1], values.dtype)
        return keys.shape[-1], keys.dtype, value

    if len(unique) > 1 and len({kind(*u) for u in unique}) == 1:  # one table
        offsets = [0]
        for keys, _ in unique[:-1]:
            offsets.append(offsets[-1] + keys.shape[1])
        keys = jnp.concatenate([k for k, _ in unique], axis=1)
        values = None if unique[0][1] is None else jnp.concatenate([v for _, v in unique], 1)
        unique, slots = [(keys, values)], [(0, offsets[i]) for i in which]
    else:
        slots = [(i, 0) for i in which]
    tables = []
    for keys, values in unique:
        bad = nonfinite_rows(keys, values)
        tables.append((zero_rows(keys, bad), zero_rows(values, bad), bad))
    return tables, slots


def _band_part(band, start: Array, query_segment: Array, seq: int):
    """Keys, values and mask of the sliding-window slab of the query block starting at row
    ``start``: padded rows ``start .. start + rows + window - 2``, i.e. tokens
    ``start - window + 1 .. start + rows - 1`` (those before the first query are real rows
    only for the ``before`` rows of a window history)."""
    kv, values, key_segment, key_bad, before, window = band
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


def _attend(q, q_bad, parts, sinks, scale, return_lse, numerics=None):
    """Attention of one block of queries over ``parts``: ``(keys, values, mask, bad,
    per_query)`` with keys ``[B, S, n, d]`` gathered per query (``per_query``) or ``[B, n, d]``
    shared by the block, mask ``[B, S, n]`` and ``bad`` the (zeroed) non-finite key rows; one
    softmax over all parts (see ``XlaAttention``), its maximum and value weights as the
    ``numerics`` say (``None``: exact). Queries flagged in ``q_bad`` or seeing a bad row
    return NaN."""
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
    sink = None if sinks is None else jnp.broadcast_to(sinks.astype(peak.dtype), peak.shape)
    if numerics is None:
        peak = peak if sink is None else jnp.maximum(peak, sink)
    else:
        peak = numerics.attention_max(peak, sink)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.exp(logits - peak[..., None])
    denom = jnp.sum(p, axis=-1)
    if sink is not None:
        denom = denom + jnp.exp(sink - peak)
    safe = jnp.where(denom > 0, denom, 1.0)
    if numerics is None:
        weights, divisor = p / safe[..., None], None
    else:
        weights, divisor = numerics.attention_weights(p, safe)
    out, offset = 0.0, 0
    for keys, vals, _, _, per_query in parts:
        n = keys.shape[-2]
        spec = "bshk,bskd->bshd" if per_query else "bshk,bkd->bshd"
        w_part = weights[..., offset : offset + n].astype(vals.dtype)
        out = out + jnp.einsum(spec, w_part, vals, preferred_element_type=acc)
        offset += n
    if divisor is not None:
        out = out / divisor[..., None]
    out = round_to(jnp.where(poisoned[:, :, None, None], jnp.nan, out), q.dtype)
    if return_lse:
        return out, jnp.where(poisoned[..., None], jnp.nan, peak + jnp.log(denom))
    return out
