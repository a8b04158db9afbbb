"""Token compressors: the seam (``AbstractCompressor``) and V4's compressor, CSA's overlapping
windows and HCA's disjoint windows (docs/concepts.md, "Compressed entries"); V4.1's groups are
``csa_eqx._entries.v41``'s.

Compressed entries live in *slots*: entry ``j`` is the window whose last token has row index
``end[j]`` with ``end[j] // m == j``. Windows are aligned to the start of each segment, so a
packed row gives every document exactly the entries it would get alone; a slot whose window
does not close inside the row is empty (``end = -1``). Without segments this is the plain layout
``end[j] = j·m + m − 1``.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._config import YaRNScaling
from .._layout import EntryLayout
from .._numerics.base import EXACT, AbstractNumerics
from .._numerics.fp8_weight import Fp8Weight
from .._ops import init_linear, rms_norm, round_to, upcast
from .._rope import Rope

__all__ = [
    "pool_windows",
    "AbstractCompressor",
    "Compressor",
]


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

    **Arguments:**

    - ``kv``, ``gate``: per-token values and gate logits ``[B, S, width]``.
    - ``bias``: learned position bias ``[m, width]`` added to the gates.
    - ``layout``: the slots (``entry_layout``).
    - ``overlap``: CSA's overlapping windows.

    **Returns:**

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


class AbstractCompressor(eqx.Module):
    """What a layer's compressor does, for the forward and the decode cache alike
    (``csa_eqx._decode.chunks.compress_chunk`` pools a chunk's closing windows through the same
    calls): project each token (``project``), pool the tokens of each slot's window
    (``pool``), then make the entries of the pooled windows (``finish``).

    Every compressor holds ``compress_rate`` (tokens per window ``m``), ``overlap`` (CSA's
    windows also pool the previous window's other half), its entries' RoPE table (``rope``:
    ``roped``) and its RMSNorm epsilon ``eps``; an implementation adds its weights and
    ``position_bias`` (``[m, width]``, added to the gates: a field, or a property of its
    static fields and weights) and says its widths (``widths``). ``project`` and ``finish``
    take the layer's numerics: their projections go through its ``linear``.
    """

    compress_rate: int = eqx.field(static=True)
    overlap: bool = eqx.field(static=True)
    rope: Rope = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    @abc.abstractmethod
    def project(
        self, x: Float[Array, "batch seq hidden"], numerics: AbstractNumerics = EXACT
    ) -> tuple[Array, Array]:
        """**Arguments:** ``x [B, S, hidden]`` and the layer's ``numerics``.

        **Returns:** per-token ``(C, Z)``, each ``[B, S, width]``, before pooling (what the
        decode cache keeps for open windows).
        """

    @abc.abstractmethod
    def finish(
        self,
        pooled: Array,
        positions: Int[Array, "batch seq"],
        layout: EntryLayout,
        dtype=None,
        numerics: AbstractNumerics = EXACT,
    ) -> Array:
        """**Arguments:** the pooled windows ``[B, T, dim]``, the tokens' ``positions [B, S]``,
        the ``EntryLayout``, the ``dtype`` to round the windows to first (``None``: as
        pooled) and the layer's ``numerics``.

        **Returns:** the entries ``[B, T, entry width]``.
        """

    @abc.abstractmethod
    def widths(self) -> tuple[int, int]:
        """**Returns:** ``(width, entry width)``: of the per-token projections and of the
        entries ``finish`` makes."""

    def pool(self, kv: Array, gate: Array, layout: EntryLayout) -> Array:
        """**Arguments:** per-token ``kv`` and ``gate`` ``[B, S, width]`` and the slots' layout.

        **Returns:** each slot's pooled window ``[B, T, dim]`` (``pool_windows``)."""
        return pool_windows(kv, gate, self.position_bias, layout, self.overlap)

    def roped(self, x: Array, positions: Int[Array, "batch seq"], layout: EntryLayout) -> Array:
        """**Arguments:** per-slot values ``x [B, T, d]``, the tokens' ``positions [B, S]`` and the
        slots' layout.

        **Returns:** ``x`` roped at the position of each slot's window's first token."""
        first = jnp.clip(layout.end - self.compress_rate + 1, 0, positions.shape[1] - 1)
        return self.rope.interleaved(x, jnp.take_along_axis(positions, first, axis=1))

    @property
    def ring(self) -> int:
        """**Returns:** the tokens a decode cache keeps projected: ``2m`` with ``overlap`` (the
        open window and the previous window's halves), else ``m``."""
        return 2 * self.compress_rate if self.overlap else self.compress_rate

    def __call__(
        self,
        x: Float[Array, "batch seq hidden"],
        positions: Int[Array, "batch seq"],
        layout: EntryLayout,
        dtype=None,
        numerics: AbstractNumerics = EXACT,
    ) -> Float[Array, "batch slots dim"]:
        """**Arguments:** ``x [B, S, hidden]``, int32 RoPE ``positions [B, S]``, the slots'
        ``EntryLayout``, the ``dtype`` the pooled windows are rounded to before their norm
        (``None``: as pooled) and the layer's ``numerics``.

        **Returns:** the entries ``[B, T, entry width]``; empty slots (``end = -1``) are never
        visible, whatever they hold.
        """
        kv, gate = self.project(x, numerics)
        return self.finish(self.pool(kv, gate, layout), positions, layout, dtype, numerics)


class Compressor(AbstractCompressor):
    """V4's learned compressor producing one RMS-normed, RoPE'd entry per closed window
    (docs/concepts.md, "Compressed entries").

    **Arguments:**

    - ``hidden_size``: input width; dim: entry width.
    - ``compress_rate``: tokens per window ``m``; overlap: CSA's overlapping windows (each entry
        also pools the previous window's other half), else HCA's disjoint ones.
    - ``rope_dim``, ``rope_theta``, ``rope_scaling``: the entries' RoPE; eps: the RMSNorm epsilon.
    - ``key``: PRNG key for the random initial weights; dtype: their dtype.
    """

    kv_proj: Float[Array, "width hidden"] | Fp8Weight
    gate_proj: Float[Array, "width hidden"] | Fp8Weight
    position_bias: Float[Array, "m width"]
    kv_norm: Float[Array, " dim"]

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
        self.compress_rate, self.overlap = compress_rate, overlap
        self.rope, self.eps = Rope(rope_dim, rope_theta, rope_scaling), eps

    def project(self, x, numerics=EXACT):
        return numerics.linear(x, self.kv_proj), numerics.linear(x, self.gate_proj)

    def widths(self) -> tuple[int, int]:
        return self.kv_proj.shape[0], self.kv_norm.shape[0]

    def finish(self, pooled, positions, layout, dtype=None, numerics=EXACT):
        """RMSNorm, then RoPE at the position of each window's first token (see
        ``AbstractCompressor.finish``)."""
        pooled = pooled if dtype is None else round_to(pooled, dtype)
        return self.roped(rms_norm(pooled, self.kv_norm, self.eps), positions, layout)
