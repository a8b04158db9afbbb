"""``DeepSeekInference``: the numerics of DeepSeek's own inference code, for every family
(docs/numerics.md, docs/v41.md), and the loaders' ``numerics=`` keyword."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from .._ops import round_to
from .base import V41_FORMATS, AbstractNumerics, DeepSeekFormats, ExactNumerics
from .formats import fp4_e2m1_round_trip, fp8_e4m3_round_trip, hadamard
from .fp8_linear import fp8_linear
from .fp8_weight import Fp8Weight

__all__ = ["DeepSeekInference", "DeepSeekV41Inference", "named_numerics"]

_SCALE_FMTS = (None, "ue8m0")


class DeepSeekInference(AbstractNumerics):
    """What DeepSeek's inference code (``inference/model.py`` and ``kernel.py`` of
    DeepSeek-V3.2-Exp, DeepSeek-V4 and DeepSeek-V4.1) computes, as the layer family's
    ``DeepSeekFormats`` say:

    - bf16 activations (the layer's input and every projection; norms, RoPE and softmax in
      float32, cast back), the output cast back to the input's dtype;
    - projections with an ``Fp8Weight`` (an FP8 checkpoint tensor) as DeepSeek's ``linear``:
      the input quantised to FP8 per token in blocks of the weight's tile (``act_quant``),
      the FP8 x FP8 product with both block scales in float32 (``fp8_gemm``), bf16 out;
      other projections in the input's dtype (bf16, or float32 where DeepSeek upcasts);
    - the indexer's queries and keys (rotated by a Hadamard matrix in V3.2 and V4) round-tripped
      through FP8 E4M3 in 128-blocks (V3.2; power-of-two scales when ``scale_fmt`` is set) or
      FP4 E2M1 in 32-blocks with E8M0 scales (V4, V4.1); V4's and V4.1's scores rounded to
      bf16 as their bf16 einsum does;
    - the KV round trip: V3.2's latent through FP8 in 128-blocks; V4's non-rotary channels in
      64-blocks through FP8 (``kv_fp8=True``, V4-Pro's kernel file) or through bf16, a no-op
      with power-of-two scales (``kv_fp8=False``, V4-Flash's); V4.1's whole window rows
      through FP8 in 32-blocks and its compressed entries through FP4 in 16-blocks with E4M3
      scales;
    - the compressor in float32 (V4; V4.1 from ratio 2), its windows cast to bf16 before their
      norm;
    - V4's per-head query norm in bf16 arithmetic (``head_norm``) and its sparse attention's
      bf16 probabilities relative to the logits' maximum (the sink in the denominator only),
      divided by their sum after ``P·V`` (``attention_max``, ``attention_weights``);
    - V3.2's prefill attention expanded per head in bf16 (``expanded_attention``).

    The loaders keep a checkpoint's FP8 projections as ``Fp8Weight`` under these numerics
    (``checkpoint_weight``). Quantisation passes gradients straight through
    (quantisation-aware training); an ``Fp8Weight`` gets none.

    **Arguments:**

    - ``scale_fmt``: ``"ue8m0"`` (power-of-two FP8 scales, as DeepSeek's released configs) or
        ``None`` (``amax / 448``); the loaders read it from the checkpoint's config.
    - ``kv_fp8``: round-trip V4's KV through FP8 (V4-Pro) rather than bf16 (V4-Flash); V3.2's
        and V4.1's KV always go through FP8.
    """

    scale_fmt: str | None = "ue8m0"
    kv_fp8: bool = False
    exact_softmax: ClassVar[bool] = False

    def __check_init__(self):
        if self.scale_fmt not in _SCALE_FMTS:
            raise ValueError(f"scale_fmt must be None or 'ue8m0' (got {self.scale_fmt!r})")
        if not isinstance(self.kv_fp8, bool):
            raise ValueError(f"kv_fp8 must be a bool (got {self.kv_fp8!r})")

    @property
    def _pow2(self) -> bool:
        return self.scale_fmt is not None

    def layer_input(self, x):
        return round_to(x, jnp.bfloat16)

    def linear(self, x, weight):
        if isinstance(weight, Fp8Weight):
            return fp8_linear(x, weight, self._pow2)
        # float32 accumulation, then one rounding to x's dtype that jit keeps (round_to)
        acc = jnp.promote_types(x.dtype, jnp.float32)
        y = jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype), preferred_element_type=acc)
        return round_to(y, x.dtype)

    def checkpoint_weight(self, weight, dtype):
        return weight  # DeepSeek's linear quantises the input against the FP8 values and scales

    def compressor_input(self, x, ratio=None, formats=None):
        if ratio is not None and formats is not None and ratio < formats.compressor_float32_ratio:
            return x
        return x.astype(jnp.float32)

    def head_norm(self, q, eps):
        # torch's bf16 ops, each result rounded: square, mean (float32 sum), + eps, rsqrt, product
        def bf16(v):
            return round_to(v, jnp.bfloat16).astype(jnp.float32)

        q32 = bf16(q)
        mean = bf16(jnp.mean(bf16(q32 * q32), axis=-1, keepdims=True))
        return round_to(q32 * bf16(jax.lax.rsqrt(bf16(mean + eps))), q.dtype)

    def attention_max(self, peak, sink):
        return peak  # sparse_attn's running maximum starts at -inf: the sink is not in it

    def attention_weights(self, p, denominator):
        # DeepSeek's sparse_attn: bf16 probabilities (before the division) into a float32 P.V
        return round_to(p, jnp.bfloat16), denominator

    def entry_dtype(self, x):
        return x.dtype

    def kv(self, kv, rope_dim, formats: DeepSeekFormats):
        if formats.kv_channels == "all":
            nope, rope = kv, kv[..., :0]
        else:
            nope, rope = kv[..., :-rope_dim], kv[..., -rope_dim:]
        fp8 = self.kv_fp8 if formats.kv_fp8 is None else formats.kv_fp8
        through = None if fp8 else jnp.bfloat16
        nope = fp8_e4m3_round_trip(nope, formats.kv_block, self._pow2, cast_to=through)
        return jnp.concatenate([round_to(nope, kv.dtype), rope], axis=-1)

    def entries(self, entries, rope_dim, formats: DeepSeekFormats):
        if formats.entries is None:
            return self.kv(entries, rope_dim, formats)
        q = fp4_e2m1_round_trip(entries, formats.entry_block, formats.entry_scales)
        return round_to(q, entries.dtype)

    def indexer(self, v, formats: DeepSeekFormats):
        rotated = hadamard(v) if formats.hadamard else v
        if formats.indexer == "fp8_e4m3":
            return fp8_e4m3_round_trip(rotated, formats.indexer_block, self._pow2)
        return fp4_e2m1_round_trip(rotated, formats.indexer_block)  # float32, as the kernels

    def score_dtype(self, formats: DeepSeekFormats):
        return formats.score_dtype

    def expanded_attention(self, formats: DeepSeekFormats):
        return formats.expanded_prefill

    def check(self, formats: DeepSeekFormats, config) -> None:
        name = type(self).__name__
        d, block = config.index_head_dim, formats.indexer_block
        if formats.hadamard and (d & (d - 1) or d % block):
            raise ValueError(
                f"index_head_dim={d} must be a power of two and a multiple of {block} for "
                f"{name} numerics (Hadamard rotation, quantisation blocks)"
            )
        sizes = [("index_head_dim", d, block)]
        if formats.kv_block:
            sizes.append((*_kv_width(formats, config), formats.kv_block))
        if formats.entries is not None:
            sizes.append(("head_dim", config.head_dim, formats.entry_block))
        for field, size, block in sizes:
            if size % block:
                named = f"{field} = {size}" if " " in field else f"{field}={size}"
                raise ValueError(
                    f"{named} must be a multiple of {block} for {name} numerics (its "
                    "quantisation blocks)"
                )


def _kv_width(formats: DeepSeekFormats, config) -> tuple[str, int]:
    """The name and width of the channels the KV round trip covers in ``config``'s layer."""
    if formats.kv_channels == "latent":
        return "kv_lora_rank", config.kv_lora_rank
    if formats.kv_channels == "all":
        return "head_dim", config.head_dim
    return "head_dim - rope_dim", config.head_dim - config.rope_dim


class DeepSeekV41Inference(DeepSeekInference):
    """``DeepSeekInference`` under the name of DeepSeek-V4.1's layers (docs/v41.md, "Quantised
    inference"): the same numerics, refusing layers of other families. ``DeepSeekInference``
    computes the same on a ``V41Attention`` layer."""

    def check(self, formats: DeepSeekFormats, config) -> None:
        if formats != V41_FORMATS:
            raise ValueError(
                "DeepSeekV41Inference is the numerics of V4.1 layers (V41Attention); use "
                "DeepSeekInference for V4 and V3.2 layers"
            )
        super().check(formats, config)


def named_numerics(
    numerics: str | AbstractNumerics,
    scale_fmt: str | None = "ue8m0",
    formats: DeepSeekFormats | None = None,
) -> AbstractNumerics:
    """The numerics a loader's ``numerics=`` keyword names (the one mapping): ``"exact"`` is
    ``ExactNumerics()``, ``"deepseek"`` ``DeepSeekInference(scale_fmt=scale_fmt)`` (the layer's
    formats say what it quantises), under V4.1's name ``DeepSeekV41Inference`` for V4.1's
    formats; a numerics object is returned as given.

    **Arguments:** the keyword's value, the checkpoint's activation scale format (DeepSeek's
    ``scale_fmt``; default ``"ue8m0"``, the releases') and the layer family's formats
    (``None``: V4 or V3.2).

    **Returns:** the numerics; a ``ValueError`` naming the keyword for any other string.
    """
    if not isinstance(numerics, str):
        return numerics
    if numerics == "exact":
        return ExactNumerics()
    if numerics == "deepseek":
        cls = DeepSeekV41Inference if formats == V41_FORMATS else DeepSeekInference
        return cls(scale_fmt=scale_fmt)
    raise ValueError(f"numerics must be 'exact', 'deepseek' or an object (got {numerics!r})")
