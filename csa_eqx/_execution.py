"""How a layer runs, apart from what it computes: ``Execution``, a record of one strategy per
family (the selection, the attention's picks, window and kernel, the indexer loss, the scorer,
the numerics), the sizes that tune them (head chunk, query block, tiles), remat tagging, head
sharding of the indexer's activations, the placement (``heads``, ``context``) and the default
training stage of the indexer loss, with their checks. The layers' pipelines call the chosen
strategies themselves.

The layer configs (``V4AttentionConfig``, ``V32AttentionConfig``) mirror the checkpoint only;
``V4Attention(config, key=..., execution=Execution(...))`` decides how it runs. The default is
automatic for the backend. The loaders' keyword options (``qk_head_chunk_size=``,
``indexer_sharded_topk=``, …) map onto it with ``Execution.from_options``; those flags live
next to the loaders (``csa_eqx.hf._flags``), above the record, which reads them only when
that constructor runs or a call mistakes one for a field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from ._attention.auto import AutoAttention, AutoPicks
from ._attention.base import AbstractAttentionKernel, LatentUp
from ._attention.picks import AbstractPicks
from ._attention.window import AbstractWindow, BandWindow
from ._backend import CPU_TILES, GPU_TILES, TPU_TILES, backend_tiles
from ._config import V32AttentionConfig
from ._loss.auto import AutoIndexerLoss
from ._loss.base import AbstractIndexerLoss
from ._numerics.base import AbstractNumerics, DeepSeekFormats, ExactNumerics
from ._placement.base import AbstractPlacement, SingleDevice
from ._placement.context import ContextParallel
from ._placement.heads import HeadParallel
from ._scorer.base import AbstractScorer, XlaScorer
from ._selection.auto import AutoSelection
from ._selection.base import AbstractSelection, SelectionProblem
from ._tiles import TileSizes

__all__ = ["Execution", "IndexerLossStage", "INDEXER_LOSS_STAGES"]

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


def _queries(q, weights):
    """The identity ``project`` of ``Execution.describe``'s shapes-only problem."""
    return q, weights


