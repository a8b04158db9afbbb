"""``MosaicSelection``: the fused indexer on a TPU, scoring and exact top-k in one Mosaic
(Pallas TPU) kernel that never writes a score to HBM (``mosaic_topk.py``; docs/kernels.md,
"The Mosaic fused indexer (TPU)").

The kernel forms the scores itself, exactly as ``csa_eqx.indexer_scores`` does (the problem's
``head_chunk`` and ``score_dtype``; its ``scorer`` is not called), and selects what
``select_topk`` selects given them: the other strategies' selection, bitwise, wherever the
scores are (tests/test_mosaic_selection.py). The queries are projected a chunk of rows at a
time (``kernel_row_chunks``, as ``TritonSelection``), one kernel call per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._backend import Interpret, kernel_dtypes
from .base import AbstractSelection, SelectionProblem
from .mosaic_topk import SEARCHES, fits_vmem, mosaic_topk
from .row_chunks import kernel_row_chunks

__all__ = ["MosaicSelection"]


def _power_of_two(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and not v & (v - 1)


class MosaicSelection(AbstractSelection):
    """The fused indexer for a TPU (score + exact top-k in one Mosaic kernel, see
    ``csa_eqx._selection.mosaic_topk``): Mosaic on a TPU, Pallas' interpret mode on the CPU
    (where it is proven, not fast); tracing it for any other platform raises a
    ``NotImplementedError`` naming the kernel. The selection is the other strategies' bitwise
    wherever the scores are. The defaults are the fastest block and search measured on a TPU v5e
    (docs/kernels.md, "The designs tried on the chip").

    It scores a plain ``Visibility``: a V4.1 consumer's ``CandidateVisibility`` is refused
    (``TypeError``; ``AutoSelection`` gives such a problem to ``GatheredSelection``), and a V4.1
    candidate source's blocks are not fused yet (the candidate source's chooser,
    ``csa_eqx._selection.auto.candidate_source``, streams them).

    **Arguments:**

    - ``query_block``: queries per grid step (a power of two, at least 16 on a TPU; halved
        while a step's VMEM estimate would pass 96 MiB).
    - ``key_block``: entries per key tile (a power of two, at least 128 on a TPU).
    - ``head_group``: heads stacked into one MXU matmul (a power of two; a divisor of the
        problem's head chunk is used).
    - ``search``: the threshold search (``"early"``, ``"secant"`` or ``"bisect"``; see
        ``csa_eqx._selection.mosaic_topk``).
    - ``query_chunk``: at most this many queries projected and selected per kernel call, the
        calls' chunks balanced (0 = automatic: as many as keep their ``[B, rows, H, d]``
        queries and picks within ``problem.tiles.elements``).
    - ``interpret``: ``None`` (compiled on a TPU, interpreted on the CPU: decided when the
        program is traced), ``True``, ``False`` or a ``pltpu.InterpretParams`` (Pallas' TPU
        interpreter: simulated memories, out-of-bounds reads raising; it carries IO effects,
        so only for the kernel alone: no ``jax.checkpoint`` or ``vmap`` around it).
    """

    query_block: int = 256
    key_block: int = 512
    head_group: int = 16
    search: str = "early"
    query_chunk: int = 0
    interpret: Interpret = None

    def __check_init__(self):
        for name in ("query_block", "key_block", "head_group"):
            v = getattr(self, name)
            if not _power_of_two(v):
                raise ValueError(f"MosaicSelection.{name} must be a power of two (got {v!r})")
        if self.search not in SEARCHES:
            raise ValueError(f"MosaicSelection.search must be one of {SEARCHES}")
        v = self.query_chunk
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"MosaicSelection.query_chunk must be an int >= 0 (got {v!r})")

    def fits(self, problem: SelectionProblem) -> bool:
        """**Arguments:** a ``problem``.

        **Returns:** whether the kernel runs it on a TPU: its inputs have 32 bits or fewer
        (``kernel_dtypes``) and every key of a batch row stays resident in VMEM, which past a
        few hundred thousand entries it cannot (lowered for a TPU such a problem is refused,
        naming ``StreamingSelection``)."""
        q = jax.eval_shape(problem.project, *problem.rows)[0]
        dtype = jnp.promote_types(q.dtype, problem.keys.dtype)
        return kernel_dtypes(dtype) and fits_vmem(
            problem.keys.shape[1], *q.shape[2:], dtype.itemsize, self.key_block, self.head_group
        )

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        fields = dict(
            query_block=self.query_block,
            key_block=self.key_block,
            head_group=self.head_group,
            head_chunk=problem.head_chunk,
            score_dtype=problem.score_dtype,
            search=self.search,
            interpret=self.interpret,
        )

        def kernel(q, w, keys, layout, query_index, query_segment):
            return mosaic_topk(q, w, keys, query_index, query_segment, layout, k, **fields)

        chunks = dict(block=self.query_block, key_block=self.key_block, per_row=k)
        return kernel_row_chunks(
            problem, k, kernel, "MosaicSelection", **chunks, query_chunk=self.query_chunk
        )
