"""Embedded long-context retrieval task, generated deterministically in code (no download).

Each sequence scatters ``n_pairs`` key→value pairs through filler noise, then ends with a
``QUERY`` marker followed by ``n_queries`` of those keys, each followed by its value: the model
must predict each value from its key. Pairs start on compression-window boundaries (multiples
of ``align``) and lie before the last ``min_distance`` tokens, so every answer is far outside the
sliding window: only compressed entries (picked by the indexer in CSA layers) can deliver it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["RetrievalTask"]


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
    """Vocabulary: ``[0, n_filler)`` filler, then keys, then values, then ``QUERY``."""

    seq_len: int = 1024
    n_pairs: int = 16
    n_queries: int = 8
    n_keys: int = 64
    n_values: int = 64
    n_filler: int = 16
    align: int = 4
    min_distance: int = 128
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.n_queries <= self.n_pairs <= self.n_keys:
            raise ValueError(
                f"need 0 < n_queries ({self.n_queries}) <= n_pairs "
                f"({self.n_pairs}) <= n_keys ({self.n_keys})"
            )
        if self.min_distance < 2 * self.n_queries + 1:
            raise ValueError(
                f"min_distance={self.min_distance} must exceed the query section "
                f"({2 * self.n_queries + 1} tokens)"
            )
        if self._room() < self.n_pairs:
            raise ValueError(
                f"seq_len={self.seq_len} leaves room for {self._room()} aligned "
                f"pairs before min_distance={self.min_distance}; need "
                f"n_pairs={self.n_pairs}"
            )

    def _room(self) -> int:
        return (self.seq_len - self.min_distance) // self.align

    @property
    def vocab_size(self) -> int:
        return self.n_filler + self.n_keys + self.n_values + 1

    @property
    def query_token(self) -> int:
        return self.vocab_size - 1

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, targets)``, both int32 ``[B, S]``, for training step ``step``.

        ``targets[b, t]`` is the value the model must predict at position ``t`` (a queried
        key), ``-1`` elsewhere.
        """
        rng = np.random.default_rng([self.seed, step % 2**32, step < 0])
        tokens = rng.integers(0, self.n_filler, (batch_size, self.seq_len), dtype=np.int32)
        targets = np.full((batch_size, self.seq_len), -1, np.int32)
        q0 = self.seq_len - 2 * self.n_queries
        for b in range(batch_size):
            starts = rng.choice(self._room(), self.n_pairs, replace=False) * self.align
            keys = rng.choice(self.n_keys, self.n_pairs, replace=False) + self.n_filler
            values = rng.integers(0, self.n_values, self.n_pairs) + self.n_filler + self.n_keys
            tokens[b, starts], tokens[b, starts + 1] = keys, values
            asked = rng.choice(self.n_pairs, self.n_queries, replace=False)
            tokens[b, q0 - 1] = self.query_token
            tokens[b, q0::2], tokens[b, q0 + 1 :: 2] = keys[asked], values[asked]
            targets[b, q0::2] = values[asked]
        return tokens, targets

    def pair_positions(self, tokens: np.ndarray) -> np.ndarray:
        """``[B, S]`` position of the stored pair each queried key refers to (``-1`` elsewhere)."""
        q0 = self.seq_len - 2 * self.n_queries
        out = np.full(tokens.shape, -1, np.int64)
        for b in range(tokens.shape[0]):
            context = tokens[b, : q0 - 1]
            for t in range(q0, self.seq_len, 2):
                out[b, t] = int(np.argmax(context == tokens[b, t]))
        return out