class Execution(eqx.Module):
    """How an attention layer runs (never what it computes: outputs agree across settings,
    selections bitwise), and how it rounds (``numerics``: the one field that changes the
    numbers, on purpose). Every field is a keyword (a loader's option given here is a
    ``TypeError`` naming ``Execution.from_options``).

    **Arguments:**

    - ``selection``: the indexer top-k strategy (``AutoSelection()``, ``DenseSelection()``,
        ``StreamingSelection(key_block, query_block, topk_block)``, ``TritonSelection(...)``,
        ``ShardedSelection(inner, tensor_axis, data_axis)``).
    - ``picks``: how the attention reads the picked entries (``AutoPicks()``,
        ``MaskedPicks()``, ``GatheredPicks()``).
    - ``window``: how V4 reads the sliding window (``BandWindow()``: a banded matmul,
        ``GatheredWindow()``: gathered token rows), in the forward and in ``extend``.
    - ``attention``: the attention kernel over what each query reads (``AutoAttention()``:
        ``MosaicAttention()`` on a TPU, else ``XlaAttention()``, the reference, a GPU
        included (``TritonAttention()`` there only when forced); for V3.2 under
        ``DeepSeekInference``, DeepSeek's expanded MLA; any ``AbstractAttentionKernel``).
    - ``qk_head_chunk_size``: indexer heads (and, for the KL target, attention heads) scored
        at once (0 = all); must divide ``index_n_heads`` (and ``num_heads`` when the
        indexer loss is on).
    - ``query_block``: queries per block of the attention (0 = the kernel's own automatic
        block, ``AbstractAttentionKernel.query_block_for``).
    - ``save_selection``: name the selection ``csa_eqx.SELECTION_NAME`` so that remat policies
        (``csa_eqx.remat.compose_selection_policy``) can save it. A placed layer (``context``
        or ``heads``) inside a caller's ``shard_map`` leaves it unnamed: its ``shard_map`` there
        hands no residual to its backward, which recomputes the selection (docs/composing.md,
        "Placements inside your `shard_map`").
    - ``indexer_heads_axis``: mesh axis to shard the indexer's per-head activations over
        (``None`` = off); its size must divide ``index_n_heads``.
    - ``context``: split the sequence over a mesh axis (``ContextParallel(axis)``; ``None`` =
        off); ``extend`` refuses it (decoding runs on one device: ``check_one_device``).
    - ``heads``: split the attention heads over a mesh axis (``HeadParallel(axis)``; ``None`` =
        off); composes with ``context`` (one ``shard_map`` over both axes), a
        ``ShardedSelection`` over the same axis and the indexer loss; not with
        ``indexer_heads_axis``; ``extend`` refuses it.
    - ``indexer_loss``: the default training stage of the indexer's KL loss: ``"off"``
        (the default: ``aux["indexer_loss"]`` is ``None`` and the indexer gets no gradient),
        ``"dense"`` (warm-up: all visible entries, attended densely too) or ``"sparse"``
        (the selected entries). A call can override it (``layer(x, indexer_loss=...)``;
        docs/training.md).
    - ``numerics``: how the layer rounds: ``ExactNumerics()`` (the default, float32 reference)
        or ``DeepSeekInference(...)`` (DeepSeek's inference code; docs/numerics.md).
    - ``indexer_kl``: how the indexer's KL loss is computed when a stage trains it
        (``AutoIndexerLoss()``, ``DenseIndexerLoss()``, ``StreamingIndexerLoss(...)``).
    - ``scorer``: the indexer's scoring kernel, used by every selection strategy and the loss
        (``XlaScorer()``, the reference; ``BlockedScorer(key_block)``; ``TritonScorer(...)``).
    - ``tiles``: the tile sizes of the selection, the loss and the attention (``TileSizes``;
        ``None`` = the backend's, ``csa_eqx._backend.backend_tiles``, when traced).
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

    @classmethod
    def from_options(cls, **options) -> Execution:
        """The execution the loaders' keyword options describe (the flags of earlier versions'
        layer configs; they live next to the loaders, ``csa_eqx.hf._flags``, and are read from
        there when this runs).

        **Arguments** (keywords only; the default in brackets):

        - ``qk_head_chunk_size`` (0), ``query_block`` (0), ``indexer_loss`` (``"off"``): as the
            fields of the same name.
        - ``indexer_key_block`` (0): > 0 forces ``StreamingSelection`` and
            ``StreamingIndexerLoss`` with this key tile (and ``query_block``); 0 =
            ``AutoSelection`` and ``AutoIndexerLoss``.
        - ``indexer_save_selection`` (``False``): ``save_selection``.
        - ``indexer_sharded_topk`` (``False``): wrap the selection in ``ShardedSelection`` over
            ``tensor_axis`` (batch over ``data_axis``).
        - ``shard_indexer_acts`` (``False``): ``indexer_heads_axis=tensor_axis``.
        - ``data_axis`` (``"data"``), ``tensor_axis`` (``"tensor"``): non-empty mesh axis names.
        - ``context_parallel`` (``False``): split the sequence over the mesh axis
            ``context_axis`` (``"context"``) and the batch over ``data_axis``
            (``context=ContextParallel(context_axis, data_axis)``).
        - ``head_parallel`` (``False``): split the attention heads over ``tensor_axis`` and the
            batch over ``data_axis`` (``heads=HeadParallel(tensor_axis, data_axis)``).
        - ``numerics`` (``"exact"``): ``"exact"`` (``ExactNumerics()``), ``"deepseek"``
            (``DeepSeekInference()``; the loaders take its ``scale_fmt`` from the
            checkpoint's config) or a numerics object.

        A field name of ``Execution`` that is not one of these keywords (``save_selection=``,
        ``context=``, ...) is a ``TypeError`` naming the keyword to use, or ``Execution(...)``.

        **Returns:** an ``Execution``.
        """
        # imported here: importing csa_eqx.hf runs its __init__, whose loaders import the
        # layer kinds, which import this module (a cycle at import time)
        from .hf._flags import from_options

        return from_options(cls, **options)

    def __init__(self, **fields):
        names = {field.name for field in dataclasses.fields(self)}
        if not fields.keys() <= names:
            from .hf._flags import refuse_options  # a loader's flag given as a field?

            refuse_options(type(self), fields)
            raise TypeError(f"Execution has no fields {sorted(fields.keys() - names)}")
        for field in dataclasses.fields(self):
            setattr(self, field.name, fields.pop(field.name, field.default))

    def __check_init__(self):
        for name in ("qk_head_chunk_size", "query_block"):
            v = getattr(self, name)
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            _require(ok, name, "must be a non-negative int", v)
        check_stage(self.indexer_loss)
        for name, base, what in (
            ("numerics", AbstractNumerics, "ExactNumerics() or DeepSeekInference(...)"),
            ("indexer_kl", AbstractIndexerLoss, "AutoIndexerLoss(), DenseIndexerLoss(), ..."),
            ("scorer", AbstractScorer, "XlaScorer(), BlockedScorer(...), ..."),
            ("attention", AbstractAttentionKernel, "AutoAttention(), XlaAttention(), ..."),
        ):
            value = getattr(self, name)
            _require(
                isinstance(value, base), name, f"must be a csa_eqx {base.__name__} ({what})", value
            )
        self._optional("tiles", TileSizes, "csa_eqx.TileSizes")
        _require(
            self.numerics.exact_softmax or not self.attention.exact_softmax_only,
            "attention",
            f"{type(self.attention).__name__} computes the exact softmax, not "
            f"{type(self.numerics).__name__}'s rounded one: use XlaAttention() or AutoAttention()",
            self.attention,
        )
        axis = self.indexer_heads_axis
        _require(
            axis is None or (isinstance(axis, str) and axis != ""),
            "indexer_heads_axis",
            "must be None or a non-empty mesh axis name",
            axis,
        )
        self._optional("context", ContextParallel, "csa_eqx.ContextParallel")
        _require(  # the head-sharded stage cannot close over the context shards' arrays yet
            self.context is None or axis is None,
            "indexer_heads_axis",
            "must be None with context parallelism (not composable yet)",
            axis,
        )
        self._check_heads()

    def _optional(self, field: str, cls: type, name: str) -> None:
        """``ValueError`` unless ``field`` is ``None`` or a ``cls`` (``name`` in the message)."""
        value = getattr(self, field)
        _require(value is None or isinstance(value, cls), field, f"must be None or a {name}", value)

    def _check_heads(self) -> None:
        """``ValueError`` unless ``heads`` is ``None`` or a ``HeadParallel`` that the other
        fields compose with."""
        self._optional("heads", HeadParallel, "HeadParallel")
        if self.heads is None:
            return
        self.heads.check_composes(self.context, self.indexer_heads_axis)
        _require(  # composing both ways at once would say two different things
            self.context is None or isinstance(self.context.inner, SingleDevice),
            "heads",
            "must be None when context already wraps an inner placement",
            self.context,
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

    def describe(
        self, layer, shape: tuple[int, int, int], backend: str | None = None, dtype=jnp.float32
    ) -> dict[str, Any]:
        """What this execution runs for ``layer`` on an input of ``shape``: each automatic
        choice resolved as the layer's forward resolves it (no computation, nothing traced).

        **Arguments:**

        - ``layer``: a csa_eqx layer (``V4Attention``, ``V32Attention``, ``V41Attention``).
        - ``shape``: the input's ``(batch, seq, hidden)``.
        - ``backend``: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``None``: ``jax.default_backend()``),
            on one device (under a mesh the compiler shards, the XLA paths run).
        - ``dtype``: the input's dtype (the fused indexer's VMEM bound depends on it; a 64-bit
            one takes the XLA strategies).

        **Returns:** a dict: ``"selection"`` (the top-k strategy, ``None`` for a layer that
        runs no indexer of its own), ``"picks"`` (how the attention reads the picks, ``None``
        without a selection), ``"window"`` (``None`` for V3.2), ``"attention"`` (the
        kernel), ``"scorer"``, ``"indexer_kl"`` (the KL loss method when a stage trains the
        indexer, ``None`` without one), ``"numerics"``, ``"placement"`` and ``"tiles"`` (the
        backend's, or the forced ``TileSizes``). A V4.1 consumer whose candidate pre-filter
        bites runs the gathered strategies instead (docs/v41.md, "Candidates").
        """
        batch, seq, _ = shape
        if self.tiles is not None or backend is None:
            tiles = backend_tiles(self.tiles)
        else:
            tiles = {"cpu": CPU_TILES, "tpu": TPU_TILES}.get(backend, GPU_TILES)
        c = layer.config
        rate = layer.entry_rate
        entries = seq // rate if rate else 0
        mla = isinstance(c, V32AttentionConfig)
        up = None
        if mla:
            expanded = self.numerics.expanded_attention(layer.formats)
            up = LatentUp(None, c.qk_nope_head_dim, c.v_head_dim, expanded)
        attention = self.attention
        if isinstance(attention, AutoAttention):
            attention = attention.choose(self.numerics, up, backend, dtype)
        window = None if mla else self.window  # MLA has no sliding window
        out = dict(selection=None, picks=None, window=window, attention=attention)
        if layer.indexer is not None:
            heads, width = c.index_n_heads, c.index_head_dim
            q = jax.ShapeDtypeStruct((batch, seq, heads, width), dtype)
            w = jax.ShapeDtypeStruct((batch, seq, heads), jnp.float32)
            keys = jax.ShapeDtypeStruct((batch, entries, width), dtype)
            # shapes only (``from_queries`` checks arrays): the choosers read nothing else
            problem = SelectionProblem(_queries, (q, w), keys, None, self.qk_head_chunk_size)
            problem = problem._replace(tiles=tiles)
            selection = self.selection
            if isinstance(selection, AutoSelection):
                selection = selection.strategy(problem, backend)
            out["selection"] = selection
            loss = self.indexer_kl
            if isinstance(loss, AutoIndexerLoss):
                at_once = self.qk_head_chunk_size or max(heads, c.num_heads)
                loss = loss.choose(batch, seq, entries, at_once, tiles)
            out["indexer_kl"] = loss
        else:
            out["indexer_kl"] = None
        if layer.selects:
            picks = self.picks
            if isinstance(picks, AutoPicks):
                picks = picks.choose(entries, c.index_topk)
            out["picks"] = picks
        return dict(
            out, scorer=self.scorer, numerics=self.numerics, placement=self.placement, tiles=tiles
        )

    @property
    def placement(self) -> AbstractPlacement:
        """**Returns:** where the forward runs: ``heads`` (else ``SingleDevice()``), wrapped in
        ``context`` when that is set (context around heads)."""
        inner = SingleDevice() if self.heads is None else self.heads
        return inner if self.context is None else self.context.around(inner)
