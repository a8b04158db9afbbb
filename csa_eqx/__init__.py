"""csa_eqx: DeepSeek sparse attention (V4 CSA / HCA / sliding, V3.2 DSA) in JAX + Equinox."""

from .cache import CompressorState, V4Cache, V32Cache
from .compressor import Compressor, EntryLayout, entry_layout, pool_windows, segment_positions
from .config import V4AttentionConfig, V32AttentionConfig, YaRNScaling
from .generate import generate
from .indexer import indexer_scores
from .loss import indexer_kl_loss, projected_indexer_kl_loss
from .remat import SELECTION_NAME, compose_selection_policy
from .selection import entry_visibility, select_topk
from .sharding import sharded_select_entries
from .sparse import sparse_attention
from .streaming import select_projected_entries, stream_select_entries
from .v4 import Indexer, V4Attention
from .v32 import V32Attention, V32Indexer

__all__ = [
    "CompressorState",
    "V4Cache",
    "V32Cache",
    "generate",
    "SELECTION_NAME",
    "Compressor",
    "EntryLayout",
    "Indexer",
    "V4Attention",
    "V4AttentionConfig",
    "V32Attention",
    "V32AttentionConfig",
    "V32Indexer",
    "YaRNScaling",
    "compose_selection_policy",
    "entry_layout",
    "entry_visibility",
    "indexer_kl_loss",
    "projected_indexer_kl_loss",
    "indexer_scores",
    "pool_windows",
    "segment_positions",
    "select_topk",
    "sharded_select_entries",
    "select_projected_entries",
    "sparse_attention",
    "stream_select_entries",
]
