"""Small complete language models built on the library's layers (CLI, notebooks, benchmarks)."""

from .lm import DecoderLM, LMConfig

__all__ = ["DecoderLM", "LMConfig"]
