"""How a layer rounds: the numerics family (docs/numerics.md).

``ExactNumerics`` (the default and the reference) computes in the dtype of the input and the
parameters, float32 in practice, with nothing quantised. ``DeepSeekInference``
(``deepseek.py``) reproduces what DeepSeek's own inference code computes. A layer
asks its ``Execution.numerics`` at the few points where the two differ, and says with a
``DeepSeekFormats`` what DeepSeek quantises in its family.
"""

from __future__ import annotations

import abc
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from .. import _ops
from .fp8_weight import Fp8Weight

__all__ = [
    "AbstractNumerics",
    "ExactNumerics",
    "DeepSeekFormats",
    "V32_FORMATS",
    "V4_FORMATS",
    "V41_FORMATS",
    "EXACT",
]


class DeepSeekFormats(NamedTuple):
    """What DeepSeek's inference code quantises in one layer family; ``DeepSeekInference``
    reads everything it does from here.

    **Arguments:**

    - ``indexer``: the format of the indexer's queries and keys (``"fp8_e4m3"`` or
        ``"fp4_e2m1"``; FP4 with E8M0 scales).
    - ``indexer_block``: values per scale there.
    - ``score_dtype``: the dtype the indexer's scores are rounded to (``"bfloat16"`` where
        DeepSeek scores with a bf16 einsum; ``None``: float32, as its FP8 kernel).
    - ``kv_block``: values per scale of the KV round trip (0: none).
    - ``hadamard``: the indexer's queries and keys are rotated first (V3.2, V4; not V4.1).
    - ``kv_channels``: what the KV round trip covers: ``"nope"`` (the channels before the last
        ``rope_dim``, ``head_dim - rope_dim`` of them: V4), ``"latent"`` (the same slice of
        V3.2's ``[c_kv ; k_rope]``: its ``kv_lora_rank`` latent) or ``"all"`` (the whole
        vector, RoPE channels included: V4.1).
    - ``kv_fp8``: ``True``: the KV round trip casts through FP8 (V3.2, V4.1); ``None``: as the
        numerics' ``kv_fp8`` says (V4's two kernel files).
    - ``entries``: the compressed entries' format, ``None``: rounded as the KV (V4), or
        ``"fp4_e2m1"`` in blocks of ``entry_block`` with ``entry_scales`` (``"e8m0"`` or
        ``"e4m3"``; V4.1: 16, E4M3).
    - ``compressor_float32_ratio``: the compress ratio from which DeepSeek's compressor projects
        and pools in float32 (V4: every ratio; V4.1: 2, its ratio-1 compressor runs in bf16).
    - ``expanded_prefill``: DeepSeek's prefill attention multiplies each head's keys and values
        out of the latent (V3.2's MLA: ``wkv_b`` on the cached latent) and scores, softmaxes and
        sums in bf16 torch ops, rather than attending through its sparse kernel.
    """

    indexer: str
    indexer_block: int
    score_dtype: str | None
    kv_block: int
    hadamard: bool = True
    kv_channels: str = "nope"
    kv_fp8: bool | None = None
    entries: str | None = None
    entry_block: int = 0
    entry_scales: str = "e8m0"
    compressor_float32_ratio: int = 1
    expanded_prefill: bool = False


# DeepSeek-V3.2-Exp: Hadamard + FP8 E4M3 128-blocks on the indexer, FP8 scoring (float32), the
# KV latent through FP8 in 128-blocks (``MLA.forward`` since upstream 8631a81), its prefill
# attention expanded per head in bf16
V32_FORMATS = DeepSeekFormats(
    "fp8_e4m3", 128, None, 128, kv_channels="latent", kv_fp8=True, expanded_prefill=True
)
# DeepSeek-V4: Hadamard + FP4 E2M1 32-blocks on the indexer, bf16 scores, the KV's non-rotary
# channels in 64-blocks (through FP8 or bf16 as the kernel file says)
V4_FORMATS = DeepSeekFormats("fp4_e2m1", 32, "bfloat16", 64)
# DeepSeek-V4.1: FP4 E2M1 32-blocks on the indexer (no Hadamard), bf16 scores, the window KV
# in FP8 32-blocks over the whole vector, its compressed entries FP4 in 16-blocks with E4M3
# scales, the ratio-1 compressor in bf16
V41_FORMATS = DeepSeekFormats(
    "fp4_e2m1",
    32,
    "bfloat16",
    32,
    hadamard=False,
    kv_channels="all",
    kv_fp8=True,
    entries="fp4_e2m1",
    entry_block=16,
    entry_scales="e4m3",
    compressor_float32_ratio=2,
)


