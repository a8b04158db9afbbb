"""DeepSeek-V4 attention layer: sliding window, CSA and HCA (docs/concepts.md, "The DeepSeek-V4
attention block"), composed of the V4 family's parts: the attention block (``V4Block``), V4's
compressor(s) and, for CSA, the indexer heads with their own key compressor."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._config import V4AttentionConfig
from .._entries.compressor import Compressor
from .._indexer.heads import IndexerHeads
from .._numerics.base import V4_FORMATS, DeepSeekFormats
from .base import AbstractIndexedAttention
from .block import V4Block
from .cache import V4Cache
from .execution import Execution, checked_execution
from .forward import V41Shared
from .parts import (
    AbstractEntries,
    AbstractSelectionSource,
    AllEntries,
    Compressed,
    OwnEntries,
    OwnSelection,
)
from .v4_family import v4_cache, v4_entry_attention, v4_forward, v4_head_specs

__all__ = ["V4Attention"]

_NOTHING = V41Shared()  # nothing published


def _compressor(config: V4AttentionConfig, dim: int, overlap: bool, key: Array, dtype):
    c = config
    return Compressor(
        c.hidden_size,
        dim,
        c.compress_rate,
        overlap,
        c.rope_dim,
        c.compress_rope_theta,
        c.rope_scaling,
        c.rms_norm_eps,
        key=key,
        dtype=dtype,
    )


class V4Attention(AbstractIndexedAttention):
    """One DeepSeek-V4 attention layer; the type follows ``config.compress_rate``:

    - sliding: the ``block`` only (RoPE ``rope_theta``);
    - HCA: plus a ``compressor`` (disjoint windows) whose every visible entry is attended;
    - CSA: plus an overlapping ``compressor``, the ``indexer`` heads and their own key
        compressor ``index_compressor`` (at ``index_head_dim``), whose top-k is attended.

    Parameters use the HF module's names and torch's ``[out, in]`` layout
    (``csa_eqx.hf.v4_parameter_names``: ``block.q_a_proj`` is ``q_a_proj.weight``,
    ``index_compressor.kv_proj`` is ``compressor.indexer.kv_proj.weight``, ...).

    **Arguments:** ``config`` (a ``V4AttentionConfig``), ``key``, ``dtype``, ``execution``, as in
    ``csa_eqx.AbstractIndexedAttention``.
    """

    block: V4Block
    compressor: Compressor | None
    index_compressor: Compressor | None
    indexer: IndexerHeads | None
    config: V4AttentionConfig = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    entry_source: AbstractEntries | None = eqx.field(static=True)
    selection_source: AbstractSelectionSource = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V4_FORMATS

    def __init__(self, config: V4AttentionConfig, *, key: Array, dtype=jnp.float32, execution=None):
        """A randomly initialised layer (``csa_eqx.hf`` loads weights): ``config``, PRNG
        ``key``, parameter ``dtype`` (norms and sinks stay float32) and ``execution`` (``None``:
        automatic), as ``AbstractIndexedAttention`` says."""
        c = config
        execution = checked_execution(execution, c, V4_FORMATS)
        ks = jax.random.split(key, 4)
        kind = c.layer_type
        self.block = V4Block(
            c, compressed=kind != "sliding", query_norm=True, key=ks[0], dtype=dtype
        )
        csa, sliding = kind == "csa", kind == "sliding"
        self.compressor = None if sliding else _compressor(c, c.head_dim, csa, ks[1], dtype)
        self.index_compressor = (
            _compressor(c, c.index_head_dim, True, ks[2], dtype) if csa else None
        )
        self.indexer = IndexerHeads(c, key=ks[3], dtype=dtype) if csa else None
        self.entry_source = None if sliding else OwnEntries()
        self.selection_source = OwnSelection() if csa else AllEntries()
        self.config = config
        self.execution = execution

    @property
    def selects(self) -> bool:
        """**Returns:** whether the layer selects entries (CSA)."""
        return self.indexer is not None

    @property
    def entry_rate(self) -> int:
        """**Returns:** ``compress_rate`` (tokens per compressed entry; 0 for a sliding layer)."""
        return self.config.compress_rate

    @property
    def context_halo(self) -> int:
        """Rows before a chunk of the sequence that its forward needs: the sliding window's
        ``window - 1`` and the compressor's own window (``m - 1``, HCA) or its own and the
        preceding one (``2m - 1``, CSA)."""
        c = self.config
        m = c.compress_rate
        windows = 0 if not m else (2 * m - 1 if c.layer_type == "csa" else m - 1)
        return max(c.sliding_window - 1, windows)

    def head_specs(self, axis: str) -> tuple:
        """Head parallelism over ``axis``: the block's per-head arrays split
        (``V4Block.head_specs``), every other array replicated. See
        ``AbstractIndexedAttention.head_specs``."""
        return v4_head_specs(self.config, axis)

    def forward_rows(self, x, source, stage, want_loss=False, shared=_NOTHING):
        """The V4 family's pipeline over ``source`` (``csa_eqx._v4_family.v4_forward``; see
        ``AbstractIndexedAttention.forward_rows``)."""
        return v4_forward(self, x, source, stage, want_loss, shared)

    def compress(self, x: Array, source) -> tuple[Compressed, object]:
        """The layer's compressed entries and (CSA) their index keys, each made by its own
        compressor as the numerics say (the precision they pool in, the cast before the norm,
        the rounding): ``OwnEntries``' call. The index keys compress a detached input: the
        selection ignores gradients and the loss must train the indexer's compressor only."""
        nx, c = self.execution.numerics, self.config
        dtype = nx.entry_dtype(x)

        def round_kv(e):
            return nx.kv(e, c.rope_dim, self.formats)

        entries, layout, source = source.entries(
            "compressor", self.compressor, nx.compressor_input(x), dtype, round_kv, nx
        )
        keys = None
        if self.index_compressor is not None:
            index_input = nx.compressor_input(jax.lax.stop_gradient(x))
            keys, _, source = source.entries(
                "indexer",
                self.index_compressor,
                index_input,
                dtype,
                lambda k: nx.indexer(k, self.formats),
                nx,
            )
        return Compressed(entries, keys, layout), source

    def entry_attention(
        self,
        x: Float[Array, "batch seq hidden"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """Where *dense* attention looks, next to what the indexer picks (CSA layers;
        ``csa_eqx._v4_family.v4_entry_attention``).

        **Arguments:**

        - ``x``: hidden states ``[B, S, hidden]``.
        - ``segment_ids``: packed-document ids ``[B, S]`` or ``None``.

        **Returns:**

        The attention mass ``[B, S, slots]`` (float32) on each compressed-entry slot when
        the layer attends to its window and *all* visible entries (summed over heads,
        L1-normalised over entries: the dense-stage KL target), and the indexer's
        selection int32 ``[B, S, index_topk]`` (``-1`` = none), as the forward makes it.
        """
        return v4_entry_attention(self, x, segment_ids, _NOTHING)

    def init_cache(self, batch_size: int, max_length: int, dtype=jnp.float32) -> V4Cache:
        """An empty decode cache of fixed-size buffers.

        **Arguments:**

        - ``batch_size``: rows decoded at once.
        - ``max_length``: tokens per row the cache can hold (window ring, and
            ``max_length // compress_rate`` entry slots).
        - ``dtype``: dtype of the cached keys and compressor states.

        **Returns:**

        A ``csa_eqx.V4Cache`` (``length`` 0 in every row).
        """
        return v4_cache(self, batch_size, max_length, dtype, self.index_compressor)
