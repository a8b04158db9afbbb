"""Indexer recall: does the indexer select what the dense attention attends to most?"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ..._ops import rms_norm
from ..._v4 import V4Attention
from .lm import DecoderLM

__all__ = ["indexer_recall", "layer_inputs"]


def layer_inputs(model: DecoderLM, tokens: Int[Array, "batch seq"]) -> list[Array]:
    """The normalised hidden states each block's attention receives."""
    h, inputs = model.embed[tokens], []
    for block in model.blocks:
        inputs.append(rms_norm(h, block.attn_norm, 1e-6))
        h, _ = block(h, None, False)
    return inputs


@eqx.filter_jit
def indexer_recall(
    model: DecoderLM,
    tokens: Int[Array, "batch seq"],
    where: Bool[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Fraction of (query, CSA layer) pairs whose most-attended compressed entry under *dense*
    attention (all visible entries, summed over heads) is among the indexer's top-k.

    ``where`` restricts the queries (e.g. the task's answer positions); queries with no visible
    entry never count. NaN when no CSA layer exists.
    """
    hits, total = jnp.zeros(()), jnp.zeros(())
    for block, x in zip(model.blocks, layer_inputs(model, tokens), strict=True):
        layer = block.attn
        if not (isinstance(layer, V4Attention) and layer.indexer is not None):
            continue
        mass, selection = layer.entry_attention(x)
        best = jnp.argmax(mass, axis=-1)
        has = jnp.max(mass, axis=-1) > 0
        if where is not None:
            has = has & where
        hit = jnp.any(selection == best[..., None], axis=-1)
        hits, total = hits + jnp.sum(hit & has), total + jnp.sum(has)
    return hits / total
