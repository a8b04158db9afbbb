"""csa_eqx: DeepSeek sparse attention (V4 CSA / HCA / sliding, V3.2 DSA) in JAX + Equinox."""

from ._attention_kernel import AbstractAttentionKernel
from ._attention_xla import XlaAttention
from ._loss_dense import DenseIndexerLoss
from ._loss_streaming import StreamingIndexerLoss
from ._picks import AbstractPicks, GatheredPicks, MaskedPicks
from ._placement import AbstractPlacement, SingleDevice
from ._projected_loss import projected_indexer_kl_loss
from ._reads import BandRows, DenseKeys, GatheredRows, Reads
from ._scorer import AbstractScorer
from ._scorer_blocked import BlockedScorer
from ._scorer_xla import XlaScorer
from ._selection_sharded import ShardedSelection
from ._window import AbstractWindow, BandWindow, GatheredWindow
from .auto import AutoIndexerLoss, AutoPicks, AutoSelection
from .cache import CompressorState, V4Cache, V32Cache
from .compressor import Compressor, EntryLayout, entry_layout, pool_windows, segment_positions
from .config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .context import ContextParallel
from .deepseek_numerics import DeepSeekInference
from .execution import Execution, IndexerLossStage
from .generate import generate
from .heads import HeadParallel
from .indexer import indexer_scores
from .loss import AbstractIndexerLoss, AttentionTarget, indexer_kl_loss
from .numerics import AbstractNumerics, ExactNumerics
from .remat import SELECTION_NAME, compose_selection_policy
from .selection import (
    AbstractSelection,
    DenseSelection,
    SelectionProblem,
    TileSizes,
    Visibility,
    entry_visibility,
    select_topk,
)
from .sparse import sparse_attention
from .streaming import StreamingSelection
from .v4 import Indexer, V4Attention
from .v32 import V32Attention, V32Indexer

__all__ = [
    "AbstractIndexerLoss",
    "AbstractAttentionKernel",
    "AbstractNumerics",
    "AbstractPicks",
    "AbstractPlacement",
    "AbstractScorer",
    "AbstractSelection",
    "AbstractWindow",
    "AttentionTarget",
    "AutoIndexerLoss",
    "AutoPicks",
    "AutoSelection",
    "BandRows",
    "BandWindow",
    "BlockedScorer",
    "Compressor",
    "CompressorState",
    "DenseIndexerLoss",
    "DenseKeys",
    "DenseSelection",
    "DeepSeekInference",
    "EntryLayout",
    "ExactNumerics",
    "Execution",
    "ContextParallel",
    "HeadParallel",
    "GatheredPicks",
    "GatheredRows",
    "GatheredWindow",
    "Indexer",
    "IndexerLossStage",
    "MaskedPicks",
    "Reads",
    "SELECTION_NAME",
    "SelectionProblem",
    "ShardedSelection",
    "SingleDevice",
    "StreamingIndexerLoss",
    "StreamingSelection",
    "TileSizes",
    "V4Attention",
    "V4AttentionConfig",
    "V4Cache",
    "V32Attention",
    "V32AttentionConfig",
    "V32Cache",
    "V32Indexer",
    "Visibility",
    "XlaAttention",
    "XlaScorer",
    "YaRNScaling",
    "compose_selection_policy",
    "entry_layout",
    "entry_visibility",
    "generate",
    "indexer_kl_loss",
    "indexer_scores",
    "pool_windows",
    "projected_indexer_kl_loss",
    "segment_positions",
    "select_topk",
    "sparse_attention",
]
