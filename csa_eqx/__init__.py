"""csa_eqx: DeepSeek sparse attention (V4 CSA / HCA / sliding, V3.2 DSA) in JAX + Equinox."""

from ._attention import AbstractIndexedAttention as AbstractIndexedAttention
from ._attention_kernel import AbstractAttentionKernel as AbstractAttentionKernel
from ._attention_pallas import PallasAttention as PallasAttention
from ._attention_xla import XlaAttention as XlaAttention
from ._auto import AutoAttention as AutoAttention
from ._auto import AutoIndexerLoss as AutoIndexerLoss
from ._auto import AutoPicks as AutoPicks
from ._auto import AutoSelection as AutoSelection
from ._cache import CompressorState as CompressorState
from ._cache import V4Cache as V4Cache
from ._cache import V32Cache as V32Cache
from ._candidates import CandidateVisibility as CandidateVisibility
from ._candidates import candidate_blocks as candidate_blocks
from ._compressor import AbstractCompressor as AbstractCompressor
from ._compressor import Compressor as Compressor
from ._compressor import pool_windows as pool_windows
from ._compressor_v41 import V41Compressor as V41Compressor
from ._config import V4AttentionConfig as V4AttentionConfig
from ._config import V32AttentionConfig as V32AttentionConfig
from ._config import YaRNScaling as YaRNScaling
from ._context import ContextParallel as ContextParallel
from ._deepseek_numerics import DeepSeekInference as DeepSeekInference
from ._deepseek_numerics import DeepSeekV41Inference as DeepSeekV41Inference
from ._execution import Execution as Execution
from ._execution import IndexerLossStage as IndexerLossStage
from ._forward import V41Shared as V41Shared
from ._fp8_weight import Fp8Weight as Fp8Weight
from ._generate import generate as generate
from ._heads import HeadParallel as HeadParallel
from ._indexer_heads import IndexerHeads as IndexerHeads
from ._layout import EntryLayout as EntryLayout
from ._layout import Visibility as Visibility
from ._layout import entry_layout as entry_layout
from ._layout import entry_visibility as entry_visibility
from ._layout import segment_positions as segment_positions
from ._loss import indexer_kl_loss as indexer_kl_loss
from ._loss_dense import DenseIndexerLoss as DenseIndexerLoss
from ._loss_gathered import GatheredIndexerLoss as GatheredIndexerLoss
from ._loss_streaming import StreamingIndexerLoss as StreamingIndexerLoss
from ._numerics import AbstractNumerics as AbstractNumerics
from ._numerics import ExactNumerics as ExactNumerics
from ._picks import AbstractPicks as AbstractPicks
from ._picks import GatheredPicks as GatheredPicks
from ._picks import MaskedPicks as MaskedPicks
from ._placement import AbstractPlacement as AbstractPlacement
from ._placement import SingleDevice as SingleDevice
from ._problem import AbstractIndexerLoss as AbstractIndexerLoss
from ._problem import AbstractSelection as AbstractSelection
from ._problem import SelectionProblem as SelectionProblem
from ._projected_loss import projected_indexer_kl_loss as projected_indexer_kl_loss
from ._reads import BandRows as BandRows
from ._reads import DenseKeys as DenseKeys
from ._reads import GatheredRows as GatheredRows
from ._reads import Reads as Reads
from ._scorer import AbstractScorer as AbstractScorer
from ._scorer import XlaScorer as XlaScorer
from ._scorer import indexer_scores as indexer_scores
from ._scorer_blocked import BlockedScorer as BlockedScorer
from ._scorer_pallas import PallasScorer as PallasScorer
from ._selection_dense import DenseSelection as DenseSelection
from ._selection_gathered import GatheredSelection as GatheredSelection
from ._selection_pallas import PallasSelection as PallasSelection
from ._selection_sharded import ShardedSelection as ShardedSelection
from ._selection_streaming import StreamingSelection as StreamingSelection
from ._sparse import sparse_attention as sparse_attention
from ._stack import extend_stack as extend_stack
from ._stack import run_stack as run_stack
from ._target import AttentionTarget as AttentionTarget
from ._tiles import TileSizes as TileSizes
from ._topk import select_topk as select_topk
from ._v4 import V4Attention as V4Attention
from ._v4_block import V4Block as V4Block
from ._v32 import V32Attention as V32Attention
from ._v32 import V32Indexer as V32Indexer
from ._v41 import V41Attention as V41Attention
from ._v41 import extend_v41_stack as extend_v41_stack
from ._v41 import run_v41_stack as run_v41_stack
from ._v41_config import V41AttentionConfig as V41AttentionConfig
from ._v41_config import V41WiringError as V41WiringError
from ._window import AbstractWindow as AbstractWindow
from ._window import BandWindow as BandWindow
from ._window import GatheredWindow as GatheredWindow
from .remat import SELECTION_NAME as SELECTION_NAME
from .remat import compose_selection_policy as compose_selection_policy

__all__ = [
    "AbstractIndexedAttention",
    "AbstractIndexerLoss",
    "AbstractAttentionKernel",
    "AbstractNumerics",
    "AbstractPicks",
    "AbstractPlacement",
    "AbstractScorer",
    "AbstractSelection",
    "AbstractWindow",
    "AttentionTarget",
    "AutoAttention",
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
    "DeepSeekV41Inference",
    "EntryLayout",
    "ExactNumerics",
    "Fp8Weight",
    "Execution",
    "ContextParallel",
    "HeadParallel",
    "GatheredPicks",
    "GatheredRows",
    "GatheredWindow",
    "IndexerLossStage",
    "MaskedPicks",
    "PallasAttention",
    "PallasScorer",
    "PallasSelection",
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
    "V41Attention",
    "V41AttentionConfig",
    "V41Compressor",
    "V41Shared",
    "V41WiringError",
    "Visibility",
    "XlaAttention",
    "XlaScorer",
    "YaRNScaling",
    "compose_selection_policy",
    "candidate_blocks",
    "entry_layout",
    "entry_visibility",
    "extend_v41_stack",
    "generate",
    "indexer_kl_loss",
    "indexer_scores",
    "pool_windows",
    "projected_indexer_kl_loss",
    "run_v41_stack",
    "segment_positions",
    "select_topk",
    "sparse_attention",
    "CandidateVisibility",
    "AbstractCompressor",
    "GatheredIndexerLoss",
    "GatheredSelection",
    "IndexerHeads",
    "extend_stack",
    "run_stack",
    "V4Block",
]
