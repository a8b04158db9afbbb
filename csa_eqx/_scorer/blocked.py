"""``BlockedScorer``: the indexer scores one key block at a time (a second scoring kernel
written against ``AbstractScorer``; docs/api/execution.md, "Scoring kernels")."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .base import AbstractScorer, indexer_scores

__all__ = ["BlockedScorer"]


class BlockedScorer(AbstractScorer):
    """Scores over key blocks: a ``lax.map`` over blocks of ``key_block`` keys, each block's
    ReLU, head weights and head sum fused into one ``[B, S, key_block]`` tile, so the
    per-head logits are at most ``[B, S, heads at once, key_block]`` (the reference forms
    ``[B, S, heads at once, T]``). Each block is scored by the reference formula, so the scores
    equal ``XlaScorer``'s up to the contraction order XLA picks for each dot shape (a few
    float32 ulp; exact where products and sums are exact, e.g. small-integer inputs), the
    same property ``StreamingSelection``'s tiles have: selections are bitwise equal wherever
    the scores are (tests/test_scorer.py).

    **Arguments:**

    - ``key_block``: keys per block (> 0); the last block is padded with zero keys, whose
        scores are dropped.
    """

    key_block: int = eqx.field(default=128, static=True)

    def __check_init__(self):
        kb = self.key_block
        if not isinstance(kb, int) or isinstance(kb, bool) or kb <= 0:
            raise ValueError(f"BlockedScorer.key_block must be an int > 0 (got {kb!r})")

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        b, t, d = keys.shape
        kb = max(1, min(self.key_block, t))
        n = -(-t // kb)
        blocks = jnp.pad(keys, ((0, 0), (0, n * kb - t), (0, 0))).reshape(b, n, kb, d)

        def tile(block):  # [B, kb, d] -> [B, S, kb]
            return indexer_scores(q, weights, block, head_chunk=head_chunk, score_dtype=score_dtype)

        tiles = jax.lax.map(tile, jnp.moveaxis(blocks, 1, 0))  # [n, B, S, kb]
        scores = jnp.moveaxis(tiles, 0, 2).reshape(b, q.shape[1], n * kb)
        return scores[:, :, :t]
