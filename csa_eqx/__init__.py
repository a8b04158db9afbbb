"""csa_eqx: DeepSeek sparse attention (V4 CSA / HCA / sliding, V3.2 DSA) in JAX + Equinox."""

import warnings as _warnings

from ._attention.auto import AutoAttention as AutoAttention
from ._attention.auto import AutoPicks as AutoPicks
from ._attention.base import AbstractAttentionKernel as AbstractAttentionKernel
from ._attention.expanded import ExpandedAttention as ExpandedAttention
from ._attention.mosaic import MosaicAttention as MosaicAttention
from ._attention.picks import AbstractPicks as AbstractPicks
from ._attention.picks import GatheredPicks as GatheredPicks
from ._attention.picks import MaskedPicks as MaskedPicks
from ._attention.reads import BandRows as BandRows
from ._attention.reads import DenseKeys as DenseKeys
from ._attention.reads import GatheredRows as GatheredRows
from ._attention.reads import Reads as Reads
from ._attention.sparse import sparse_attention as sparse_attention
from ._attention.triton import TritonAttention as TritonAttention
from ._attention.window import AbstractWindow as AbstractWindow
from ._attention.window import BandWindow as BandWindow
from ._attention.window import GatheredWindow as GatheredWindow
from ._attention.xla import XlaAttention as XlaAttention
from ._config import V4AttentionConfig as V4AttentionConfig
from ._config import V32AttentionConfig as V32AttentionConfig
from ._config import YaRNScaling as YaRNScaling
from ._decode.cache import CompressorState as CompressorState
from ._decode.cache import V4Cache as V4Cache
from ._decode.cache import V32Cache as V32Cache
from ._decode.generate import generate as generate
from ._entries.compressor import AbstractCompressor as AbstractCompressor
from ._entries.compressor import Compressor as Compressor
from ._entries.compressor import pool_windows as pool_windows
from ._entries.v41 import V41Compressor as V41Compressor
from ._execution import Execution as Execution
from ._execution import IndexerLossStage as IndexerLossStage
from ._indexer.heads import IndexerHeads as IndexerHeads
from ._layers.base import AbstractIndexedAttention as AbstractIndexedAttention
from ._layers.block import V4Block as V4Block
from ._layers.forward import StackState as StackState
from ._layers.v4 import V4Attention as V4Attention
from ._layers.v32 import V32Attention as V32Attention
from ._layers.v32 import V32Indexer as V32Indexer
from ._layers.v41 import V41Attention as V41Attention
from ._layers.v41_config import V41AttentionConfig as V41AttentionConfig
from ._layers.v41_config import V41WiringError as V41WiringError
from ._layers.v41_parts import V41Shared as V41Shared
from ._layout import EntryLayout as EntryLayout
from ._layout import Visibility as Visibility
from ._layout import entry_layout as entry_layout
from ._layout import entry_visibility as entry_visibility
from ._layout import segment_positions as segment_positions
from ._loss.auto import AutoIndexerLoss as AutoIndexerLoss
from ._loss.base import AbstractIndexerLoss as AbstractIndexerLoss
from ._loss.base import AttentionTarget as AttentionTarget
from ._loss.dense import DenseIndexerLoss as DenseIndexerLoss
from ._loss.gathered import GatheredIndexerLoss as GatheredIndexerLoss
from ._loss.kl import indexer_kl_loss as indexer_kl_loss
from ._loss.projected import projected_indexer_kl_loss as projected_indexer_kl_loss
from ._loss.streaming import StreamingIndexerLoss as StreamingIndexerLoss
from ._numerics.base import AbstractNumerics as AbstractNumerics
from ._numerics.base import ExactNumerics as ExactNumerics
from ._numerics.deepseek import DeepSeekInference as DeepSeekInference
from ._numerics.deepseek import DeepSeekV41Inference as DeepSeekV41Inference
from ._numerics.fp8_weight import Fp8Weight as Fp8Weight
from ._placement.base import AbstractPlacement as AbstractPlacement
from ._placement.base import SingleDevice as SingleDevice
from ._placement.context import ContextParallel as ContextParallel
from ._placement.heads import HeadParallel as HeadParallel
from ._scorer.base import AbstractScorer as AbstractScorer
from ._scorer.base import XlaScorer as XlaScorer
from ._scorer.base import indexer_scores as indexer_scores
from ._scorer.blocked import BlockedScorer as BlockedScorer
from ._scorer.triton import TritonScorer as TritonScorer
from ._selection.auto import AutoSelection as AutoSelection
from ._selection.base import AbstractSelection as AbstractSelection
from ._selection.base import SelectionProblem as SelectionProblem
from ._selection.candidates import CandidateVisibility as CandidateVisibility
from ._selection.candidates import candidate_blocks as candidate_blocks
from ._selection.dense import DenseSelection as DenseSelection
from ._selection.gathered import GatheredSelection as GatheredSelection
from ._selection.mosaic import MosaicSelection as MosaicSelection
from ._selection.sharded import ShardedSelection as ShardedSelection
from ._selection.streaming import StreamingSelection as StreamingSelection
from ._selection.triton import TritonSelection as TritonSelection
from ._stack import extend_stack as extend_stack
from ._stack import extend_v41_stack as extend_v41_stack
from ._stack import run_stack as run_stack
from ._stack import run_v41_stack as run_v41_stack
from ._tiles import TileSizes as TileSizes
from ._topk import select_topk as select_topk
from .plotting import plot_picks as plot_picks
from .remat import SELECTION_NAME as SELECTION_NAME
from .remat import compose_selection_policy as compose_selection_policy

