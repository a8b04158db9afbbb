"""Token compressors: CSA's overlapping windows and HCA's disjoint windows (docs/concepts.md,
"Compressed entries").

Compressed entries live in *slots*: entry ``j`` is the window whose last token has row index
``end[j]`` with ``end[j] // m == j``. Windows are aligned to the start of each segment, so a
packed row gives every document exactly the entries it would get alone; a slot whose window
does not close inside the row is empty (``end = -1``). Without segments this is the plain layout
``end[j] = j·m + m − 1``.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .config import YaRNScaling
from .ops import init_linear, linear, rms_norm, upcast
from .rope import apply_rope_interleaved, rope_inv_freq

__all__ = [
    "EntryLayout",
    "entry_layout",
    "segment_positions",
    "token_rows",
    "pool_windows",
    "Compressor",
]


class EntryLayout(NamedTuple):
    """Where each compressed-entry slot comes from (docs/concepts.md, "Compressed entries").

    Arguments:
        end: int32 ``[B, T]`` row index of the last token of the entry's window;
            ``-1`` = empty slot.
        segment: int32 ``[B, T]`` the window's segment.
        has_prior: bool ``[B, T]`` whether a previous window of the same segment exists
            (CSA's overlap half; it restarts at a segment start).
    """

    end: Int[Array, "batch slots"]
    segment: Int[Array, "batch slots"]
    has_prior: Bool[Array, "batch slots"]


def segment_positions(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Index of each token inside its segment (segments are contiguous runs of one id).

    Arguments:
        segment_ids: int ``[B, S]``.

    Returns:
        int32 ``[B, S]``: 0 at each segment's first token (the default RoPE positions).
    """
    s = segment_ids.shape[1]
    idx = jnp.arange(s, dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - first


def token_rows(
    x: Float[Array, "batch seq *rest"], segment_ids: Int[Array, "batch seq"] | None
) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
    """``(segment ids, row index)`` of every token, int32, laid out like ``x``'s first two axes
    (so they carry its sharding on Explicit meshes; no segments = one segment)."""
    base = jnp.zeros_like(x[..., 0] if x.ndim > 2 else x, dtype=jnp.int32)
    seg = base if segment_ids is None else base + jnp.asarray(segment_ids, jnp.int32)
    return seg, base + jnp.arange(x.shape[1], dtype=jnp.int32)


def entry_layout(segment_ids: Int[Array, "batch seq"], m: int) -> EntryLayout:
    """Slots of the compressed entries of a row, windows aligned to each segment's start
    (docs/concepts.md, "Packed sequences: segment-aligned windows").

    Arguments:
        segment_ids: int ``[B, S]``.
        m: compression rate (1: one entry per token, V3.2's selection over tokens).

    Returns:
        An ``EntryLayout`` of ``ceil(S / m)`` slots: window end row (``-1`` = empty slot), its
        segment, and whether a previous window of the same segment exists (CSA's overlap).
    """
    b, s = segment_ids.shape
    slots = -(-s // m)
    pos = segment_positions(segment_ids)
    # slot j holds the (at most one) window closing at a row in [j*m, j*m + m)
    closing = jnp.where((pos + 1) % m == 0, jnp.arange(s, dtype=jnp.int32), -1)
    closing = jnp.pad(closing, [(0, 0), (0, slots * m - s)], constant_values=-1)
    end = jnp.max(closing.reshape(b, slots, m), axis=-1)
    safe = jnp.maximum(end, 0)
    segment = jnp.take_along_axis(segment_ids, safe, axis=1)
    has_prior = (end >= 0) & (jnp.take_along_axis(pos, safe, axis=1) >= 2 * m - 1)
    return EntryLayout(end, segment, has_prior)


def _gather_rows(x: Array, rows: Int[Array, "batch slots m"]) -> Array:
    b, w, m = rows.shape
    flat = jnp.clip(rows, 0, x.shape[1] - 1).reshape(b, w * m)
    return jnp.take_along_axis(x, flat[..., None], axis=1).reshape(b, w, m, x.shape[-1])


def pool_windows(
    kv: Float[Array, "batch seq width"],
    gate: Float[Array, "batch seq width"],
    bias: Float[Array, "m width"],
    layout: EntryLayout,
    overlap: bool,
) -> Float[Array, "batch slots dim"]:
    """Gated pooling of each slot's window (float32 softmax per channel over the slots).

    ``overlap=False`` (HCA): entry ``j`` pools its own ``m`` tokens. ``overlap=True`` (CSA):
    ``width = 2·dim``; entry ``j`` pools the first halves of the previous window (when it exists
    in the same segment) and the second halves of its own window, ``2m`` slots in all.

    Arguments:
        kv, gate: per-token values and gate logits ``[B, S, width]``.
        bias: learned position bias ``[m, width]`` added to the gates.
        layout: the slots (``entry_layout``).
        overlap: CSA's overlapping windows.

    Returns:
        ``[B, slots, dim]`` in ``kv``'s dtype (empty slots hold unspecified values: mask them
        with the layout).
    """
    m = bias.shape[0]
    d = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    own = layout.end[..., None] - m + 1 + jnp.arange(m)
    vals = _gather_rows(kv[..., -d:], own)
    gates = upcast(_gather_rows(gate[..., -d:], own)) + bias[:, -d:]
    if overlap:
        prior_vals = _gather_rows(kv[..., :d], own - m)
        prior_gates = upcast(_gather_rows(gate[..., :d], own - m)) + bias[:, :d]
        keep = layout.has_prior[..., None, None]
        vals = jnp.concatenate([jnp.where(keep, prior_vals, 0), vals], axis=2)
        gates = jnp.concatenate([jnp.where(keep, prior_gates, -jnp.inf), gates], axis=2)
    weights = jax.nn.softmax(gates, axis=2)
    return jnp.sum(weights * upcast(vals), axis=2).astype(kv.dtype)


class Compressor(eqx.Module):
    """Learned compressor producing one RMS-normed, RoPE'd entry per closed window
    (docs/concepts.md, "Compressed entries").

    Arguments:
        hidden_size: input width; dim: entry width.
        compress_rate: tokens per window ``m``; overlap: CSA's overlapping windows (each entry
            also pools the previous window's other half), else HCA's disjoint ones.
        rope_dim, rope_theta, rope_scaling: the entries' RoPE; eps: the RMSNorm epsilon.
        key: PRNG key for the random initial weights; dtype: their dtype.
    """

    kv_proj: Float[Array, "width hidden"]
    gate_proj: Float[Array, "width hidden"]
    position_bias: Float[Array, "m width"]
    kv_norm: Float[Array, " dim"]
    compress_rate: int = eqx.field(static=True)
    overlap: bool = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: YaRNScaling | None = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        dim: int,
        compress_rate: int,
        overlap: bool,
        rope_dim: int,
        rope_theta: float,
        rope_scaling: YaRNScaling | None,
        eps: float,
        *,
        key: Array,
        dtype=jnp.float32,
    ):
        width = 2 * dim if overlap else dim
        k1, k2 = jax.random.split(key)
        self.kv_proj = init_linear(k1, width, hidden_size, dtype)
        self.gate_proj = init_linear(k2, width, hidden_size, dtype)
        self.position_bias = jnp.zeros((compress_rate, width), jnp.float32)
        self.kv_norm = jnp.ones((dim,), jnp.float32)
        self.compress_rate = compress_rate
        self.overlap = overlap
        self.rope_dim = rope_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.eps = eps

    def project(self, x: Float[Array, "batch seq hidden"]) -> tuple[Array, Array]:
        """Arguments: ``x [B, S, hidden]``.

        Returns: per-token ``(C, Z)``, each ``[B, S, width]``, before pooling (what the decode
        cache keeps for open windows).
        """
        return linear(x, self.kv_proj), linear(x, self.gate_proj)

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        positions: Int[Array, "batch seq"],
        layout: EntryLayout,
        dtype=None,
    ) -> Float[Array, "batch slots dim"]:
        """Arguments: ``x [B, S, hidden]``, int32 RoPE ``positions [B, S]``, the slots'
        ``EntryLayout`` and the ``dtype`` the pooled windows are cast to before their norm
        (``None``: ``x``'s).

        Returns: the entries ``[B, T, dim]`` in that dtype; empty slots (``end = -1``) are
        never visible, whatever they hold.
        """
        kv, gate = self.project(x)
        pooled = pool_windows(kv, gate, self.position_bias, layout, self.overlap)
        return self.finish(pooled, positions, layout, dtype)

    def finish(
        self, pooled: Array, positions: Int[Array, "batch seq"], layout: EntryLayout, dtype=None
    ):
        """RMSNorm, then RoPE at the position of each window's first token.

        Arguments: ``pooled [B, T, dim]`` windows, the tokens' ``positions [B, S]``, the
        ``EntryLayout`` and the ``dtype`` to cast the windows to first (``None``: as pooled).

        Returns: the entries ``[B, T, dim]``.
        """
        pooled = pooled if dtype is None else pooled.astype(dtype)
        first = jnp.clip(layout.end - self.compress_rate + 1, 0, positions.shape[1] - 1)
        entry_pos = jnp.take_along_axis(positions, first, axis=1)
        inv_freq = rope_inv_freq(self.rope_dim, self.rope_theta, self.rope_scaling)
        return apply_rope_interleaved(rms_norm(pooled, self.kv_norm, self.eps), entry_pos, inv_freq)
