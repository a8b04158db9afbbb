"""``DeepSeekInference`` and ``DeepSeekV41Inference``: the numerics of DeepSeek's own inference
code (docs/numerics.md, docs/v41.md)."""

from __future__ import annotations

import jax.numpy as jnp

from ._formats import fp4_e2m1_round_trip, fp8_e4m3_round_trip, hadamard
from ._numerics import V41_FORMATS, AbstractNumerics, DeepSeekFormats
from ._ops import upcast

__all__ = ["DeepSeekInference", "DeepSeekV41Inference"]

_SCALE_FMTS = (None, "ue8m0")


class DeepSeekInference(AbstractNumerics):
    """What DeepSeek's inference code (``inference/model.py`` and ``kernel.py`` of
    DeepSeek-V3.2-Exp and DeepSeek-V4) computes, on bf16 weights:

    - bf16 activations (the layer's input and every projection; norms, RoPE and softmax in
      float32, cast back), the output cast back to the input's dtype;
    - the indexer's queries and keys rotated by a Hadamard matrix and round-tripped through
      FP8 E4M3 in 128-blocks (V3.2; power-of-two scales when ``scale_fmt`` is set) or FP4 E2M1
      in 32-blocks with E8M0 scales (V4); V4's scores rounded to bf16 as its bf16 einsum does;
    - V4: the compressor in float32 (its windows cast to bf16 before their norm), and the
      window rows' and compressed entries' non-rotary channels round-tripped in 64-blocks
      through FP8 (``kv_fp8=True``, V4-Pro's kernel file) or through bf16, a no-op with
      power-of-two scales (``kv_fp8=False``, V4-Flash's kernel file).

    Quantisation passes gradients straight through (quantisation-aware training). FP8
    weight GEMMs (the activation quantisation in front of each FP8 projection) are not
    modelled: weights are dequantised when loaded.

    **Arguments:**

    - ``scale_fmt``: ``"ue8m0"`` (power-of-two FP8 scales, as DeepSeek's released configs) or
        ``None`` (``amax / 448``); the loaders read it from the checkpoint's config.
    - ``kv_fp8``: round-trip V4's KV through FP8 (V4-Pro) rather than bf16 (V4-Flash).
    """

    scale_fmt: str | None = "ue8m0"
    kv_fp8: bool = False

    def __check_init__(self):
        if self.scale_fmt not in _SCALE_FMTS:
            raise ValueError(f"scale_fmt must be None or 'ue8m0' (got {self.scale_fmt!r})")
        if not isinstance(self.kv_fp8, bool):
            raise ValueError(f"kv_fp8 must be a bool (got {self.kv_fp8!r})")

    def layer_input(self, x):
        return x.astype(jnp.bfloat16)

    def compressor_input(self, x):
        return x.astype(jnp.float32)

    def entry_dtype(self, x):
        return x.dtype

    def kv(self, kv, rope_dim, formats: DeepSeekFormats):
        nope, rope = kv[..., :-rope_dim], kv[..., -rope_dim:]
        through = None if self.kv_fp8 else jnp.bfloat16
        pow2 = self.scale_fmt is not None
        nope = fp8_e4m3_round_trip(nope, formats.kv_block, pow2, cast_to=through)
        return jnp.concatenate([nope.astype(kv.dtype), rope], axis=-1)

    def indexer(self, v, formats: DeepSeekFormats):
        rotated = hadamard(v)
        if formats.indexer == "fp8_e4m3":
            q = fp8_e4m3_round_trip(rotated, formats.indexer_block, self.scale_fmt is not None)
        else:
            q = fp4_e2m1_round_trip(rotated, formats.indexer_block)
        return q  # float32: DeepSeek's kernels apply the scales in float32

    def score_dtype(self, formats: DeepSeekFormats):
        return formats.score_dtype

    def check(self, formats: DeepSeekFormats, config) -> None:
        if formats == V41_FORMATS:
            raise ValueError(
                "DeepSeekInference is the numerics of V4 and V3.2 layers; use "
                "DeepSeekV41Inference for V4.1 layers (V41Attention)"
            )
        d, block = config.index_head_dim, formats.indexer_block
        if d & (d - 1) or d % block:
            raise ValueError(
                f"index_head_dim={d} must be a power of two and a multiple of {block} for "
                "DeepSeekInference numerics (Hadamard rotation, quantisation blocks)"
            )
        if formats.kv_block:
            nope = config.head_dim - config.rope_dim
            if nope % formats.kv_block:
                raise ValueError(
                    f"head_dim - rope_dim = {nope} must be a multiple of {formats.kv_block} "
                    "for DeepSeekInference numerics (the KV round trip's blocks)"
                )


