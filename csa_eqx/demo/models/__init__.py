"""Small complete language models built on the library's layers (CLI, notebooks, benchmarks)."""

from .lm import DecoderLM, LMConfig, with_indexer_stage

__all__ = ["DecoderLM", "LMConfig", "with_indexer_stage"]
