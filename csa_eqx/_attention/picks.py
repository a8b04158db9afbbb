"""How the attention reads each query's picked entries (CSA's, V3.2's selection): the picks
strategies describe the reads (``csa_eqx.Reads``); ``csa_eqx.AutoPicks`` chooses."""

from __future__ import annotations

import abc

import equinox as eqx
from jaxtyping import Array, Float, Int

from .._layout import Visibility
from .reads import DenseKeys, GatheredRows, Reads

__all__ = ["AbstractPicks", "GatheredPicks", "MaskedPicks", "entry_reads"]


class AbstractPicks(eqx.Module):
    """How the attention reads each query's picked entries (CSA's, V3.2's selection)."""

    @abc.abstractmethod
    def reads(
        self,
        keys: Float[Array, "batch entries dim"],
        visibility: Visibility,
        picks: Int[Array, "batch seq k"],
        values: Float[Array, "batch entries vdim"] | None = None,
        value_width: int | None = None,
    ) -> Reads:
        """**Arguments:** the entries' ``keys`` (and MLA ``values``, or the ``value_width`` of
        values that are the keys' first features), their ``visibility`` and each query's
        distinct ``picks`` (``-1`` = none).

        **Returns:** the ``Reads`` of the picked entries (gathered rows or masked dense entries).
        """


class GatheredPicks(AbstractPicks):
    """Gather each query's ``k`` picked keys (``[B, Qb, k, d]`` per query block); cheap
    while ``k`` is small against the entry count. **Arguments:** none."""

    def reads(self, keys, visibility, picks, values=None, value_width=None):
        return Reads(gathered=(GatheredRows(keys, picks, values, value_width),))


class MaskedPicks(AbstractPicks):
    """One matmul over all entries, masked to each query's visible picks; cheaper than
    gathering when ``k`` is close to the entry count (short sequences). **Arguments:** none."""

    def reads(self, keys, visibility, picks, values=None, value_width=None):
        layout, rows = visibility.layout, visibility[:2]
        return Reads(dense=DenseKeys(keys, layout, *rows, values, picks, value_width))


def entry_reads(
    picks: AbstractPicks,
    keys: Float[Array, "batch entries dim"],
    visibility: Visibility,
    selection: Int[Array, "batch seq k"] | None,
    values: Float[Array, "batch entries vdim"] | None = None,
    value_width: int | None = None,
) -> Reads:
    """How each query reads the entries (V4: compressed entries, V3.2: tokens), forward and
    ``extend`` alike: every visible one by one matmul without a ``selection`` (HCA, or a
    dense warm-up), else its picks as the ``picks`` strategy says.

    **Arguments:** the execution's ``picks`` strategy, the entries' ``keys`` (and MLA
    ``values``, or the ``value_width`` of values that are the keys' first features: V3.2's
    latent), their ``visibility`` and the int32 ``selection [B, S, k]`` (``-1`` = none;
    ``None`` = every visible entry).

    **Returns:** the entries' ``Reads`` (dense entries, masked dense entries or gathered rows).
    """
    if selection is None:
        layout, rows = visibility.layout, visibility[:2]
        return Reads(dense=DenseKeys(keys, layout, *rows, values, None, value_width))
    return picks.reads(keys, visibility, selection, values, value_width)