class AbstractNumerics(eqx.Module):
    """Where a layer's rounding can differ from the exact computation. Every method is the
    identity for ``ExactNumerics``.

    ``exact_softmax``: whether ``attention_max`` and ``attention_weights`` are the exact
    softmax's (an attention kernel that fuses its own softmax, ``TritonAttention`` or
    ``MosaicAttention``, runs only under such numerics)."""

    exact_softmax: ClassVar[bool] = True

    @abc.abstractmethod
    def layer_input(self, x: Array) -> Array:
        """**Arguments:** the layer's input ``x``. Returns: the activations the layer computes
        on (its output is cast back to ``x``'s dtype)."""

    @abc.abstractmethod
    def linear(self, x: Array, weight: Array | Fp8Weight) -> Array:
        """A projection ``x · weightᵀ`` (torch's ``[out, in]`` layout), as the layers compute
        every one.

        **Arguments:** the activations ``x [..., in]`` and the weight: an array, or an
        ``Fp8Weight`` where the checkpoint's tensor is FP8.

        **Returns:** ``[..., out]`` in ``x``'s dtype (bf16 for DeepSeek's FP8 product)."""

    @abc.abstractmethod
    def checkpoint_weight(self, weight: Fp8Weight, dtype) -> Array | Fp8Weight:
        """How a layer holds a projection weight its checkpoint stores in FP8 (the loaders ask).

        **Arguments:** the checkpoint's tensor as an ``Fp8Weight`` and the layer's parameter
        ``dtype``.

        **Returns:** the layer's leaf: the dequantised float array in ``dtype`` (trainable,
        multiplied as any other), or the ``Fp8Weight`` itself where ``linear`` needs its values
        and scales apart."""

    @abc.abstractmethod
    def compressor_input(
        self, x: Array, ratio: int | None = None, formats: DeepSeekFormats | None = None
    ) -> Array:
        """**Arguments:** the activations, and the compressor's ``ratio`` and the family's
        ``formats`` (``None``: a V4 compressor, every ratio alike). **Returns:** what the
        compressor projects and pools."""

    @abc.abstractmethod
    def head_norm(self, q: Array, eps: float) -> Array:
        """**Arguments:** per-head queries ``q [..., d]`` and the epsilon. **Returns:** their
        weightless RMS norm (V4's ``q · rsqrt(mean(q²) + eps)``), in ``q``'s dtype."""

    @abc.abstractmethod
    def attention_max(self, peak: Array, sink: Array | None) -> Array:
        """What the attention's exponentials are taken relative to.

        **Arguments:** each row's largest logit ``peak [...]`` (float32, ``-inf`` where a row
        sees nothing) and the sinks broadcast to it (``None``: no sinks).

        **Returns:** the maximum subtracted from the logits (and from the sink in the
        denominator)."""

    @abc.abstractmethod
    def attention_weights(self, p: Array, denominator: Array) -> tuple[Array, Array | None]:
        """How the attention turns its softmax into the weights of the values.

        **Arguments:** ``p = exp(logits - max)`` ``[..., n]`` (float32) and the softmax's
        ``denominator [...]`` (the sink's term included).

        **Returns:** ``(weights, divisor)``: the attention output is ``(weights · V) /
        divisor`` (``divisor`` ``None``: no division)."""

    @abc.abstractmethod
    def entry_dtype(self, x: Array):
        """**Arguments:** the activations ``x``. Returns: the dtype pooled compressor windows are
        cast to before their norm (``None``: kept as pooled)."""

    @abc.abstractmethod
    def kv(self, kv: Array, rope_dim: int, formats: DeepSeekFormats) -> Array:
        """**Arguments:** keys/values ``[..., width]`` after RoPE on their last ``rope_dim``
        channels (V4 / V4.1 window rows or compressed entries; V3.2's ``[c_kv ; k_rope]``)
        and the family's formats. **Returns:** the keys/values the attention reads (and a
        decode cache keeps), in ``kv``'s dtype."""

    def entries(self, entries: Array, rope_dim: int, formats: DeepSeekFormats) -> Array:
        """**Arguments:** compressed entries ``[..., head_dim]`` after RoPE and the family's
        formats. **Returns:** the entries the attention reads, in ``entries``' dtype: those
        of V4.1 (its ``V41Attention`` asks here); by default as ``kv`` rounds them (V4 rounds
        its window rows and entries alike)."""
        return self.kv(entries, rope_dim, formats)

    @abc.abstractmethod
    def indexer(self, v: Array, formats: DeepSeekFormats) -> Array:
        """**Arguments:** indexer queries ``[..., H, d]`` or keys ``[..., d]`` after RoPE, and the
        family's formats. **Returns:** what the scores are computed from (the same scores as
        ``v`` up to rounding: a rotation applied to queries and keys alike cancels), in
        ``v``'s dtype or float32."""

    @abc.abstractmethod
    def score_dtype(self, formats: DeepSeekFormats) -> str | None:
        """**Arguments:** the family's formats. Returns: the dtype indexer scores are rounded to
        (``None``: float32)."""

    @abc.abstractmethod
    def expanded_attention(self, formats: DeepSeekFormats) -> bool:
        """**Arguments:** the family's formats. Returns: whether an MLA layer (V3.2) attends
        with its keys and values expanded per head, in DeepSeek's bf16 prefill arithmetic,
        rather than in the absorbed form."""

    @abc.abstractmethod
    def check(self, formats: DeepSeekFormats, config) -> None:
        """``ValueError`` unless the layer ``config``'s sizes suit these numerics."""


class ExactNumerics(AbstractNumerics):
    """The exact computation (the default and the parity reference): the input's and the
    parameters' dtype throughout, nothing quantised (an ``Fp8Weight`` is dequantised), float32
    indexer scores."""

    def layer_input(self, x):
        return x

    def linear(self, x, weight):
        if isinstance(weight, Fp8Weight):
            weight = weight.dequantize(x.dtype)
        return _ops.linear(x, weight)

    def checkpoint_weight(self, weight, dtype):
        return weight.dequantize(dtype)

    def compressor_input(self, x, ratio=None, formats=None):
        return x

    def head_norm(self, q, eps):
        return _ops.rms_norm(q, None, eps)

    def attention_max(self, peak, sink):
        return peak if sink is None else jnp.maximum(peak, sink)

    def attention_weights(self, p, denominator):
        return p / denominator[..., None], None

    def entry_dtype(self, x):
        return None

    def kv(self, kv, rope_dim, formats):
        return kv

    def indexer(self, v, formats):
        return v

    def score_dtype(self, formats):
        return None

    def expanded_attention(self, formats):
        return False

    def check(self, formats, config):
        return None


EXACT = ExactNumerics()  # the parts' default numerics (their methods called outside a layer)