class DeepSeekV41Inference(AbstractNumerics):
    """What DeepSeek-V4.1-Flash's inference code (``inference/model.py`` and the arithmetic of
    its ``kernel.py``) computes in a ``V41Attention`` layer, on bf16 weights (docs/v41.md,
    "Quantised inference"):

    - bf16 activations, as ``DeepSeekInference`` (norms, RoPE and softmax in float32, cast
        back); the ratio-2 compressor projects and pools in float32 (``compressor_input``)
        and casts its groups to bf16 before their norm (``entry_dtype``);
    - the window rows after RoPE round-tripped through FP8 E4M3 over the whole vector, RoPE
        channels included, in 32-blocks with power-of-two scales (``act_quant(kv, 32, "ue8m0")``);
    - the compressed entries after RoPE through FP4 E2M1 in 16-blocks with E4M3 scales
        (``fp4_act_quant(latent, 16, scale_dtype=float8_e4m3fn)``);
    - the indexer's queries and keys after RoPE through FP4 E2M1 in 32-blocks with E8M0 scales,
        without V4's Hadamard rotation; the scores rounded to bf16 as its bf16 einsum does.

    Quantisation passes gradients straight through. FP8 weight GEMMs (``dtype="fp8"``, which
    also quantise each projection's input) are not modelled: weights are dequantised when
    loaded. Only ``V41Attention`` layers take it (``DeepSeekInference`` is V4's and V3.2's).
    """

    def layer_input(self, x):
        return x.astype(jnp.bfloat16)

    def compressor_input(self, x):
        return upcast(x)  # the pooled groups project and pool in float32

    def entry_dtype(self, x):
        return x.dtype

    def kv(self, kv, rope_dim, formats: DeepSeekFormats):
        return fp8_e4m3_round_trip(kv, formats.kv_block, True).astype(kv.dtype)

    def entries(self, entries, rope_dim, formats: DeepSeekFormats):
        return fp4_e2m1_round_trip(entries, _ENTRY_BLOCK, "e4m3").astype(entries.dtype)

    def indexer(self, v, formats: DeepSeekFormats):
        return fp4_e2m1_round_trip(v, formats.indexer_block)

    def score_dtype(self, formats: DeepSeekFormats):
        return formats.score_dtype

    def check(self, formats: DeepSeekFormats, config) -> None:
        if formats != V41_FORMATS:
            raise ValueError(
                "DeepSeekV41Inference is the numerics of V4.1 layers (V41Attention); use "
                "DeepSeekInference for V4 and V3.2 layers"
            )
        for field, size, block in (
            ("head_dim", config.head_dim, formats.kv_block),
            ("head_dim", config.head_dim, _ENTRY_BLOCK),
            ("index_head_dim", config.index_head_dim, formats.indexer_block),
        ):
            if size % block:
                raise ValueError(
                    f"{field}={size} must be a multiple of {block} for DeepSeekV41Inference "
                    "numerics (its quantisation blocks)"
                )


_ENTRY_BLOCK = 16  # V4.1's compressed entries: FP4 blocks of 16 with E4M3 scales
