"""Every question about the backend a computation is traced for, in one place: which tile sizes
the selection, the indexer loss and the attention use there (``backend_tiles``: one
``TileSizes`` per backend, ``CPU_TILES``, ``GPU_TILES``, ``TPU_TILES``), whose Pallas
kernels the choosers may run (``kernel_platform``) and whether a kernel runs compiled or
interpreted (``kernel_interpret``). Each asks ``target_platform``: the platform a program traced
now is built for. No other module asks ``jax.default_backend()`` (``tests/test_seams.py``).
"""

from __future__ import annotations

from typing import Any

import jax

from ._tiles import TileSizes

__all__ = [
    "CPU_TILES",
    "GPU_TILES",
    "TPU_TILES",
    "backend_tiles",
    "tile_elements",
    "shared_tiles",
    "kernel_platform",
    "target_platform",
    "kernel_interpret",
    "kernel_dtypes",
    "Interpret",
]

# CPU: tiles that stay in cache (64 MiB float32 at most), the radix select a loop (unrolling
# only slows compiles, ~1.5 s per layer). Accelerators: every loop iteration costs launches and
# a predicate round trip, so tiles are 4x larger, loops 4-16x shorter and the radix select's
# 32 steps unrolled (measured on an H200: 128-entry tiles made the selection ~1.3x slower than
# 512).
CPU_TILES = TileSizes(elements=1 << 24, key_block=128, max_query_block=256, unroll=False)
GPU_TILES = TileSizes(elements=1 << 26, key_block=512, max_query_block=1024, unroll=True)
# TPU: the XLA fallback's (MosaicSelection is the automatic selection there). XLA on a TPU runs
# gathers inside loops slowly (the radix select's compaction: ~95 % of a layer, measured on a
# v5e), so the exact select is lax.top_k on integer order keys and a sort of the k picks
# (select="top_k", gather-free; lax.top_k [16384, 4096] k 512: 36.6 ms there). The row buffer
# [B, Qb, T] holds every entry up to T = 2^26 / Qb (65536 at Qb = 1024), so a query block takes
# one top-k and no merge; the [B, Qb, H, Kb] float32 logits of a tile (128 MiB at 64 heads) are
# the HBM round trip that bounds the scoring. Key tiles of 512: 4 MXU passes wide, and causal
# skipping wastes under an eighth of the scored pairs at 16k (docs/kernels.md, "The XLA path on
# a TPU").
TPU_TILES = TileSizes(
    elements=1 << 26, key_block=512, max_query_block=1024, unroll=True, select="top_k"
)

_TILES = {"cpu": CPU_TILES, "gpu": GPU_TILES, "tpu": TPU_TILES}


def backend_tiles(tiles: TileSizes | None = None) -> TileSizes:
    """**Arguments:** tile sizes a user forced (``Execution.tiles``; ``None``: none).

    **Returns:** ``tiles`` when given, else the sizes of the backend the computation is traced
    for (``CPU_TILES``, ``GPU_TILES``, ``TPU_TILES``; another backend gets the GPU's)."""
    if tiles is not None:
        return tiles
    return _TILES.get(target_platform(), GPU_TILES)


def tile_elements() -> int:
    """**Returns:** the elements of one automatic tile (and of one row buffer) for the current
    backend: 2^24 on CPU, 2^26 on accelerators."""
    return backend_tiles().elements


def shared_tiles(tiles: TileSizes, devices: int) -> TileSizes:
    """The tiles of one of ``devices`` that share a sequence (context parallelism), so that each
    device's working buffers shrink with its share of the rows as its activations do: the
    attention's query-block budget divided by ``devices`` (at least 2^20 elements), and the
    selection's tile and row-buffer budget by ``devices**2`` (at least 2^18): a row buffer
    ``[B, Qb, T]`` spans every entry of the whole sequence, so its query block must shrink
    too (measured: docs/memory.md, "Context parallelism").

    **Arguments:** the whole problem's ``tiles`` and the number of ``devices``.

    **Returns:** the per-device ``TileSizes`` (key blocks, query-block caps and unrolling kept).
    """

    def share(elements: int, by: int, floor: int) -> int:
        return max(elements // by, min(elements, floor))

    return tiles._replace(
        elements=share(tiles.elements, devices**2, 1 << 18),
        attention_elements=share(tiles.attention_elements, devices, 1 << 20),
    )


def target_platform() -> str:
    """**Returns:** the platform a program traced now is built for (``"cpu"``, ``"gpu"`` or
    ``"tpu"``, as ``jax.default_backend()`` names them): the devices' platform of the mesh in
    context where it names one (``jax.set_mesh``, ``jax.sharding.use_abstract_mesh`` with an
    ``AbstractDevice``: how a program is built for a platform this process does not run), else
    ``jax.default_backend()``."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def kernel_platform(backend: str | None = None) -> str | None:
    """**Arguments:** the ``backend`` to answer for (``"cpu"``, ``"gpu"``, ``"tpu"``; ``None``:
    the platform the computation is traced for, ``target_platform``).

    **Returns:** the platform whose Pallas kernels the automatic choices run there:
    ``"tpu"`` (the Mosaic kernels: ``MosaicSelection``, ``MosaicAttention``, measured on a TPU
    v5e), also under a mesh the compiler shards
    (the kernels then run per device: ``csa_eqx._mesh.per_device``); ``None`` elsewhere: on the
    CPU kernels run only in interpret mode (proven there, far slower than XLA), and on a GPU
    the Triton kernels (``TritonSelection``, ``TritonAttention``) have not been measured on
    one, so the XLA path is the automatic choice there (they stay available by name)."""
    return "tpu" if (backend or target_platform()) == "tpu" else None


# What a kernel strategy's ``interpret`` field holds: ``None`` (decided by the platform the
# program is built for), ``True`` / ``False``, or Pallas' TPU interpreter's parameters
# (``pltpu.InterpretParams``: simulated memories; it carries IO effects, for kernel-alone tests).
Interpret = Any


def kernel_dtypes(*dtypes) -> bool:
    """**Returns:** whether the Pallas kernels take arrays of these ``dtypes``: 32 bits or
    fewer (Mosaic and Triton compute in float32 at most; a float64 layer under
    ``jax_enable_x64`` takes the XLA strategies)."""
    return all(jax.numpy.dtype(d).itemsize <= 4 for d in dtypes)


def kernel_interpret(interpret: Interpret, platform: str, refused: str) -> Interpret:
    """The interpret choice of a kernel for ``platform`` (``"tpu"``: Mosaic, ``"gpu"``: Triton),
    decided once, when the program is traced: no program carries a branch per platform, and
    none an effect (plain ``interpret=True`` declares none).

    **Arguments:** the strategy's ``interpret`` field (``None``: compiled where the program is
    built for ``platform``, interpreted where it is built for the CPU; ``True``: interpreted
    anywhere; ``False``: compiled; ``pltpu.InterpretParams``: Pallas' TPU interpreter), the
    kernel's ``platform`` and the message ``refused`` to raise where it cannot run.

    **Returns:** ``True``, ``False`` or the ``InterpretParams`` given; a ``NotImplementedError``
    (``refused``) where the kernel would be compiled for another platform than its own.
    """
    target = target_platform()
    if interpret is None:
        if target == "cpu":
            return True
        interpret = False
    if interpret is False and target != platform:
        raise NotImplementedError(refused)
    return interpret
