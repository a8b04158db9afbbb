"""csa_eqx: DeepSeek sparse attention (V4 CSA / HCA / sliding, V3.2 DSA) in JAX + Equinox."""

from .compressor import Compressor, EntryLayout, entry_layout, pool_windows, segment_positions
from .config import V4AttentionConfig, YaRNScaling
from .indexer import indexer_scores
from .remat import SELECTION_NAME, compose_selection_policy
from .selection import entry_visibility, select_topk
from .sparse import sparse_attention
from .v4 import Indexer, V4Attention

__all__ = [
    "SELECTION_NAME",
    "Compressor",
    "EntryLayout",
    "Indexer",
    "V4Attention",
    "V4AttentionConfig",
    "YaRNScaling",
    "compose_selection_policy",
    "entry_layout",
    "entry_visibility",
    "indexer_scores",
    "pool_windows",
    "segment_positions",
    "select_topk",
    "sparse_attention",
]
