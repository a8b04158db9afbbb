"""What the Pallas kernels share (``_scorer/triton.py``, ``_selection/triton.py``,
``_attention/triton.py``; docs/kernels.md): where they run, their Triton compiler parameters,
the power-of-two shapes Triton needs and the in-kernel scoring of one tile.

**Pallas Triton, not Mosaic GPU.** The kernels are written in the portable subset of
``pallas_call`` (a grid, whole-array refs, ``jnp`` / ``lax`` ops, loops) plus Triton's masked
pointer loads and stores (``jax.experimental.pallas.triton``): gathering a query's picked rows
and scattering its candidates into a buffer are pointer arithmetic there, and the same kernel
body runs unchanged in interpret mode on the CPU, where the test suite proves it. Mosaic GPU
(``plgpu.kernel``, wgmma / TMA) would be faster on a Hopper GPU but offers neither arbitrary
row gathers nor per-lane scatters, has no interpret path for these ops, and its programming
model (warpgroup arrays, explicit shared-memory pipelines) would be a second kernel to prove
without a device. The Triton backend is deprecated from JAX 0.11 (a warning on JAX 0.12; it
still lowers), so the kernels are the ones to port when it goes. TPU (Mosaic) does not carry
the design: it has no masked pointer gathers or scatters, so a TPU runs kernels of its own
(``MosaicSelection``, ``MosaicAttention``) or the XLA paths, and a Triton kernel forced there
refuses at lowering with a message naming it (``TPU_REFUSED``).

Every ``pallas_call`` passes Triton's ``CompilerParams`` (JAX 0.10 may otherwise pick Mosaic
GPU) and runs in interpret mode when lowered for the CPU (``run_kernel``: a per-platform
choice at lowering, so no module outside ``_backend.py`` asks for the backend). Triton needs
power-of-two block shapes and dots of at least 16 x 16 x 16: feature widths are split into
power-of-two parts of at least 16 (``feature_parts``; zero padding leaves dots unchanged), head
counts padded to a power of two of at least 16, and automatic tiles are at least 16 (tiles
forced smaller run in interpret mode only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._backend import kernel_interpret, target_platform
from ._dispatch import launch

__all__ = [
    "run_kernel",
    "barrier",
    "next_pow2",
    "floor_pow2",
    "feature_parts",
    "tile_scores",
    "count",
    "dot_t",
    "sum_in_order",
]

MIN_DOT = 16  # Triton's smallest dot side
TPU_REFUSED = (
    "csa_eqx's Pallas kernel {name!r} is a Triton (GPU) kernel and cannot be lowered for a TPU: "
    "Mosaic TPU has none of its masked pointer gathers and scatters (docs/kernels.md). On a TPU "
    "the automatic choices run the Mosaic kernels (MosaicSelection, MosaicAttention) or the XLA "
    "paths; do not force TritonSelection, TritonAttention or TritonScorer there."
)
GPU_ONLY = (
    "csa_eqx's Pallas kernel {name!r} is a Triton (GPU) kernel: it is compiled for a GPU only "
    "(interpret=True runs it interpreted anywhere; docs/kernels.md)."
)


def run_kernel(make_kernel, out_shape, grid, name: str, *args, interpret, aliases=None):
    """Run a kernel over ``grid`` with whole-array refs: compiled by Triton (its
    ``CompilerParams``) or in interpret mode, as ``kernel_interpret`` decides for a GPU
    kernel once, when the program is traced (interpret mode on the CPU; a ``NotImplementedError``
    naming the kernel, ``TPU_REFUSED``, where it would be compiled for a TPU).

    **Arguments:** ``make_kernel(interpret)`` returning the kernel body, the ``out_shape``
    (``jax.ShapeDtypeStruct`` pytree), the ``grid``, the kernel's ``name``, its ``args``, the
    strategy's ``interpret`` field and ``aliases`` (``input_output_aliases``).

    **Returns:** the kernel's outputs.
    """
    refused = (TPU_REFUSED if target_platform() == "tpu" else GPU_ONLY).format(name=name)

    def build(interpret, out_shape):
        return pl.pallas_call(
            make_kernel(interpret),
            out_shape=out_shape,
            grid=grid,
            interpret=interpret,
            name=name,
            input_output_aliases=aliases or {},
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        )

    mode = bool(kernel_interpret(interpret, "gpu", refused))
    return launch(build, mode, out_shape, args, name)


def barrier(interpret: bool) -> None:
    """Order a block's global-memory stores before its next loads (``__syncthreads``); the
    interpreter runs a block in order, so there it is nothing."""
    if not interpret:
        plgpu.debug_barrier()


def next_pow2(n: int, floor: int = 1) -> int:
    """**Returns:** the least power of two ``>= max(n, floor)``."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def floor_pow2(n: int) -> int:
    """**Returns:** the largest power of two ``<= n`` (``n >= 1``)."""
    return 1 << (n.bit_length() - 1)


