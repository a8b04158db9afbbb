"""Where a V4-family layer's compressed entries and its selection come from (docs/v41.md, "The
sharing schedule"): the two part families a layer is composed of besides its ``V4Block``, each
part an Equinox module holding the arrays it uses.

*Entries* (``AbstractEntries``): V4's own compressor (``OwnEntries(compressor)``: CSA and HCA
layers); V4.1's are in ``csa_eqx._layers.v41_parts``. *Selection* (``AbstractSelectionSource``):
every visible entry (``AllEntries``: HCA, and every sliding layer), or V4's own indexer with
the compressor of its keys (``OwnSelection(indexer)``: CSA layers). A part takes the layer's
execution and formats when called, and the stack state published so far (``None`` for V4,
which reads none), and says what it publishes as a dict of the state's fields.
"""

import abc
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
from equinox import AbstractVar
from jaxtyping import Array, Float, Int

from .._entries.compressor import AbstractCompressor
from .._indexer.base import AbstractIndexer
from .._indexer.heads import IndexerHeads
from .._layout import EntryLayout, Visibility
from .._numerics.base import DeepSeekFormats

__all__ = [
    "Compressed",
    "AbstractEntries",
    "OwnEntries",
    "AbstractSelectionSource",
    "AllEntries",
    "OwnSelection",
]


class Compressed(NamedTuple):
    """A layer's compressed entries as its attention and indexer read them.

    **Arguments:** the ``entries [B, T, head_dim]``, their index ``keys [B, T, index_dim]``
    (``None``: the selection makes its own, or there is no indexer) and their slots' ``layout``.
    """

    entries: Float[Array, "batch slots dim"]
    keys: Float[Array, "batch slots index_dim"] | None
    layout: EntryLayout


class AbstractEntries(eqx.Module):
    """Where a layer's compressed entries come from. ``compressor``: the compressor it pools
    with (``None``: it pools none)."""

    compressor: AbstractVar[AbstractCompressor | None]

    @abc.abstractmethod
    def entries(
        self, x: Array, source, state: Any, execution, formats: DeepSeekFormats
    ) -> tuple[Compressed, Any, dict]:
        """**Arguments:** the layer's (numerics') input ``x [B', L, hidden]``, the ``source``
        of the keys seen so far (``csa_eqx._rows``), the stack state published so far, the
        layer's ``execution`` and ``formats``.

        **Returns:** ``(Compressed, source, published)``: the entries, the source after
        reading them and the state fields this publishes (by name).
        """

    def compressors(self) -> dict[str, AbstractCompressor]:
        """**Returns:** the compressor whose state a decode cache keeps, by the cache's field
        (``{"compressor": ...}``; none for a part that pools nothing)."""
        return {} if self.compressor is None else {"compressor": self.compressor}


class OwnEntries(AbstractEntries):
    """The layer's own compressor: V4's CSA and HCA entries, pooled in the numerics'
    compressor precision, cast before the norm and rounded as the KV (the numerics' ``kv``).

    **Arguments:** the ``compressor`` (a ``csa_eqx.Compressor``).
    """

    compressor: AbstractCompressor

    def entries(self, x, source, state, execution, formats):
        nx = execution.numerics

        def round_kv(e):
            return nx.kv(e, self.compressor.rope.dim, formats)

        entries, layout, source = source.entries(
            "compressor", self.compressor, nx.compressor_input(x), nx.entry_dtype(x), round_kv, nx
        )
        return Compressed(entries, None, layout), source, {}


class AbstractSelectionSource(eqx.Module):
    """Where a layer's selection comes from. ``selects``: whether the layer reads through one
    (``aux["selection"]`` is an array); ``indexer``: the indexer it runs (``None``: none)."""

    indexer: AbstractVar[AbstractIndexer | None]
    selects: ClassVar[bool] = True

    @abc.abstractmethod
    def select(
        self,
        x: Array,
        qr: Array,
        positions: Int[Array, "batch rows"],
        compressed: Compressed,
        visibility: Visibility,
        source,
        state: Any,
        execution,
        formats: DeepSeekFormats,
    ) -> tuple:
        """**Arguments:** the layer's input ``x``, query latent ``qr`` and RoPE ``positions``
        (``[B', L, ...]``), its ``Compressed`` entries, their ``visibility``, the ``source`` of
        the keys seen so far, the stack state published so far and the layer's ``execution``
        and ``formats``.

        **Returns:** ``(selection or None, problem or None, published, source)``: the selection
        the attention reads through (``None``: every visible entry), the indexer's
        ``SelectionProblem`` (``None`` without an indexer), the state fields this publishes and
        the source after any keys it read.
        """

    def compressors(self) -> dict[str, AbstractCompressor]:
        """**Returns:** the compressor of the keys it scores whose state a decode cache keeps,
        by the cache's field (none by default)."""
        return {}


class AllEntries(AbstractSelectionSource):
    """No selection: the attention reads every visible entry (HCA). **Arguments:** none."""

    indexer: ClassVar[None] = None
    selects: ClassVar[bool] = False

    def select(self, x, qr, positions, compressed, visibility, source, state, execution, formats):
        return None, None, {}, source


class OwnSelection(AbstractSelectionSource):
    """V4's own indexer over the keys of its own compressor (``indexer.compressor``), pooled from
    a detached input (the selection ignores gradients; the loss trains the indexer's
    compressor only) and rounded as the numerics round the indexer's inputs.

    **Arguments:** the ``indexer`` (an ``IndexerHeads`` with its key ``compressor``).
    """

    indexer: IndexerHeads

    def select(self, x, qr, positions, compressed, visibility, source, state, execution, formats):
        nx, compressor = execution.numerics, self.indexer.compressor
        index_input = nx.compressor_input(jax.lax.stop_gradient(x))

        def rounded(k):
            return nx.indexer(k, formats)

        dtype = nx.entry_dtype(x)
        keys, _, source = source.entries("indexer", compressor, index_input, dtype, rounded, nx)
        args = (x, qr, positions, keys, visibility, execution, formats)
        selection, problem, published = self.indexer(*args, state=state)
        return selection, problem, published, source

    def compressors(self):
        return {"indexer": self.indexer.compressor}
