"""The V4 family's layers: an attention block (``V4Block``) and the parts that say where its
entries and its selection come from (``csa_eqx._layers.parts``, ``csa_eqx._layers.v41_parts``),
run by one pipeline (docs/concepts.md, "The DeepSeek-V4 attention block"; docs/v41.md). V4's
sliding, CSA and HCA layers and V4.1's sliding, full, reindex and reuse roles differ only in
the parts their constructors build.
"""

from typing import Any

import jax.numpy as jnp
from equinox import AbstractVar
from jaxtyping import Array, Float, Int

from .. import _checks as checks
from .._attention.picks import entry_reads
from .._decode.cache import V4Cache, check_cache_size, compressor_state, empty_rows
from .._entries.compressor import AbstractCompressor
from .._indexer.base import AbstractIndexer
from .._layout import Visibility, segment_positions, token_rows
from .._loss.base import AttentionTarget
from .._loss.kl import attention_target
from .._placement.heads import split_specs
from .._rows import whole_rows
from .base import AbstractIndexedAttention, config_sizes
from .block import V4Block
from .forward import Forward
from .parts import AbstractEntries, AbstractSelectionSource

__all__ = ["AbstractV4Attention"]


class AbstractV4Attention(AbstractIndexedAttention):
    """A V4-family layer: its ``block`` (a ``V4Block``), ``entry_source`` (an
    ``AbstractEntries``; ``None`` for a sliding layer) and ``selection_source`` (an
    ``AbstractSelectionSource``), each holding its own arrays; one pipeline (``forward_rows``)
    over them. ``compressor`` and ``indexer`` read the parts' own (``None``: none)."""

    block: AbstractVar[V4Block]
    entry_source: AbstractVar[AbstractEntries | None]
    selection_source: AbstractVar[AbstractSelectionSource]

    @property
    def compressor(self) -> AbstractCompressor | None:
        """**Returns:** the compressor of the layer's own entries (``None``: none)."""
        return None if self.entry_source is None else self.entry_source.compressor

    @property
    def indexer(self) -> AbstractIndexer | None:
        """**Returns:** the layer's own indexer (``None``: none)."""
        return self.selection_source.indexer

    @property
    def selects(self) -> bool:
        """**Returns:** whether the layer reads through a selection (its own or an inherited
        one)."""
        return self.entry_source is not None and self.selection_source.selects

    def _summary_sizes(self, *selection: str) -> dict[str, int]:
        """The sizes ``summary`` shows: ``compress_rate``, the config's fields ``selection``
        names (the indexer's, where the layer reads a selection), the window and the
        attention's sizes."""
        window = ("sliding_window", "num_heads", "head_dim", "hidden_size")
        return dict(compress_rate=self.entry_rate, **config_sizes(self.config, *selection, *window))

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism over ``axis``: the block's per-head arrays split
        (``V4Block.head_specs``), every other array replicated. See
        ``AbstractIndexedAttention.head_specs``."""
        specs = split_specs({f"block.{k}": v for k, v in V4Block.head_specs(axis).items()})
        return specs, {"num_heads": self.config.num_heads, "o_groups": self.config.o_groups}

    def forward_rows(self, x, source, stage, want_loss=False, *state) -> Forward:
        """The pipeline over ``source`` (see ``AbstractIndexedAttention.forward_rows``): the
        queries and the sliding window's keys (``block``), the compressed entries and their
        selection (``entry_source``, ``selection_source``), one attention over the window and
        the entries with the sinks (the execution's kernel), the grouped output."""
        ex, block, nx = self.execution, self.block, self.execution.numerics
        published = state[0] if state else None
        qr, q, kv = block.project_qkv(x, source.positions, nx)
        kv = nx.kv(kv, block.rope.dim, self.formats)
        reads, source = source.window_reads(ex.window, kv, self.config.sliding_window)
        selection = problem = entries = None
        fields = {}
        if self.entry_source is not None:
            given = (published, ex, self.formats)
            compressed, source, fields = self.entry_source.entries(x, source, *given)
            entries = compressed.entries.astype(kv.dtype)
            visibility = Visibility(source.query_index, source.segment, compressed.layout)
            selection, problem, chosen, source = self.selection_source.select(
                x, qr, source.positions, compressed, visibility, source, *given
            )
            fields = {**fields, **chosen}
            picks = None if stage == "dense" else selection
            reads = reads.join(entry_reads(ex.picks, entries, visibility, picks))
        kernel = dict(numerics=nx, query_block=ex.query_block, tiles=ex.tiles)
        o = ex.attention(q, reads, block.sinks, block.scale, return_lse=want_loss, **kernel)
        target = None
        if want_loss:
            o, lse = o
            target = AttentionTarget(q, entries, lse, block.scale)
        y = block.project_out(o, source.positions, nx)
        return Forward(y, selection, problem, target, source, fields)

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
        """An empty decode cache of fixed-size buffers: the window ring, and with compressors of
        the layer's own (V4's CSA and HCA, a V4.1 KV source) ``max_length // m`` entry slots and
        each compressor's state. V4.1's reindex and reuse layers hold no compressed state: they
        read their KV source's.

        **Arguments:**

        - ``batch_size``: rows decoded at once.
        - ``max_length``: tokens per row the cache can hold.
        - ``dtype``: dtype of the cached keys and compressor states.

        **Returns:**

        A ``csa_eqx.V4Cache`` (``length`` 0 in every row).
        """
        check_cache_size(batch_size, max_length)
        own = {} if self.entry_source is None else self.entry_source.compressors()
        own = {**own, **self.selection_source.compressors()}
        slots = max_length // self.entry_rate if own else 0
        length, position, segment = empty_rows(batch_size)
        empty = jnp.full((batch_size, slots), -1, jnp.int32)  # copied below: distinct buffers
        return V4Cache(
            length=length,
            position=position,
            segment=segment,
            **self.block.window_cache(batch_size, self.config.sliding_window, dtype),
            entry_end=empty,
            entry_segment=jnp.copy(empty),
            entry_count=jnp.zeros((batch_size,), jnp.int32),
            compressor=compressor_state(own.get("compressor"), batch_size, slots, dtype),
            indexer=compressor_state(own.get("indexer"), batch_size, slots, dtype),
            max_length=max_length,
        )

    def _entry_attention(
        self, x: Float[Array, "batch seq hidden"], segment_ids, *state: Any
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """``entry_attention`` of a layer with an indexer of its own, from the stack state the
        earlier layers published (``state``; nothing for V4)."""
        if self.indexer is None:
            raise ValueError(
                f"entry_attention needs a layer with an indexer of its own (CSA, or a V4.1 "
                f"index source); this one has none ({type(self).__name__})"
            )
        x, _, segment_ids = checks.layer_inputs(self.config.hidden_size, x, None, segment_ids)
        seg, query_index = token_rows(x, segment_ids)
        rows = whole_rows(segment_positions(seg), seg, query_index, self.entry_rate)
        f = self.forward_rows(x, rows, "dense", True, *state)  # the window, every visible entry
        visible = f.problem.visibility.mask()
        mass = attention_target(f.target, visible, head_chunk=self.execution.qk_head_chunk_size)
        return mass, f.selection
