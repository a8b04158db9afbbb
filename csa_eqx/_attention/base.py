"""The attention kernel seam: what a query reads is a typed value (``csa_eqx.Reads``); a
kernel computes one softmax over it. Calling a kernel (``__call__``) sizes its query blocks
(``query_block_for``, the kernel's own rule) and runs its ``attend``; MLA's latent attention
(V3.2) goes through ``latent``, by absorption unless a kernel computes it otherwise.
``csa_eqx.XlaAttention`` is the reference; a Pallas or quantised kernel is one new subclass,
selected with ``Execution(attention=...)`` or by ``AutoAttention``.
"""

from __future__ import annotations

import abc
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._backend import backend_tiles
from .._mesh import per_device
from .._numerics.fp8_weight import Fp8Weight
from .._tiles import TileSizes, power_of_two_block
from .reads import Reads

__all__ = [
    "AbstractAttentionKernel",
    "LatentUp",
    "attention_query_block",
    "require_keys",
    "require_exact_softmax",
    "fold_sink",
]


class LatentUp(NamedTuple):
    """MLA's per-head up-projection of its latent keys and values (V3.2): the latent ``c_kv``
    of a key maps to head ``h``'s key part ``c_kv · W_kb_hᵀ`` and value ``c_kv · W_vb_hᵀ``.

    **Arguments:**

    - ``weight``: ``[H · (nope_dim + value_dim), kv_lora]`` (the checkpoint's ``kv_b_proj``; an
        array or an ``Fp8Weight``), head ``h``'s ``W_kb`` rows first, then its ``W_vb``.
    - ``nope_dim``, ``value_dim``: per head.
    - ``expanded``: whether the layer's numerics follow a reference that multiplies each
        head's keys and values out of the latent rather than absorbing (DeepSeek's V3.2
        prefill: ``numerics.expanded_attention(formats)``).
    """

    weight: Array | Fp8Weight
    nope_dim: int
    value_dim: int
    expanded: bool = False

    def split(self, dtype) -> tuple[Array, Array]:
        """**Returns:** per-head ``W_kb [H, nope_dim, kv_lora]`` and ``W_vb [H, value_dim,
        kv_lora]`` in ``dtype`` (an ``Fp8Weight`` dequantised, as DeepSeek's absorbed decode
        does); the heads from the weight (under head parallelism a device holds some)."""
        w = self.weight
        w = w.dequantize(dtype) if isinstance(w, Fp8Weight) else w.astype(dtype)
        w = w.reshape(-1, self.nope_dim + self.value_dim, w.shape[-1])
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def absorb(
        self,
        q_nope: Float[Array, "batch seq heads nope"],
        q_rope: Float[Array, "batch seq heads rope"],
    ) -> Float[Array, "batch seq heads latent"]:
        """**Returns:** the absorbed per-head queries ``[q_nope · W_kb ; q_rope]``, which score
        the latent keys ``[c_kv ; k_rope]`` as the expanded keys are scored."""
        q_latent = jnp.einsum("bshn,hnc->bshc", q_nope, self.split(q_nope.dtype)[0])
        return jnp.concatenate([q_latent, q_rope], axis=-1)

    def values(
        self, o: Float[Array, "batch seq heads kv_lora"]
    ) -> Float[Array, "batch seq heads v"]:
        """**Returns:** each head's values ``o · W_vbᵀ`` of its attended latents ``o``."""
        return jnp.einsum("bshc,hvc->bshv", o, self.split(o.dtype)[1])


def attention_query_block(batch: int, heads: int, reads: Reads, elements: int = 1 << 24) -> int:
    """The automatic query block of an attention over ``reads`` (``XlaAttention``'s, the
    default ``query_block_for``): as ``sparse_query_block`` for the gathered rows (summed over
    the read sets) and the dense entries, and with a band at most the power of two above
    ``window - 1`` (each block reads a slab of ``block + window - 1`` rows: keep the block near
    the window).

    **Arguments:** the queries' ``batch`` and ``heads``, the ``csa_eqx.Reads`` they attend and the
    block's budget of ``elements`` (``TileSizes.attention_elements``).

    **Returns:** the query block, a power of two >= 1.
    """
    per_row = 0
    for g in reads.gathered:  # gathered keys (+ values) and logits per pick
        values = g.value_rows()
        width = g.keys.shape[-1] + (0 if values is None else values.shape[-1])
        per_row += g.indices.shape[-1] * (width + heads)
    if reads.dense is not None:  # logits and mask per entry
        per_row += reads.dense.keys.shape[1] * (heads + 1)
    block = power_of_two_block(batch, per_row, elements)
    if reads.band is not None:
        block = min(block, 1 << max(reads.band.window - 1, 1).bit_length())
    return block


def require_keys(reads: Reads) -> None:
    """**Arguments:** a kernel's ``reads``; a ``ValueError`` unless they hold a key set."""
    if not (reads.gathered or reads.band is not None or reads.dense is not None):
        raise ValueError("reads must hold at least one key set (gathered, band or dense)")


def require_exact_softmax(kernel, numerics) -> None:
    """**Arguments:** a ``kernel`` that computes the exact softmax and the layer's ``numerics``;
    a ``ValueError`` for numerics that round the attention (only ``XlaAttention`` models
    them)."""
    if numerics is not None and not numerics.exact_softmax:
        raise ValueError(
            f"{type(kernel).__name__} computes the exact softmax; {type(numerics).__name__} "
            "rounds the attention's weights as DeepSeek's kernels do, which only XlaAttention "
            "models (AutoAttention picks it under such numerics)"
        )


