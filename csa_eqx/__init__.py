"""csa_eqx: DeepSeek sparse attention (V4 CSA / HCA / sliding, V3.2 DSA) in JAX + Equinox."""

from ._attention_kernel import AbstractAttentionKernel
from ._attention_xla import XlaAttention
from ._picks import AbstractPicks, GatheredPicks, MaskedPicks
from ._reads import BandRows, DenseKeys, GatheredRows, Reads
from ._window import AbstractWindow, BandWindow, GatheredWindow
from .auto import AutoPicks, AutoSelection
from .cache import CompressorState, V4Cache, V32Cache
from .compressor import Compressor, EntryLayout, entry_layout, pool_windows, segment_positions
from .config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .context import ContextParallel
from .deepseek_numerics import DeepSeekInference
from .execution import Execution, IndexerLossStage
from .generate import generate
from .heads import HeadParallel
from .indexer import indexer_scores
from .loss import AttentionTarget, indexer_kl_loss, projected_indexer_kl_loss
from .numerics import AbstractNumerics, ExactNumerics
from .remat import SELECTION_NAME, compose_selection_policy
from .selection import (
    AbstractSelection,
    DenseSelection,
    SelectionProblem,
    Visibility,
    entry_visibility,
    select_topk,
)
from .sharding import ShardedSelection
from .sparse import sparse_attention
from .streaming import StreamingSelection
from .v4 import Indexer, V4Attention
from .v32 import V32Attention, V32Indexer

__all__ = [
    "AbstractAttentionKernel",
    "AbstractNumerics",
    "AbstractPicks",
    "AbstractSelection",
    "AbstractWindow",
    "AttentionTarget",
    "AutoPicks",
    "AutoSelection",
    "BandRows",
    "BandWindow",
    "Compressor",
    "CompressorState",
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
    "StreamingSelection",
    "V4Attention",
    "V4AttentionConfig",
    "V4Cache",
    "V32Attention",
    "V32AttentionConfig",
    "V32Cache",
    "V32Indexer",
    "Visibility",
    "XlaAttention",
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
