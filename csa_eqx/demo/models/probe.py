"""Indexer recall: does the indexer select what the dense attention attends to most?"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ... import StackState
from ..._layers.v4 import V4Attention
from ..._layers.v41 import V41Attention
from ..._ops import rms_norm
from .lm import DecoderLM

__all__ = ["indexer_recall", "layer_inputs"]


def layer_inputs(model: DecoderLM, tokens: Int[Array, "batch seq"]) -> list[tuple]:
    """The normalised hidden states each block's attention receives, with the state the
    earlier layers published (a stack state: ``StackState()`` before any V4.1 layer)."""
    h, inputs, shared = model.embed[tokens], [], StackState()
    for block in model.blocks:
        inputs.append((rms_norm(h, block.attn_norm, 1e-6), shared))
        h, _, shared = block(h, None, False, shared=shared)
    return inputs


@eqx.filter_jit
def indexer_recall(
    model: DecoderLM,
    tokens: Int[Array, "batch seq"],
    where: Bool[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Fraction of (query, indexing layer) pairs whose most-attended compressed entry under
    *dense* attention (all the entries its indexer may pick, summed over heads) is among the
    indexer's top-k. Indexing layers: V4's CSA layers, V4.1's index sources (full and reindex).

    ``where`` restricts the queries (e.g. the task's answer positions); queries with no visible
    entry never count. NaN when no indexing layer exists.
    """
    hits, total = jnp.zeros(()), jnp.zeros(())
    for block, (x, shared) in zip(model.blocks, layer_inputs(model, tokens), strict=True):
        layer = block.attn
        if isinstance(layer, V41Attention) and layer.indexer is not None:
            mass, selection = layer.entry_attention(x, shared=shared)
        elif isinstance(layer, V4Attention) and layer.indexer is not None:
            mass, selection = layer.entry_attention(x)
        else:
            continue
        best = jnp.argmax(mass, axis=-1)
        has = jnp.max(mass, axis=-1) > 0
        if where is not None:
            has = has & where
        hit = jnp.any(selection == best[..., None], axis=-1)
        hits, total = hits + jnp.sum(hit & has), total + jnp.sum(has)
    return hits / total
