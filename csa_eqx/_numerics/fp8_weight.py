"""An FP8 projection weight as DeepSeek's checkpoints store it (docs/numerics.md, "FP8
checkpoints"); the product DeepSeek computes with it is ``csa_eqx._numerics.fp8_linear``'s."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Float8e4m3fn

__all__ = ["Fp8Weight"]


class Fp8Weight(eqx.Module):
    """A projection weight in FP8 E4M3 with one float32 scale per ``block`` tile, in torch's
    ``[out, in]`` layout: DeepSeek's ``weight`` + ``scale`` (``weight_scale_inv``) pair, whose
    product ``values · scale`` is the weight.

    The values stay FP8 (not a dequantised float array) because DeepSeek's product needs them
    and their scales apart (``fp8_product`` scales each tile's partial sums), because the
    checkpoint's one byte a weight is what a released model fits in, and because the type
    says which projections DeepSeek runs through its FP8 GEMM. It is not trained: gradients
    reach the input, not the weight (``fp8_linear``); ``dequantize`` gives a float array to
    fine-tune.

    **Arguments:**

    - ``values``: ``float8_e4m3fn [out, in]``.
    - ``scale``: float32 ``[ceil(out / block[0]), ceil(in / block[1])]`` (E8M0 scales
        decoded; the tiles at the edges are ragged).
    - ``block``: the tile ``(rows, columns)``: 128 x 128 for V3.2 and V4, 32 x 32 for V4.1.
    """

    values: Float8e4m3fn[Array, "out in"]
    scale: Float[Array, "out_blocks in_blocks"]
    block: tuple[int, int] = eqx.field(static=True)

    def __check_init__(self):
        if self.values.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"Fp8Weight values must be float8_e4m3fn (got {self.values.dtype})")
        grid = tuple(-(-n // b) for n, b in zip(self.values.shape, self.block, strict=True))
        if self.scale.shape != grid:
            raise ValueError(
                f"Fp8Weight scale has shape {self.scale.shape}, expected {grid} (one per "
                f"{self.block[0]}x{self.block[1]} tile of the {self.values.shape} weight)"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """**Returns:** ``(out, in)``."""
        return self.values.shape

    def dequantize(self, dtype=jnp.float32) -> Float[Array, "out in"]:
        """**Arguments:** the result's ``dtype``.

        **Returns:** ``values · scale`` ``[out, in]``, computed in float32 (exact for
        power-of-two scales, then exactly representable in bf16 too) and cast to ``dtype``."""
        rows, cols = self.block
        out, inp = self.values.shape
        scale = jnp.repeat(jnp.repeat(self.scale, rows, axis=0), cols, axis=1)[:out, :inp]
        return (self.values.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