def feature_parts(width: int) -> tuple[tuple[int, int], ...]:
    """Power-of-two column ranges ``(start, size)``, each at least 16, covering ``width``
    padded to a multiple of 16 (576 -> 512 + 64; 8 -> 16): a dot over a width Triton cannot
    tile is the sum of dots over these parts.

    **Arguments:** the feature ``width`` (``>= 1``).

    **Returns:** the parts, widest first; their sizes sum to the padded width.
    """
    padded = -(-width // MIN_DOT) * MIN_DOT
    parts, start = [], 0
    for bit in reversed(range(padded.bit_length())):
        size = 1 << bit
        if padded & size:
            parts.append((start, size))
            start += size
    return tuple(parts)


def count(mask, axis: int = -1):
    """int32 number of ``True`` along ``axis`` (Triton lowers no boolean reductions)."""
    return jnp.sum(mask.astype(jnp.int32), axis=axis)


def sum_in_order(terms):
    """``((t0 + t1) + t2) + ...`` of a non-empty iterable (no leading zero: it would turn a
    ``-0.0`` into ``+0.0``)."""
    terms = iter(terms)
    total = next(terms)
    for t in terms:
        total = total + t
    return total


def dot_t(a, b):
    """``a [m, k] . b [n, k]^T`` in float32 (IEEE float32 for float32 inputs)."""
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def tile_scores(q_ref, w_ref, b, r0, rows: int, keys, parts, heads: int, chunk: int, score_dtype):
    """Inside a kernel: the indexer scores of queries ``r0 .. r0 + rows`` of batch row ``b``
    against one key tile, as ``csa_eqx.indexer_scores`` forms them (the head sum in chunks of
    ``chunk`` heads, each chunk's sum added to the running one; each term rounded to
    ``score_dtype`` when given, the total too).

    **Arguments:** refs ``q [B, S, H, D]`` (feature-padded) and ``w [B, S, H]`` (float32,
    ``d^-1/2`` included), the batch row ``b`` and first query ``r0``, the number of ``rows``,
    the tile's ``keys`` (one ``[kb, size]`` array per feature part), the ``parts``
    (``feature_parts``), the head count, the heads per ``chunk`` and ``score_dtype``
    (``None``: float32 throughout).

    **Returns:** float32 ``[rows, kb]``.
    """
    kb = keys[0].shape[0]
    zeros = jnp.zeros((rows, kb), jnp.float32)

    def head(h, acc):
        dots = (
            dot_t(q_ref[b, pl.ds(r0, rows), h, pl.ds(start, size)], k)
            for (start, size), k in zip(parts, keys, strict=True)
        )
        logits = sum_in_order(dots)
        w = w_ref[b, pl.ds(r0, rows), h][:, None]
        if score_dtype is None:
            return acc + jnp.maximum(logits, 0.0) * w
        rounded = jnp.maximum(logits.astype(score_dtype).astype(jnp.float32), 0.0)
        term = rounded * w.astype(score_dtype).astype(jnp.float32)
        return acc + term.astype(score_dtype).astype(jnp.float32)

    def chunk_sum(c, acc):
        return acc + jax.lax.fori_loop(c * chunk, (c + 1) * chunk, head, zeros)

    scores = jax.lax.fori_loop(0, heads // chunk, chunk_sum, zeros)
    if score_dtype is None:
        return scores
    return scores.astype(score_dtype).astype(jnp.float32)
