"""The V4 family's pipeline, written once for every layer composed of a ``V4Block`` and the
parts that say where its entries and selection come from (``csa_eqx._sources``): V4's
sliding, CSA and HCA layers and V4.1's sliding, full, reindex and reuse roles
(docs/concepts.md, "The DeepSeek-V4 attention block"; docs/v41.md).

A layer of the family holds ``block`` (a ``V4Block``), ``entry_source`` (an
``AbstractEntries``, ``None`` for a sliding layer) and ``selection_source`` (an
``AbstractSelectionSource``), its
``config`` (a ``V4FamilyConfig``), ``execution`` and ``formats``; and ``compress(x, source)``
for ``OwnEntries``, ``indexer_problem`` for ``OwnSelection``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array

from .._layout import Visibility, segment_positions, token_rows
from .._loss.base import AttentionTarget
from .._loss.kl import attention_target
from .._placement.heads import split_specs
from .._rows import whole_rows
from . import checks
from .block import V4Block
from .cache import V4Cache, check_cache_size, compressor_state, empty_rows
from .forward import Forward, V41Shared

__all__ = ["v4_forward", "v4_head_specs", "v4_cache", "v4_entry_attention"]


def v4_forward(layer, x: Array, source, stage: str, want_loss: bool, shared: V41Shared) -> Forward:
    """The pipeline of a V4-family ``layer`` over ``source`` (the forward's ``Rows`` or
    ``extend``'s ``ChunkSource``): the queries and the sliding window's keys
    (``layer.block``), the compressed entries and their selection (``layer.entry_source``,
    ``layer.selection_source``), one attention over the window and the entries with the sinks, the
    grouped output.

    **Arguments** and **Returns:** as ``AbstractIndexedAttention.forward_rows``.
    """
    ex, block = layer.execution, layer.block
    qr, q, kv = block.project_qkv(x, source.positions, ex.numerics)
    kv = ex.numerics.kv(kv, block.rope.dim, layer.formats)
    reads, source = source.window_reads(ex.window, kv, layer.config.sliding_window)
    selection = problem = entries = None
    published = {}
    if layer.entry_source is not None:
        compressed, source, published = layer.entry_source.entries(layer, x, source, shared)
        entries = compressed.entries.astype(kv.dtype)
        visibility = Visibility(source.query_index, source.segment, compressed.layout)
        selection, problem, chosen = layer.selection_source.select(
            layer, x, qr, source.positions, compressed, visibility, shared
        )
        published = {**published, **chosen}
        reads = reads.join(ex.entry_reads(entries, visibility, selection, stage))
    o = ex.attend(q, reads, block.sinks, block.scale, return_lse=want_loss)
    target = None
    if want_loss:
        o, lse = o
        target = AttentionTarget(q, entries, lse, block.scale)
    y = block.project_out(o, source.positions, ex.numerics)
    return Forward(y, selection, problem, target, source, published)


def v4_head_specs(config, axis: str) -> tuple:
    """Head parallelism of a V4-family layer over ``axis``: its block's per-head arrays split
    (``V4Block.head_specs``), every other array replicated. See
    ``AbstractIndexedAttention.head_specs``."""
    specs = split_specs({f"block.{k}": v for k, v in V4Block.head_specs(axis).items()})
    return specs, {"num_heads": config.num_heads, "o_groups": config.o_groups}


def v4_cache(layer, batch_size: int, max_length: int, dtype, index_compressor=None) -> V4Cache:
    """An empty decode cache of a V4-family ``layer``: its block's window ring, and with a
    compressor of its own (``layer.compressor``) ``max_length // m`` entry slots and the
    compressor's state (and ``index_compressor``'s: V4's CSA indexer keys).

    **Arguments:** the ``layer``, ``batch_size``, ``max_length`` (tokens per row), the buffers'
    ``dtype`` and the layer's ``index_compressor`` (``None``: none).

    **Returns:** a ``csa_eqx.V4Cache`` (``length`` 0 in every row).
    """
    check_cache_size(batch_size, max_length)
    own = layer.compressor
    slots = 0 if own is None else max_length // layer.entry_rate
    length, position, segment = empty_rows(batch_size)
    empty = jnp.full((batch_size, slots), -1, jnp.int32)  # copied below: distinct buffers
    return V4Cache(
        length=length,
        position=position,
        segment=segment,
        **layer.block.window_cache(batch_size, layer.config.sliding_window, dtype),
        entry_end=empty,
        entry_segment=jnp.copy(empty),
        entry_count=jnp.zeros((batch_size,), jnp.int32),
        compressor=compressor_state(own, batch_size, slots, dtype),
        indexer=compressor_state(index_compressor, batch_size, slots, dtype),
        max_length=max_length,
    )


def v4_entry_attention(layer, x: Array, segment_ids: Array | None, shared: V41Shared) -> tuple:
    """Where a V4-family ``layer``'s *dense* attention looks, next to what its own indexer picks:
    the ``"dense"`` stage's forward over the whole sequence (from the state ``shared``
    published before it), its attention mass on each entry slot (summed over heads,
    L1-normalised over the entries its indexer may pick: the dense-stage KL target) and its
    selection. ``ValueError`` for a layer without an indexer of its own."""
    c = layer.config
    if layer.indexer is None:
        raise ValueError(
            f"entry_attention needs a layer with an indexer of its own (CSA, or a V4.1 index "
            f"source); this one has none ({type(layer).__name__})"
        )
    x, _, segment_ids = checks.layer_inputs(c.hidden_size, x, None, segment_ids)
    seg, query_index = token_rows(x, segment_ids)
    rows = whole_rows(segment_positions(seg), seg, query_index, layer.entry_rate)
    f = layer.forward_rows(x, rows, "dense", True, shared)  # the window and every visible entry
    visible = f.problem.visibility.mask()
    mass = attention_target(f.target, visible, head_chunk=layer.execution.qk_head_chunk_size)
    return mass, f.selection
