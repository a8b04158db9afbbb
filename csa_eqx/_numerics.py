"""How a layer rounds: the numerics family (docs/numerics.md).

``ExactNumerics`` (the default and the reference) computes in the dtype of the input and the
parameters, float32 in practice, with nothing quantised. ``DeepSeekInference``
(``_deepseek_numerics.py``) reproduces what DeepSeek's own inference code computes. A layer
asks its ``Execution.numerics`` at the few points where the two differ, and says with a
``DeepSeekFormats`` what DeepSeek quantises in its family.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import equinox as eqx
from jaxtyping import Array

__all__ = [
    "AbstractNumerics",
    "ExactNumerics",
    "DeepSeekFormats",
    "V32_FORMATS",
    "V4_FORMATS",
    "V41_FORMATS",
]


class DeepSeekFormats(NamedTuple):
    """What DeepSeek's inference code quantises in one layer family.

    **Arguments:**

    - ``indexer``: the format of the indexer's queries and keys after the Hadamard rotation
        (``"fp8_e4m3"`` or ``"fp4_e2m1"``).
    - ``indexer_block``: values per scale there.
    - ``score_dtype``: the dtype the indexer's scores are rounded to (``"bfloat16"`` where
        DeepSeek scores with a bf16 einsum; ``None``: float32, as its FP8 kernel).
    - ``kv_block``: values per scale of the KV round trip on the non-rotary channels (0: none).
    """

    indexer: str
    indexer_block: int
    score_dtype: str | None
    kv_block: int


# DeepSeek-V3.2-Exp: Hadamard + FP8 E4M3 128-blocks on the indexer, FP8 scoring (float32)
V32_FORMATS = DeepSeekFormats("fp8_e4m3", 128, None, 0)
# DeepSeek-V4: Hadamard + FP4 E2M1 32-blocks on the indexer, bf16 scores, KV in 64-blocks
V4_FORMATS = DeepSeekFormats("fp4_e2m1", 32, "bfloat16", 64)
# DeepSeek-V4.1: FP4 E2M1 32-blocks on the indexer (no Hadamard), bf16 scores, the window KV
# in FP8 32-blocks over the whole vector (its compressed entries: FP4 in 16-blocks with E4M3
# scales, ``DeepSeekV41Inference``)
V41_FORMATS = DeepSeekFormats("fp4_e2m1", 32, "bfloat16", 32)


class AbstractNumerics(eqx.Module):
    """Where a layer's rounding can differ from the exact computation. Every method is the
    identity for ``ExactNumerics``."""

    @abc.abstractmethod
    def layer_input(self, x: Array) -> Array:
        """**Arguments:** the layer's input ``x``. Returns: the activations the layer computes
        on (its output is cast back to ``x``'s dtype)."""

    @abc.abstractmethod
    def compressor_input(self, x: Array) -> Array:
        """**Arguments:** the activations. Returns: what a V4 compressor projects and pools."""

    @abc.abstractmethod
    def entry_dtype(self, x: Array):
        """**Arguments:** the activations ``x``. Returns: the dtype pooled compressor windows are
        cast to before their norm (``None``: kept as pooled)."""

    @abc.abstractmethod
    def kv(self, kv: Array, rope_dim: int, formats: DeepSeekFormats) -> Array:
        """**Arguments:** V4 keys/values ``[..., head_dim]`` (window rows or compressed entries,
        after RoPE on the last ``rope_dim`` channels) and the family's formats. **Returns:** the
        keys/values the attention reads, in ``kv``'s dtype."""

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
    def check(self, formats: DeepSeekFormats, config) -> None:
        """``ValueError`` unless the layer ``config``'s sizes suit these numerics."""


class ExactNumerics(AbstractNumerics):
    """The exact computation (the default and the parity reference): the input's and the
    parameters' dtype throughout, nothing quantised, float32 indexer scores."""

    def layer_input(self, x):
        return x

    def compressor_input(self, x):
        return x

    def entry_dtype(self, x):
        return None

    def kv(self, kv, rope_dim, formats):
        return kv

    def indexer(self, v, formats):
        return v

    def score_dtype(self, formats):
        return None

    def check(self, formats, config):
        return None
