"""How a layer runs, apart from what it computes: ``Execution`` holds the selection strategy,
the attention's picks and window strategies and its kernel, tile and head-chunk sizes, head
sharding of the indexer's activations, remat tagging, the default training stage of the
indexer loss and the numerics.

The layer configs (``V4AttentionConfig``, ``V32AttentionConfig``) mirror the checkpoint only;
``V4Attention(config, key=..., execution=Execution(...))`` decides how it runs. The default is
automatic for the backend (``AutoSelection``, ``AutoPicks``). The loaders' keyword options
(``qk_head_chunk_size=``, ``indexer_sharded_topk=``, …) map onto it with
``Execution.from_options``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import equinox as eqx
from jaxtyping import Array, Float, Int

from .._attention.auto import AutoAttention, AutoPicks, attention_query_block
from .._attention.base import AbstractAttentionKernel
from .._attention.pallas import PallasAttention
from .._attention.picks import AbstractPicks
from .._attention.reads import DenseKeys, Reads
from .._attention.window import AbstractWindow, BandWindow
from .._backend import backend_tiles, shared_tiles
from .._indexer.sharding import constrain_heads, tensor_axis_auto
from .._layout import Visibility
from .._loss.auto import AutoIndexerLoss
from .._loss.base import AbstractIndexerLoss
from .._loss.streaming import StreamingIndexerLoss
from .._numerics.base import AbstractNumerics, DeepSeekFormats, ExactNumerics
from .._numerics.deepseek import named_numerics
from .._placement.base import AbstractPlacement, SingleDevice
from .._placement.context import ContextParallel
from .._placement.heads import HeadParallel
from .._scorer.base import AbstractScorer, XlaScorer
from .._selection.auto import AutoSelection
from .._selection.base import AbstractSelection, SelectionProblem
from .._selection.candidates import CandidateVisibility
from .._selection.sharded import ShardedSelection
from .._selection.streaming import StreamingSelection
from .._tiles import TileSizes
from ..remat import tag_selection

__all__ = [
    "Execution",
    "IndexerLossStage",
    "INDEXER_LOSS_STAGES",
    "checked_execution",
    "loader_execution",
]

IndexerLossStage = Literal["off", "dense", "sparse"]
INDEXER_LOSS_STAGES = ("off", "dense", "sparse")


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} {rule} (got {value!r})")


def check_stage(stage: object) -> None:
    """``ValueError`` unless ``stage`` is one of ``"off"``, ``"dense"``, ``"sparse"``."""
    _require(
        stage in INDEXER_LOSS_STAGES, "indexer_loss", "must be 'off', 'dense' or 'sparse'", stage
    )


class Execution(eqx.Module):
    """How an attention layer runs (never what it computes: outputs agree across settings,
    selections bitwise), and how it rounds (``numerics``: the one field that changes the
    numbers, on purpose).

    **Arguments:**

    - ``selection``: the indexer top-k strategy (``AutoSelection()``, ``DenseSelection()``,
        ``StreamingSelection(key_block, query_block, topk_block)``, ``PallasSelection(...)``,
        ``ShardedSelection(inner, tensor_axis, data_axis)``).
    - ``picks``: how the attention reads the picked entries (``AutoPicks()``,
        ``MaskedPicks()``, ``GatheredPicks()``).
    - ``window``: how V4 reads the sliding window (``BandWindow()``: a banded matmul,
        ``GatheredWindow()``: gathered token rows), in the forward and in ``extend``
        (there over the cached ring's rows, then the chunk's).
    - ``attention``: the attention kernel that computes the softmax over what each query reads
        (``AutoAttention()``: ``PallasAttention()`` on a GPU, else ``XlaAttention()``, the
        reference; any ``AbstractAttentionKernel``), in the forward, the dense warm-up and
        ``extend``.
    - ``qk_head_chunk_size``: indexer heads (and, for the KL target, attention heads) scored
        at once (0 = all); must divide ``index_n_heads`` (and ``num_heads`` when the
        indexer loss is on).
    - ``query_block``: queries per block of the sparse attention (0 = automatic:
        ``csa_eqx._auto.attention_query_block``).
    - ``save_selection``: name the selection ``csa_eqx.SELECTION_NAME`` so that remat policies
        (``csa_eqx.remat.compose_selection_policy``) can save it.
    - ``indexer_heads_axis``: mesh axis to shard the indexer's per-head activations over
        (``None`` = off); its size must divide ``index_n_heads``.
    - ``context``: split the sequence over a mesh axis (``ContextParallel(axis)``; ``None`` =
        off). V4, V3.2 and V4.1 layers; ``extend`` refuses it (decoding runs on one device:
        ``check_one_device``).
    - ``heads``: split the attention heads over a mesh axis (``HeadParallel(axis)``; ``None`` =
        off). V4, V3.2 and V4.1 layers; composes with ``context`` (one ``shard_map`` over both
        axes), a ``ShardedSelection`` over the same axis and the indexer loss; not with
        ``indexer_heads_axis``; ``extend`` refuses it.
    - ``indexer_loss``: the default training stage of the indexer's KL loss: ``"off"``,
        ``"dense"`` (warm-up: all visible entries, attended densely too) or ``"sparse"``
        (the selected entries). A call can override it (``layer(x, indexer_loss=...)``).
    - ``numerics``: how the layer rounds: ``ExactNumerics()`` (the default, float32 reference)
        or ``DeepSeekInference(...)`` (DeepSeek's inference code: bf16 activations, the
        indexer's Hadamard + FP8 / FP4, V4's KV round trip; docs/numerics.md).
    - ``indexer_kl``: how the indexer's KL loss is computed when a stage trains it
        (``AutoIndexerLoss()``, ``DenseIndexerLoss()``,
        ``StreamingIndexerLoss(key_block, query_block)``).
    - ``scorer``: the indexer's scoring kernel, used by every selection strategy and the loss
        (``XlaScorer()``, the reference; ``BlockedScorer(key_block)``;
        ``PallasScorer(...)``; any ``AbstractScorer``).
    - ``tiles``: the tile sizes of the selection and the loss (``TileSizes``; ``None`` =
        ``csa_eqx._auto.backend_tiles()``, chosen for the backend when traced).
    """

    selection: AbstractSelection = AutoSelection()
    picks: AbstractPicks = AutoPicks()
    window: AbstractWindow = BandWindow()
    attention: AbstractAttentionKernel = AutoAttention()
    qk_head_chunk_size: int = 0
    query_block: int = 0
    save_selection: bool = False
    indexer_heads_axis: str | None = None
    context: ContextParallel | None = None
    heads: HeadParallel | None = None
    indexer_loss: str = "off"
    numerics: AbstractNumerics = ExactNumerics()
    indexer_kl: AbstractIndexerLoss = AutoIndexerLoss()
    scorer: AbstractScorer = XlaScorer()
    tiles: TileSizes | None = None

    def __check_init__(self):
        for name in ("qk_head_chunk_size", "query_block"):
            v = getattr(self, name)
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            _require(ok, name, "must be a non-negative int", v)
        check_stage(self.indexer_loss)
        _require(
            isinstance(self.numerics, AbstractNumerics),
            "numerics",
            "must be a csa_eqx numerics (ExactNumerics() or DeepSeekInference(...))",
            self.numerics,
        )
        for name, base, what in (
            ("indexer_kl", AbstractIndexerLoss, "AutoIndexerLoss(), DenseIndexerLoss(), ..."),
            ("scorer", AbstractScorer, "XlaScorer(), BlockedScorer(...), ..."),
        ):
            value = getattr(self, name)
            _require(
                isinstance(value, base), name, f"must be a csa_eqx {base.__name__} ({what})", value
            )
        _require(
            self.tiles is None or isinstance(self.tiles, TileSizes),
            "tiles",
            "must be None or a csa_eqx.TileSizes",
            self.tiles,
        )
        _require(
            isinstance(self.attention, AbstractAttentionKernel),
            "attention",
            "must be a csa_eqx attention kernel (AutoAttention(), XlaAttention(), ...)",
            self.attention,
        )
        _require(
            self.numerics.exact_softmax or not isinstance(self.attention, PallasAttention),
            "attention",
            f"PallasAttention computes the exact softmax, not {type(self.numerics).__name__}'s "
            "rounded one: use XlaAttention() or AutoAttention()",
            self.attention,
        )
        axis = self.indexer_heads_axis
        _require(
            axis is None or (isinstance(axis, str) and axis != ""),
            "indexer_heads_axis",
            "must be None or a non-empty mesh axis name",
            axis,
        )
        _require(
            self.context is None or isinstance(self.context, ContextParallel),
            "context",
            "must be None or a csa_eqx.ContextParallel",
            self.context,
        )
        _require(  # the head-sharded stage cannot close over the context shards' arrays yet
            self.context is None or axis is None,
            "indexer_heads_axis",
            "must be None with context parallelism (not composable yet)",
            axis,
        )
        self._check_heads()

    def _check_heads(self) -> None:
        """``ValueError`` unless ``heads`` is ``None`` or a ``HeadParallel`` that the other
        fields compose with."""
        if self.heads is None:
            return
        _require(
            isinstance(self.heads, HeadParallel),
            "heads",
            "must be None or a HeadParallel",
            self.heads,
        )
        _require(
            self.context is None or self.context.axis != self.heads.axis,
            "heads",
            f"needs a HeadParallel.axis other than the ContextParallel.axis {self.heads.axis!r}",
            self.heads.axis,
        )
        _require(  # the indexer's heads would be split over the axis the attention heads use
            self.indexer_heads_axis is None,
            "heads",
            "is not composable with indexer_heads_axis yet: set one of them to None",
            self.indexer_heads_axis,
        )
        _require(  # composing both ways at once would say two different things
            self.context is None or isinstance(self.context.inner, SingleDevice),
            "heads",
            "must be None when context already wraps an inner placement",
            self.context,
        )

    def check_one_device(self, what: str) -> None:
        """``ValueError`` naming ``what`` (e.g. ``"extend"``, which decodes on one device) when
        the execution asks for head or context parallelism; the message says how to run it
        without."""
        asked = [name for name in ("heads", "context") if getattr(self, name) is not None]
        if asked:
            raise ValueError(
                f"{what} runs on one device, but this layer's execution splits it "
                f"(Execution.{' and Execution.'.join(asked)}): decode with "
                f"layer.with_execution(dataclasses.replace(layer.execution, "
                f"{', '.join(f'{name}=None' for name in asked)})), which shares the weights"
            )

    @classmethod
    def checked(cls, execution: Execution | None, config, formats: DeepSeekFormats) -> Execution:
        """**Arguments:** an ``Execution`` (``None``: ``Execution()``), a layer ``config`` and what
        DeepSeek's inference quantises in the layer's family (``formats``).

        **Returns:** the ``Execution``, checked against ``config`` (``TypeError`` /
        ``ValueError``).
        """
        execution = cls() if execution is None else execution
        if not isinstance(execution, Execution):
            raise TypeError(
                f"execution must be a csa_eqx.Execution (got {type(execution).__name__})"
            )
        execution.check(config.index_n_heads, config.num_heads, execution.indexer_loss)
        execution.numerics.check(formats, config)
        return execution

    def sharing(self, devices: int) -> Execution:
        """**Arguments:** the number of ``devices`` that share the sequence (context parallelism).

        **Returns:** this execution with each device's tiles (``csa_eqx._auto.shared_tiles``: the
        working buffers shrink with the device's share of the rows). Selections and outputs
        do not change with the tiles.
        """
        tiles = backend_tiles() if self.tiles is None else self.tiles
        return dataclasses.replace(self, tiles=shared_tiles(tiles, devices))

    @property
    def placement(self) -> AbstractPlacement:
        """**Returns:** where the forward runs: ``heads`` (else ``SingleDevice()``), wrapped in
        ``context`` when that is set (context around heads)."""
        inner = SingleDevice() if self.heads is None else self.heads
        return inner if self.context is None else self.context.around(inner)

    @classmethod
    def from_options(
        cls,
        *,
        qk_head_chunk_size: int = 0,
        indexer_key_block: int = 0,
        query_block: int = 0,
        indexer_save_selection: bool = False,
        indexer_sharded_topk: bool = False,
        shard_indexer_acts: bool = False,
        indexer_loss: str = "off",
        data_axis: str = "data",
        tensor_axis: str = "tensor",
        context_parallel: bool = False,
        context_axis: str = "context",
        head_parallel: bool = False,
        numerics: str | AbstractNumerics = "exact",
    ) -> Execution:
        """The execution the loaders' keyword options describe (the flags of earlier
        versions' layer configs).

        **Arguments:**

        - ``qk_head_chunk_size``, ``query_block``, ``indexer_loss``: as the fields of the same name.
        - ``indexer_key_block``: > 0 forces ``StreamingSelection`` and
            ``StreamingIndexerLoss`` with this key tile (and ``query_block``); 0 =
            ``AutoSelection`` and ``AutoIndexerLoss``.
        - ``indexer_save_selection``: ``save_selection``.
        - ``indexer_sharded_topk``: wrap the selection in ``ShardedSelection`` over
            ``tensor_axis`` (batch over ``data_axis``).
        - ``shard_indexer_acts``: ``indexer_heads_axis=tensor_axis``.
        - ``data_axis``, ``tensor_axis``: non-empty mesh axis names.
        - ``context_parallel``: split the sequence over the mesh axis ``context_axis`` and the
            batch over ``data_axis`` (``context=ContextParallel(context_axis,
            data_axis)``).
        - ``head_parallel``: split the attention heads over ``tensor_axis`` and the batch over
            ``data_axis`` (``heads=HeadParallel(tensor_axis, data_axis)``).
        - ``numerics``: ``"exact"`` (``ExactNumerics()``), ``"deepseek"``
            (``DeepSeekInference()``; the loaders take its ``scale_fmt`` from the
            checkpoint's config) or a numerics object.

        **Returns:**

        An ``Execution``.
        """
        axes = (("data_axis", data_axis), ("tensor_axis", tensor_axis))
        for name, axis in (*axes, ("context_axis", context_axis)):
            _require(
                isinstance(axis, str) and axis != "",
                name,
                "must be a non-empty mesh axis name",
                axis,
            )
        _require(
            isinstance(indexer_key_block, int) and indexer_key_block >= 0,
            "indexer_key_block",
            "must be a non-negative int",
            indexer_key_block,
        )
        _require(
            isinstance(query_block, int) and query_block >= 0,
            "query_block",
            "must be a non-negative int",
            query_block,
        )
        if indexer_key_block:
            selection = StreamingSelection(key_block=indexer_key_block, query_block=query_block)
            indexer_kl = StreamingIndexerLoss(key_block=indexer_key_block, query_block=query_block)
        else:
            selection = AutoSelection(query_block=query_block)
            indexer_kl = AutoIndexerLoss(query_block=query_block)
        if indexer_sharded_topk:
            selection = ShardedSelection(selection, tensor_axis=tensor_axis, data_axis=data_axis)
        return cls(
            selection=selection,
            qk_head_chunk_size=qk_head_chunk_size,
            query_block=query_block,
            save_selection=indexer_save_selection,
            indexer_heads_axis=tensor_axis if shard_indexer_acts else None,
            context=ContextParallel(context_axis, data_axis) if context_parallel else None,
            heads=HeadParallel(tensor_axis, data_axis) if head_parallel else None,
            indexer_loss=indexer_loss,
            numerics=_numerics(numerics),
            indexer_kl=indexer_kl,
        )

    def check(self, index_heads: int, heads: int, stage: str) -> None:
        """``ValueError`` unless ``qk_head_chunk_size`` divides the ``index_heads`` (and the
        attention's ``heads`` when ``stage`` trains the indexer).

        **Arguments:** the layer's ``index_n_heads``, ``num_heads`` and the training ``stage``.

        **Returns:** ``None``.
        """
        check_stage(stage)
        c = self.qk_head_chunk_size
        _require(
            c == 0 or index_heads % c == 0,
            "qk_head_chunk_size",
            f"must be 0 (off) or divide index_n_heads={index_heads}",
            c,
        )
        _require(  # the KL target of the indexer loss is chunked over the attention heads
            c == 0 or stage == "off" or heads % c == 0,
            "qk_head_chunk_size",
            f"must divide num_heads={heads} when indexer_loss is on",
            c,
        )

    def on_heads(self, x: Array) -> Array:
        """**Arguments:** per-head indexer activations ``x [B, S, H, ...]``.

        **Returns:** ``x``, placed on ``indexer_heads_axis`` over the heads when that is set.
        """
        if self.indexer_heads_axis is None:
            return x
        return constrain_heads(x, self.indexer_heads_axis)

    def entry_reads(
        self,
        keys: Float[Array, "batch entries dim"],
        visibility: Visibility,
        selection: Int[Array, "batch seq k"] | None,
        stage: str,
        values: Float[Array, "batch entries vdim"] | None = None,
    ) -> Reads:
        """How each query reads the entries (V4: compressed entries, V3.2: tokens): every
        visible one by one matmul without a ``selection`` (HCA) or in the ``"dense"`` warm-up,
        else its picks as ``picks`` says. Forward and ``extend`` both read them this way.

        **Arguments:** the entries' ``keys`` (and MLA ``values``), their ``visibility``, the
        int32 ``selection [B, S, k]`` (``-1`` = none; ``None`` = every visible entry) and the
        training ``stage``.

        **Returns:** the entries' ``Reads`` (dense entries, masked dense entries or gathered rows).
        """
        if selection is None or stage == "dense":
            return Reads(dense=DenseKeys(keys, visibility.layout, *visibility[:2], values))
        return self.picks.reads(keys, visibility, selection, values)

    def attend(self, q, reads, sinks, scale, return_lse=False):
        """Run the ``attention`` kernel over ``reads`` with ``query_block`` queries per block
        (automatic: ``csa_eqx._auto.attention_query_block``).

        **Arguments** and **Returns:** as for ``AbstractAttentionKernel.attend``, whose
        ``query_block`` this resolves.
        """
        b, _, h, _ = q.shape
        tiles = backend_tiles() if self.tiles is None else self.tiles
        block = self.query_block or attention_query_block(b, h, reads, tiles.attention_elements)
        kw = dict(return_lse=return_lse, query_block=block, numerics=self.numerics)
        return self.attention.attend(q, reads, sinks, scale, **kw)

    def problem(
        self,
        project: Callable[..., tuple[Array, Array]],
        rows: tuple[Array, ...],
        keys: Float[Array, "batch entries dim"],
        visibility: Visibility | CandidateVisibility,
        score_dtype: str | None = None,
    ) -> SelectionProblem:
        """The ``SelectionProblem`` this execution runs: ``qk_head_chunk_size``, ``scorer``
        and ``tiles`` (``None``: resolved for the backend now, at trace time) filled in.

        **Arguments:** the problem's ``project``, ``rows``, ``keys``, ``visibility`` and
        ``score_dtype`` (as the numerics say), as for ``SelectionProblem``.

        **Returns:** the ``SelectionProblem``.
        """
        tiles = backend_tiles() if self.tiles is None else self.tiles
        chunk = self.qk_head_chunk_size
        return SelectionProblem(
            project, rows, keys, visibility, chunk, score_dtype, self.scorer, tiles
        )

    def kl_loss(self, problem, target, selection=None):
        """The indexer's KL loss by ``indexer_kl``: arguments (the ``problem`` from
        ``problem``) and result as for ``AbstractIndexerLoss.loss``.
        """
        return self.indexer_kl.loss(problem, target, selection)

    def select(self, problem: SelectionProblem, k: int) -> Int[Array, "batch seq {k}"]:
        """Run ``selection`` on ``problem`` (under ``indexer_heads_axis`` Auto when the
        activations are head-sharded) and tag the result for remat.

        **Arguments:** the ``SelectionProblem`` and ``k > 0`` picks per query.

        **Returns:** int32 ``[B, S, k]`` entry indices, ``-1`` = none.
        """
        (selection,) = self._run(problem, lambda p: (self.selection.select(p, k),))
        return tag_selection(selection, self.save_selection)

    def select_candidates(
        self, problem: SelectionProblem, k: int, topk_blocks: int, block_size: int
    ) -> tuple[Int[Array, "batch seq {k}"], Int[Array, "batch seq {topk_blocks}"]]:
        """A V4.1 candidate source's ``selection.select_candidates`` (docs/v41.md,
        "Candidates"), run as ``select`` runs it; only the selection is tagged (with it saved,
        the backward needs no candidates).

        **Arguments:** the ``SelectionProblem``, ``k > 0``, ``Nb`` and ``bc``.

        **Returns:** ``(selection [B, S, k], candidate blocks [B, S, Nb])``, int32, ``-1`` =
        none.
        """
        selection, candidates = self._run(
            problem, lambda p: self.selection.select_candidates(p, k, topk_blocks, block_size)
        )
        return tag_selection(selection, self.save_selection), candidates

    def _run(self, problem: SelectionProblem, run: Callable) -> tuple[Array, ...]:
        """``run(problem)`` (a tuple of ``[B, S, n]``), under ``indexer_heads_axis`` Auto when
        that is set."""

        def stage(rows, keys, visibility):
            return run(problem._replace(rows=rows, keys=keys, visibility=visibility))

        if self.indexer_heads_axis is not None:
            like = problem.visibility.query_index
            stage = tensor_axis_auto(stage, self.indexer_heads_axis, like)
        return stage(problem.rows, problem.keys, problem.visibility)


def _numerics(numerics: str | AbstractNumerics) -> AbstractNumerics:
    """The numerics a loader keyword names (``"exact"``, ``"deepseek"``) or the object
    (``named_numerics``, the one mapping; a loader that read the checkpoint's ``scale_fmt``
    passes the object it made)."""
    return named_numerics(numerics)


def checked_execution(execution: Execution | None, config, formats: DeepSeekFormats) -> Execution:
    """``Execution.checked``: **Arguments** and **Returns** as there."""
    return Execution.checked(execution, config, formats)


def loader_execution(execution: Execution | None, flags: dict) -> Execution:
    """A loader's ``Execution``: its ``execution=`` or its execution keywords, not both.

    **Arguments:** the loader's ``execution`` (``None``: not given) and the keywords of
    ``Execution.from_options`` it was called with (``flags``, by name).

    **Returns:** ``execution``, or ``Execution.from_options(**flags)``; a ``ValueError`` when
    both are given.
    """
    if execution is not None and flags:
        raise ValueError(
            f"pass either execution= or the execution keywords {sorted(flags)}, not both"
        )
    return Execution.from_options(**flags) if execution is None else execution