# The stable public API (docs/api/stable.md). The other names imported above (the parts a layer
# is built of, the reads an attention kernel takes, V4.1's candidate helpers, ...) stay
# importable from here and from their modules, but may change between releases.
__all__ = [
    # layers and configs
    "V4AttentionConfig",
    "V4Attention",
    "V32AttentionConfig",
    "V32Attention",
    "V41AttentionConfig",
    "V41Attention",
    "V41Shared",
    "V41WiringError",
    "YaRNScaling",
    "AbstractIndexedAttention",
    # decoding and stacks
    "V4Cache",
    "V32Cache",
    "generate",
    "run_stack",
    "extend_stack",
    "run_v41_stack",
    "extend_v41_stack",
    # how a layer runs
    "Execution",
    "IndexerLossStage",
    "TileSizes",
    # selection
    "AbstractSelection",
    "SelectionProblem",
    "AutoSelection",
    "DenseSelection",
    "StreamingSelection",
    "GatheredSelection",
    "ShardedSelection",
    "TritonSelection",
    "MosaicSelection",
    # attention
    "AbstractAttentionKernel",
    "AutoAttention",
    "XlaAttention",
    "TritonAttention",
    "MosaicAttention",
    "ExpandedAttention",
    "AbstractPicks",
    "AutoPicks",
    "MaskedPicks",
    "GatheredPicks",
    "AbstractWindow",
    "BandWindow",
    "GatheredWindow",
    # scoring
    "AbstractScorer",
    "XlaScorer",
    "BlockedScorer",
    "TritonScorer",
    # indexer loss
    "AbstractIndexerLoss",
    "AutoIndexerLoss",
    "DenseIndexerLoss",
    "StreamingIndexerLoss",
    "GatheredIndexerLoss",
    # numerics
    "AbstractNumerics",
    "ExactNumerics",
    "DeepSeekInference",
    "DeepSeekV41Inference",
    "Fp8Weight",
    # placement
    "AbstractPlacement",
    "SingleDevice",
    "ContextParallel",
    "HeadParallel",
    # functional core
    "EntryLayout",
    "Visibility",
    "entry_layout",
    "entry_visibility",
    "segment_positions",
    "indexer_scores",
    "select_topk",
    "sparse_attention",
    "indexer_kl_loss",
    # remat
    "SELECTION_NAME",
    "compose_selection_policy",
    # pictures
    "plot_picks",
]


# The Triton kernels' names before they were named by their backend (0.x; CHANGELOG.md): kept
# for one release, each access warns.
_DEPRECATED = {
    "PallasSelection": "TritonSelection",
    "PallasAttention": "TritonAttention",
    "PallasScorer": "TritonScorer",
}


def __getattr__(name: str):
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        _warnings.warn(
            f"csa_eqx.{name} is deprecated and goes in the next release: use csa_eqx.{new} "
            "(the same class, named by its backend)",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