def fold_sink(m, total, sink):
    """The online softmax's sink step (the sink adds to the denominator only), in a kernel.

    **Arguments:** the running maximum ``m`` and denominator ``total`` of each softmax row
    (``m = -inf``: nothing read) and the rows' ``sink`` logits.

    **Returns:** ``(shift, total, alpha)``: the final shift (the maximum with the sink, ``0``
    where infinite), the denominator with the sink, relative to it, and the factor the running
    numerators take.
    """
    top = jnp.maximum(m, sink)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    alpha = jnp.exp(m - shift)
    return shift, total * alpha + jnp.exp(sink - shift), alpha


class AbstractAttentionKernel(eqx.Module):
    """Softmax attention of each query over its ``Reads`` (keys shared across heads), with an
    optional per-head sink in the denominator.

    The contract every kernel keeps (the reference's tests check it): a query with no visible
    key (and no sink) returns zeros and ``lse = -inf``; key / value rows holding a NaN or an
    Inf reach exactly the queries that read them (and those whose own query is non-finite),
    which return NaN, every other query is unaffected; the output is in ``q``'s dtype, the
    ``lse`` float32 (the output rounded to it: ``round_to``).
    """

    def __call__(
        self,
        q,
        reads: Reads,
        sinks,
        scale,
        *,
        return_lse=False,
        numerics=None,
        query_block=0,
        tiles=None,
    ):
        """The kernel's attention, its query blocks sized by its own rule.

        **Arguments:** as for ``attend``, and ``query_block`` (``0``: the kernel's automatic
        block, ``query_block_for``) and the ``tiles`` it sizes by (``None``: the backend's,
        ``csa_eqx._backend.backend_tiles``).

        **Returns:** as ``attend``.
        """
        b, _, h, _ = q.shape
        block = query_block or self.query_block_for(b, h, reads, backend_tiles(tiles))
        kw = dict(return_lse=return_lse, query_block=block, numerics=numerics)
        if not self.is_kernel:
            return self.attend(q, reads, sinks, scale, **kw)

        def local(batched, sinks):  # one device's program (``per_device``)
            return self.attend(*batched, sinks, scale, **kw)

        return per_device(local, (q, reads), sinks)

    # a Pallas kernel (one device's program: run per device under a mesh the compiler shards)
    is_kernel: ClassVar[bool] = False
    # it computes the exact softmax only (a fused kernel: numerics that round the attention's
    # weights are refused, by ``require_exact_softmax`` and up front by ``Execution``)
    exact_softmax_only: ClassVar[bool] = False

    def query_block_for(self, batch: int, heads: int, reads: Reads, tiles: TileSizes) -> int:
        """**Arguments:** the queries' ``batch`` and ``heads``, their ``reads`` and the ``tiles``.

        **Returns:** the automatic query block (``attention_query_block`` within
        ``tiles.attention_elements``; a kernel with a rule of its own overrides this)."""
        return attention_query_block(batch, heads, reads, tiles.attention_elements)

    @abc.abstractmethod
    def attend(
        self,
        q: Float[Array, "batch seq heads dim"],
        reads: Reads,
        sinks: Float[Array, " heads"] | None,
        scale: float,
        *,
        return_lse: bool = False,
        query_block: int,
        numerics=None,
    ) -> (
        Float[Array, "batch seq heads vdim"]
        | tuple[Float[Array, "batch seq heads vdim"], Float[Array, "batch seq heads"]]
    ):
        """**Arguments:**

        - ``q``: queries ``[B, S, H, d]``.
        - ``reads``: what each query reads (``csa_eqx.Reads``, at least one key set).
        - ``sinks``: per-head sink logits ``[H]`` (denominator only), or ``None``.
        - ``scale``: softmax scale.
        - ``return_lse``: also return each head's float32 log-normaliser (sink included).
        - ``query_block``: queries per block (``>= 1``; ``__call__`` resolves it with
            ``query_block_for``); a kernel may ignore it.
        - ``numerics``: the layer's ``AbstractNumerics`` (``None``: the exact softmax): the
            maximum the exponentials are relative to (``attention_max``) and the weights of
            the values (``attention_weights``); a kernel that cannot take them refuses numerics
            whose ``exact_softmax`` is false.

        **Returns:**

        ``[B, S, H, vdim]`` in ``q``'s dtype; with ``return_lse``, ``(out, lse)`` with
        ``lse [B, S, H]``.
        """

    def latent(self, q_nope, q_rope, reads: Reads, up: LatentUp, scale, *, return_lse=False, **kw):
        """MLA's attention over latent keys ``[c_kv ; k_rope]`` and values ``c_kv`` (V3.2):
        absorbed (each head's query mapped into the latent, ``[q_nope · W_kb ; q_rope]``, one
        attention shared by the heads, then ``W_vb`` maps each head's attended latent to its
        values). A kernel that computes it another way overrides this.

        **Arguments:** the per-head query parts ``q_nope [B, S, H, d_nope]`` and ``q_rope
        [B, S, H, d_rope]``, the latents' ``reads`` (keys ``[c_kv ; k_rope]``, values
        ``c_kv``), the up-projection ``up``, the softmax ``scale``, ``return_lse`` and the
        kernel's keywords (``numerics``, ``query_block``, ``tiles``) as for ``__call__``.

        **Returns:** the per-head values ``[B, S, H, value_dim]`` in ``q_nope``'s dtype; with
        ``return_lse``, ``(out, lse)``.
        """
        out = self(up.absorb(q_nope, q_rope), reads, None, scale, return_lse=return_lse, **kw)
        o, lse = out if return_lse else (out, None)
        return (up.values(o), lse) if return_lse else up.values(o)
