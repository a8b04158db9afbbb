"""The automatic execution choices: every backend and size heuristic of the library lives
here.

``backend_tiles`` sizes the selection's and the indexer loss' tiles for the backend (and says
whether the radix select unrolls); ``AutoSelection`` picks the fused Pallas indexer on a GPU
(``uses_kernels``) and elsewhere the dense, the streaming or the gathered top-k,
``AutoIndexerLoss`` the dense, the streaming or the gathered KL loss, both by one size rule
(``streams``) and one rule for V4.1's pre-filter (``filter_bites``), ``AutoPicks`` a masked
matmul or a gather for the attention over each query's picked entries (docs/memory.md,
"Streaming top-k" and "Masked picks") and ``AutoAttention`` the Pallas attention kernel on a
GPU, XLA's elsewhere (docs/kernels.md). Force a path by passing a concrete strategy instead
(``DenseSelection()``, ``StreamingSelection(...)``, ``GatheredSelection()``,
``PallasSelection(...)``, ``DenseIndexerLoss()``, ``StreamingIndexerLoss(...)``,
``GatheredIndexerLoss()``, ``MaskedPicks()``, ``GatheredPicks()``, ``XlaAttention()``,
``PallasAttention(...)``) and tile sizes by ``Execution(tiles=TileSizes(...))``.
``attention_query_block`` sizes the attention kernel's query blocks (``Execution(query_block=...)``
forces one).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
from jax.sharding import AxisType
from jaxtyping import Array, Int

from ._attention_kernel import AbstractAttentionKernel
from ._attention_pallas import PallasAttention
from ._attention_xla import XlaAttention
from ._candidates import CandidateVisibility
from ._loss_dense import DenseIndexerLoss
from ._loss_gathered import GatheredIndexerLoss
from ._loss_streaming import StreamingIndexerLoss
from ._picks import AbstractPicks, GatheredPicks, MaskedPicks
from ._problem import AbstractIndexerLoss, AbstractSelection, SelectionProblem
from ._reads import Reads
from ._selection_dense import DenseSelection
from ._selection_gathered import GatheredSelection
from ._selection_pallas import PallasSelection
from ._selection_streaming import StreamingSelection
from ._tiles import TileSizes, power_of_two_block, sparse_query_block

__all__ = [
    "AutoAttention",
    "AutoSelection",
    "AutoIndexerLoss",
    "AutoPicks",
    "backend_tiles",
    "tile_elements",
    "shared_tiles",
    "streams",
    "filter_bites",
    "uses_kernels",
    "CPU_TILES",
    "ACCELERATOR_TILES",
    "attention_query_block",
    "expanded_query_block",
    "sparse_query_block",
]

# CPU: tiles that stay in cache (64 MiB float32 at most), the radix select a loop (unrolling
# only slows compiles, ~1.5 s per layer). Accelerators: every loop iteration costs launches and
# a predicate round trip, so tiles are 4x larger, loops 4-16x shorter and the radix select's
# 32 steps unrolled (measured on an H200: 128-entry tiles made the selection ~1.3x slower than
# 512).
CPU_TILES = TileSizes(elements=1 << 24, key_block=128, max_query_block=256, unroll=False)
ACCELERATOR_TILES = TileSizes(elements=1 << 26, key_block=512, max_query_block=1024, unroll=True)


def backend_tiles() -> TileSizes:
    """**Returns:** the tile sizes for the backend the computation is traced for
    (``CPU_TILES`` on CPU, ``ACCELERATOR_TILES`` elsewhere); ``Execution(tiles=None)``
    uses these."""
    return CPU_TILES if jax.default_backend() == "cpu" else ACCELERATOR_TILES


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


def uses_kernels() -> bool:
    """**Returns:** whether the automatic choices run the Pallas kernels (``PallasSelection``,
    ``PallasAttention``): on a GPU (Triton), for the backend the computation is traced for,
    where no mesh axis in context is sharded by the compiler (none, or all ``Manual``: inside
    the placements' ``shard_map``; a kernel is one device's program). Not on the CPU, where
    they run only in interpret mode (proven there, far slower than XLA), nor on a TPU, which
    their design does not carry (docs/kernels.md)."""
    mesh = jax.sharding.get_abstract_mesh()
    local = all(t == AxisType.Manual for t in getattr(mesh, "axis_types", ()))
    return jax.default_backend() == "gpu" and local


def tile_elements() -> int:
    """**Returns:** the elements of one automatic tile (and of one row buffer) for the current
    backend: 2^24 on CPU, 2^26 on accelerators."""
    return backend_tiles().elements


def streams(batch: int, seq: int, entries: int, heads: int, tiles: TileSizes) -> bool:
    """The one size rule of the automatic selection and indexer loss.

    **Arguments:** the problem's ``batch``, ``seq``, ``entries``, ``heads`` at once and the
    backend's ``tiles``.

    **Returns:** whether the largest dense score tensor ``[B, S, heads, T]`` passes one tile
    (``tiles.elements``), so the computation should stream.
    """
    return batch * seq * entries * max(heads, 1) > tiles.elements


def filter_bites(visibility, entries: int) -> bool:
    """The one rule for V4.1's pre-filter (docs/v41.md, "Candidates").

    **Arguments:** a problem's ``visibility`` and its number of ``entries`` ``T``.

    **Returns:** whether it is a ``CandidateVisibility`` whose filter can drop a visible entry:
    with ``Nb`` at least the ``ceil(T / bc)`` blocks there are, the filter keeps every block
    holding a visible entry, and the plain visibility picks the same.
    """
    if not isinstance(visibility, CandidateVisibility):
        return False
    return -(-entries // visibility.block_size) > visibility.candidates.shape[-1]


def _unfiltered(problem: SelectionProblem) -> SelectionProblem:
    """``problem`` with a pre-filter that cannot bite dropped (same answers, cheaper paths)."""
    visibility = problem.visibility
    if isinstance(visibility, CandidateVisibility) and not filter_bites(
        visibility, problem.keys.shape[1]
    ):
        return problem._replace(visibility=visibility.base)
    return problem


class _DenseOrStreaming(eqx.Module):
    """What ``AutoSelection`` and ``AutoIndexerLoss`` share: the strategy ``dense()`` while
    ``streams`` says the problem fits one tile, else ``gathered(query_block=query_block)``
    where V4.1's pre-filter bites (``filter_bites``: each query's candidates are far fewer
    than the entries) and ``streaming(query_block=query_block)`` otherwise.

    **Arguments:**

    - ``query_block``: queries per block when it streams (0 = automatic).
    """

    query_block: int = 0
    dense: ClassVar[type]
    streaming: ClassVar[type]
    gathered: ClassVar[type]

    def choose(
        self,
        batch: int,
        seq: int,
        entries: int,
        heads: int,
        tiles: TileSizes = CPU_TILES,
        filtered: bool = False,
    ):
        """**Arguments:** the sizes (``SelectionProblem.sizes``; for the loss
        ``AbstractIndexerLoss.sizes``), the ``tiles`` and whether a pre-filter bites
        (``filtered``).

        **Returns:** ``dense()`` (``DenseSelection()`` / ``DenseIndexerLoss()``) unless
        ``streams``; else ``gathered(query_block=query_block)`` when ``filtered``
        (``GatheredSelection`` / ``GatheredIndexerLoss``), ``streaming(query_block=...)``
        (``StreamingSelection`` / ``StreamingIndexerLoss``) otherwise.
        """
        if not streams(batch, seq, entries, heads, tiles):
            return self.dense()
        return (self.gathered if filtered else self.streaming)(query_block=self.query_block)


class AutoSelection(_DenseOrStreaming, AbstractSelection):
    """On a GPU (``uses_kernels``) the fused Pallas indexer, ``PallasSelection()``, for a
    problem whose visibility has no biting V4.1 pre-filter. Otherwise dense while the largest
    score tensor ``[B, S, heads at once, T]`` fits one automatic tile
    (``SelectionProblem.tiles.elements``: 2^24 elements on CPU, 2^26 on accelerators), beyond
    it streaming (``streams``), or gathered where a V4.1 consumer's pre-filter bites
    (``filter_bites``): ``DenseSelection``, ``StreamingSelection`` or ``GatheredSelection``. A
    pre-filter that cannot bite is dropped first (the same picks). Every choice selects the
    same entries (bitwise where the scores are).

    **Arguments:**

    - ``query_block``: queries per block when it streams (0 = automatic).
    """

    dense = DenseSelection
    streaming = StreamingSelection
    gathered = GatheredSelection

    def strategy(self, problem: SelectionProblem) -> AbstractSelection:
        """**Arguments:** the ``problem``.

        **Returns:** ``PallasSelection()`` on a GPU unless a V4.1 pre-filter bites, else
        ``choose`` of its sizes, tiles and pre-filter (of the problem with a pre-filter that
        cannot bite dropped).
        """
        problem = _unfiltered(problem)
        filtered = filter_bites(problem.visibility, problem.keys.shape[1])
        if not filtered and uses_kernels():
            return PallasSelection()
        return self.choose(*problem.sizes(), problem.tiles, filtered)

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        return self.strategy(problem).select(_unfiltered(problem), k)

    def select_candidates(self, problem, k, topk_blocks, block_size):
        method, problem = self.strategy(problem), _unfiltered(problem)
        return method.select_candidates(problem, k, topk_blocks, block_size)


class AutoIndexerLoss(_DenseOrStreaming, AbstractIndexerLoss):
    """The dense KL loss while its largest tensor ``[B, S, heads at once, T]`` fits one tile,
    beyond it streaming, or gathered where a V4.1 consumer's pre-filter bites: the rules of
    ``AutoSelection`` (``streams``, ``filter_bites``), with the heads at once counting the
    attention's heads too (``AbstractIndexerLoss.sizes``): ``DenseIndexerLoss``,
    ``StreamingIndexerLoss`` or ``GatheredIndexerLoss``. **Arguments:** as for
    ``AutoSelection``.
    """

    dense = DenseIndexerLoss
    streaming = StreamingIndexerLoss
    gathered = GatheredIndexerLoss

    def loss(self, problem, target, selection=None):
        problem = _unfiltered(problem)
        filtered = filter_bites(problem.visibility, problem.keys.shape[1])
        method = self.choose(*self.sizes(problem, target), problem.tiles, filtered)
        return method.loss(problem, target, selection)


class AutoPicks(AbstractPicks):
    """A masked matmul over all entries while there are at most ``ratio`` entries per pick
    (``T <= ratio * k``), else a gather of the picks: a matmul over ``T`` entries is far
    cheaper than gathering ``k`` rows per query, and its gradient needs no scatter-add.

    **Arguments:**

    - ``ratio``: entries per pick up to which the picks are attended by a masked matmul.
    """

    ratio: int = 4

    def choose(self, entries: int, picks: int) -> AbstractPicks:
        """**Arguments:** the entry count ``T`` and picks per query ``k``.

        **Returns:** ``MaskedPicks()`` when ``T <= ratio * k``, else ``GatheredPicks()``.
        """
        return MaskedPicks() if entries <= self.ratio * picks else GatheredPicks()

    def reads(self, keys, visibility, picks, values=None):
        return self.choose(keys.shape[1], picks.shape[-1]).reads(keys, visibility, picks, values)


class AutoAttention(AbstractAttentionKernel):
    """The attention kernel for the backend: ``PallasAttention()`` on a GPU (``uses_kernels``;
    it reads every kind of ``Reads``), ``XlaAttention()`` elsewhere and under numerics that
    round the attention (``exact_softmax`` false: ``DeepSeekInference``). The same outputs
    either way up to float32 rounding. **Arguments:** none."""

    def choose(self, numerics=None) -> AbstractAttentionKernel:
        """**Arguments:** the layer's numerics (``None``: exact).

        **Returns:** ``PallasAttention()`` on a GPU under exact-softmax numerics, else
        ``XlaAttention()``."""
        exact = numerics is None or numerics.exact_softmax
        return PallasAttention() if uses_kernels() and exact else XlaAttention()

    def attend(self, q, reads, sinks, scale, *, return_lse=False, query_block, numerics=None):
        kernel = self.choose(numerics)
        kw = dict(return_lse=return_lse, query_block=query_block, numerics=numerics)
        return kernel.attend(q, reads, sinks, scale, **kw)


def attention_query_block(batch: int, heads: int, reads: Reads, elements: int = 1 << 24) -> int:
    """The attention kernel's automatic query block for ``reads``: as ``sparse_query_block``
    for the gathered rows (summed over the read sets) and the dense entries, and with a band
    at most the power of two above ``window - 1`` (each block reads a slab of
    ``block + window - 1`` rows: keep the block near the window).

    **Arguments:** the queries' ``batch`` and ``heads``, the ``csa_eqx.Reads`` they attend and the
    block's budget of ``elements`` (``TileSizes.attention_elements``).

    **Returns:** the query block, a power of two >= 1.
    """
    per_row = 0
    for g in reads.gathered:  # gathered keys (+ values) and logits per pick
        width = g.keys.shape[-1] + (0 if g.values is None else g.values.shape[-1])
        per_row += g.indices.shape[-1] * (width + heads)
    if reads.dense is not None:  # logits and mask per entry
        per_row += reads.dense.keys.shape[1] * (heads + 1)
    block = power_of_two_block(batch, per_row, elements)
    if reads.band is not None:
        block = min(block, 1 << max(reads.band.window - 1, 1).bit_length())
    return block


def expanded_query_block(batch: int, heads: int, entries: int, elements: int = 1 << 24) -> int:
    """The query block of an attention whose keys and values are expanded per head (V3.2 under
    ``DeepSeekInference``: ``[B, block, H, T]`` scores and masks per block).

    **Arguments:** the queries' ``batch`` and ``heads``, the ``entries`` each query may read and
    the block's budget of ``elements`` (``TileSizes.attention_elements``).

    **Returns:** the query block, a power of two >= 1.
    """
    return power_of_two_block(batch, entries * (heads + 1), elements)
