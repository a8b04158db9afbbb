"""DeepSeek-V4 attention layer: sliding window, CSA and HCA (docs/concepts.md, "The DeepSeek-V4
attention block"), composed of the V4 family's parts: the attention block (``V4Block``), its
own compressor (``OwnEntries``) and, for CSA, its own indexer with the compressor of its keys
(``OwnSelection``)."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._config import V4AttentionConfig
from .._entries.compressor import Compressor
from .._execution import Execution
from .._indexer.heads import IndexerHeads
from .._numerics.base import V4_FORMATS, DeepSeekFormats
from .block import V4Block
from .parts import AbstractEntries, AbstractSelectionSource, AllEntries, OwnEntries, OwnSelection
from .v4_family import AbstractV4Attention

__all__ = ["V4Attention"]


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


_KINDS = {
    "csa": "CSA (compressed sparse attention)",
    "hca": "HCA (heavily compressed attention)",
    "sliding": "sliding-window attention",
}


class V4Attention(AbstractV4Attention):
    """One DeepSeek-V4 attention layer; the type follows ``config.compress_rate``:

    - sliding: the ``block`` only (RoPE ``rope_theta``);
    - HCA: plus its own compressor (disjoint windows, ``entry_source``) whose every visible
        entry is attended (``selection_source = AllEntries()``);
    - CSA: plus an overlapping compressor and its own indexer (``selection_source``: the
        indexer heads and the compressor of their keys, at ``index_head_dim``), whose top-k
        is attended.

    Parameters keep torch's ``[out, in]`` layout; their pytree paths are the parts'
    (``.block.q_a_proj``, ``.entry_source.compressor.kv_proj``,
    ``.selection_source.indexer.q_b_proj``, ``.selection_source.indexer.compressor.kv_proj``;
    ``csa_eqx.hf.parameter_paths`` maps the checkpoint's names to them, docs/api/layers.md).
    ``compressor``, ``index_compressor`` and ``indexer`` read the parts' (``None``: none).

    **Arguments:** ``config`` (a ``V4AttentionConfig``), ``key``, ``dtype``, ``execution``, as in
    ``csa_eqx.AbstractIndexedAttention``.
    """

    block: V4Block
    entry_source: AbstractEntries | None
    selection_source: AbstractSelectionSource
    config: V4AttentionConfig = eqx.field(static=True)
    execution: Execution = eqx.field(static=True)
    formats: ClassVar[DeepSeekFormats] = V4_FORMATS

    def __init__(self, config: V4AttentionConfig, *, key: Array, dtype=jnp.float32, execution=None):
        """A randomly initialised layer (``csa_eqx.hf`` loads weights): ``config``, PRNG
        ``key``, parameter ``dtype`` (norms and sinks stay float32) and ``execution`` (``None``:
        automatic), as ``AbstractIndexedAttention`` says."""
        c = config
        execution = Execution.checked(execution, c, V4_FORMATS)
        ks = jax.random.split(key, 4)
        kind = c.layer_type
        csa, sliding = kind == "csa", kind == "sliding"
        self.block = V4Block(c, compressed=not sliding, query_norm=True, key=ks[0], dtype=dtype)
        self.entry_source = (
            None if sliding else OwnEntries(_compressor(c, c.head_dim, csa, ks[1], dtype))
        )
        self.selection_source = AllEntries()
        if csa:
            keys = _compressor(c, c.index_head_dim, True, ks[2], dtype)
            indexer = IndexerHeads(c, key=ks[3], dtype=dtype, compressor=keys)
            self.selection_source = OwnSelection(indexer)
        self.config = config
        self.execution = execution

    @property
    def index_compressor(self):
        """**Returns:** the compressor of the indexer's keys (CSA; ``None`` otherwise)."""
        return None if self.indexer is None else self.indexer.compressor

    @property
    def entry_rate(self) -> int:
        """**Returns:** ``compress_rate`` (tokens per compressed entry; 0 for a sliding layer)."""
        return self.config.compress_rate

    def summary(self) -> tuple[str, dict[str, int]]:
        """See ``AbstractIndexedAttention.summary``: the layer type, ``compress_rate``, the
        indexer's ``index_topk`` and heads (CSA), the window and the attention's sizes."""
        csa = self.config.layer_type == "csa"
        picks = ("index_topk", "index_n_heads") if csa else ()
        return _KINDS[self.config.layer_type], self._summary_sizes(*picks)

    @property
    def context_halo(self) -> int:
        """Rows before a chunk of the sequence that its forward needs: the sliding window's
        ``window - 1`` and the compressor's own window (``m - 1``, HCA) or its own and the
        preceding one (``2m - 1``, CSA)."""
        c = self.config
        m = c.compress_rate
        windows = 0 if not m else (2 * m - 1 if c.layer_type == "csa" else m - 1)
        return max(c.sliding_window - 1, windows)

    def entry_attention(
        self,
        x: Float[Array, "batch seq hidden"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq slots"], Int[Array, "batch seq k"]]:
        """Where *dense* attention looks, next to what the indexer picks (CSA layers).

        **Arguments:**

        - ``x``: hidden states ``[B, S, hidden]``.
        - ``segment_ids``: packed-document ids ``[B, S]`` or ``None``.

        **Returns:**

        The attention mass ``[B, S, slots]`` (float32) on each compressed-entry slot when
        the layer attends to its window and *all* visible entries (summed over heads,
        L1-normalised over entries: the dense-stage KL target), and the indexer's
        selection int32 ``[B, S, index_topk]`` (``-1`` = none), as the forward makes it.
        """
        return self._entry_attention(x, segment_ids)
