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

from jaxtyping import Array

from ._forward import Forward, V41Shared
from ._heads import split_specs
from ._layout import Visibility
from ._target import AttentionTarget
from ._v4_block import V4Block

__all__ = ["v4_forward", "v4_head_specs"]


def v4_forward(layer, x: Array, source, stage: str, want_loss: bool, shared: V41Shared) -> Forward:
    """The pipeline of a V4-family ``layer`` over ``source`` (the forward's ``Rows`` or
    ``extend``'s ``ChunkSource``): the queries and the sliding window's keys
    (``layer.block``), the compressed entries and their selection (``layer.entry_source``,
    ``layer.selection_source``), one attention over the window and the entries with the sinks, the
    grouped output.

    **Arguments** and **Returns:** as ``AbstractIndexedAttention.forward_rows``.
    """
    ex, block = layer.execution, layer.block
    qr, q, kv = block.project_qkv(x, source.positions)
    kv = ex.numerics.kv(kv, block.rope_dim, layer.formats)
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
    y = block.project_out(o, source.positions)
    return Forward(y, selection, problem, target, source, published)


def v4_head_specs(config, axis: str) -> tuple:
    """Head parallelism of a V4-family layer over ``axis``: its block's per-head arrays split
    (``V4Block.head_specs``), every other array replicated. See
    ``AbstractIndexedAttention.head_specs``."""
    specs = split_specs({f"block.{k}": v for k, v in V4Block.head_specs(axis).items()})
    return specs, {"num_heads": config.num_heads, "o_groups": config.o_groups}
