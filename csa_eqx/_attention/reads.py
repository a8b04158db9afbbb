"""What a query reads, as typed values: the compute behind them is an attention kernel
(``csa_eqx.AbstractAttentionKernel``; ``csa_eqx.XlaAttention`` is the reference).

A ``Reads`` value collects the key sets one softmax runs over (plus the sink):

* ``GatheredRows``: per-query row indices into a key (and value) array, gathered;
* ``BandRows``: the sliding window over token rows, by a banded matmul per query block;
* ``DenseKeys``: entries every query may see once visible, by one matmul, optionally masked
  to each query's picks.

The picks strategies (``csa_eqx.AbstractPicks``), the window strategies
(``csa_eqx.AbstractWindow``) and ``entry_reads`` build them; the layers join them and
hand them to the execution's attention kernel (docs/concepts.md, "Sparse attention without a
dense mask").
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._layout import EntryLayout, entry_visibility, gather_keys, scatter_rows

__all__ = [
    "Reads",
    "GatheredRows",
    "BandRows",
    "DenseKeys",
    "gather_keys",
    "picked_mask",
    "nonfinite_rows",
    "zero_rows",
]


def _value_rows(keys: Array, values: Array | None, value_width: int | None) -> Array | None:
    """A read set's values: its own, its keys' first ``value_width`` features, or ``None`` (the
    keys themselves)."""
    return keys[..., :value_width] if value_width is not None else values


def _check_values(keys: Array, values: Array | None, value_width: int | None) -> None:
    if value_width is None:
        return
    if values is not None:
        raise ValueError("values and value_width are exclusive: give one (or neither)")
    if not (isinstance(value_width, int) and 1 <= value_width <= keys.shape[-1]):
        raise ValueError(
            f"value_width must be an int in [1, {keys.shape[-1]}] (the keys' width; "
            f"got {value_width!r})"
        )


class GatheredRows(eqx.Module):
    """Rows each query gathers from ``keys`` (shared by all heads).

    **Arguments:**

    - ``keys``: float ``[B, N, d]``.
    - ``indices``: int32 ``[B, S, n]`` rows of ``keys`` per query (``-1`` = none).
    - ``values``: float ``[B, N, vdim]`` (MLA) or ``None`` (= ``keys``, V4).
    - ``value_width``: the values are the keys' first ``value_width`` features (V3.2's MLA:
        the latent ``c_kv`` of ``[c_kv ; k_rope]``; static), instead of ``values``. A kernel
        may then read each row once (``MosaicAttention`` does).
    """

    keys: Float[Array, "batch keys dim"]
    indices: Int[Array, "batch seq n"]
    values: Float[Array, "batch keys vdim"] | None = None
    value_width: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        _check_values(self.keys, self.values, self.value_width)

    def value_rows(self) -> Float[Array, "batch keys vdim"] | None:
        """**Returns:** the values as an array of their own (``keys[..., :value_width]`` when
        they are the keys' first features), or ``None`` when they are the keys."""
        return _value_rows(self.keys, self.values, self.value_width)


class BandRows(eqx.Module):
    """The sliding window by a banded matmul: query ``t`` sees token rows
    ``t - window < j <= t`` of its own segment. Rows ``0..S-1`` of ``keys`` are the queries'
    own tokens; with a ``history`` (``extend``'s ring: the segments of the ``window - 1``
    tokens just before the queries, ``-1`` = empty) those are rows ``0..window-2`` and the
    queries' own follow. Each query block reads one slab of ``block + window - 1`` rows.

    **Arguments:**

    - ``keys``: float ``[B, N, d]`` token rows (``N >= S``, or ``window - 1 + S`` with a
        history).
    - ``segment``: int32 ``[B, S]`` the queries' segment ids.
    - ``window``: the window length (``>= 1``, static).
    - ``history``: int32 ``[B, window - 1]`` or ``None`` (nothing precedes the queries' rows).
    - ``values``: float ``[B, N, vdim]`` or ``None`` (= ``keys``).
    """

    keys: Float[Array, "batch keys dim"]
    segment: Int[Array, "batch seq"]
    window: int = eqx.field(static=True)
    history: Int[Array, "batch ring"] | None = None
    values: Float[Array, "batch keys vdim"] | None = None

    def __check_init__(self):
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"window must be an int >= 1 (got {self.window!r})")
        ring = self.window - 1
        if self.history is not None and self.history.shape[1] != ring:
            raise ValueError(
                f"window_history must have window - 1 = {ring} rows "
                f"(got shape {tuple(self.history.shape)})"
            )


class DenseKeys(NamedTuple):
    """Entries attended by matmul: ``keys [B, T, d]``, visible to query ``t`` per
    ``entry_visibility(query_index, query_segment, layout)``; ``values [B, T, vdim]`` default to
    the keys (V4) and are separate for MLA (V3.2). With ``picks [B, S, p]`` (distinct entry
    slots, ``-1`` = none) a query attends only to its visible picks (docs/concepts.md,
    "Sparse attention without a dense mask").

    **Arguments:**

    - ``keys``: float ``[B, T, d]``; values: float ``[B, T, vdim]`` or ``None`` (= ``keys``).
    - ``layout``: the entries' ``EntryLayout``.
    - ``query_index``, ``query_segment``: int32 ``[B, S]``, as in ``Visibility``.
    - ``picks``: int32 ``[B, S, p]`` or ``None`` (every visible entry).
    - ``value_width``: the values are the keys' first ``value_width`` features (as in
        ``GatheredRows``), instead of ``values``.
    """

    keys: Float[Array, "batch entries dim"]
    layout: EntryLayout
    query_index: Int[Array, "batch seq"]
    query_segment: Int[Array, "batch seq"]
    values: Float[Array, "batch entries vdim"] | None = None
    picks: Int[Array, "batch seq picks"] | None = None
    value_width: int | None = None

    def value_rows(self) -> Float[Array, "batch entries vdim"] | None:
        """**Returns:** the values as an array of their own, or ``None`` (= the keys); see
        ``GatheredRows.value_rows``."""
        _check_values(self.keys, self.values, self.value_width)
        return _value_rows(self.keys, self.values, self.value_width)

    def picked_rows(self) -> GatheredRows:
        """**Returns:** the entries with ``picks`` as the ``GatheredRows`` of each query's
        visible picks (the same set of rows as the visibility mask within the picks, without
        an ``[S, T]`` mask); a kernel that gathers reads them so."""
        b, s, p = self.picks.shape
        slots = jnp.clip(self.picks, 0, self.layout.end.shape[1] - 1)
        end = gather_keys(self.layout.end[..., None], slots)[..., 0]
        segment = gather_keys(self.layout.segment[..., None], slots)[..., 0]
        own = EntryLayout(end.reshape(b * s, p), segment.reshape(b * s, p), None)
        rows = (a.reshape(b * s, 1) for a in (self.query_index, self.query_segment))
        seen = (self.picks >= 0) & entry_visibility(*rows, own).reshape(b, s, p)
        picks = jnp.where(seen, self.picks, -1)
        return GatheredRows(self.keys, picks, self.values, self.value_width)


class Reads(eqx.Module):
    """Everything a block of queries reads, in one softmax (the sink adds to its
    denominator): gathered rows (in order), then the band, then the dense entries.

    **Arguments:**

    - ``gathered``: ``GatheredRows`` read sets (``()`` = none).
    - ``band``: a ``BandRows`` or ``None``.
    - ``dense``: a ``DenseKeys`` or ``None``.
    """

    gathered: tuple[GatheredRows, ...] = ()
    band: BandRows | None = None
    dense: DenseKeys | None = None

    def join(self, other: Reads) -> Reads:
        """**Arguments:** ``other`` reads of the same queries.

        **Returns:** one ``Reads`` with both's key sets (``ValueError`` when both hold a band or
        both dense entries).
        """
        for name in ("band", "dense"):
            if getattr(self, name) is not None and getattr(other, name) is not None:
                raise ValueError(f"reads to join hold two {name} reads; a Reads holds one")
        return Reads(
            self.gathered + other.gathered,
            other.band if self.band is None else self.band,
            other.dense if self.dense is None else self.dense,
        )


def nonfinite_rows(keys: Array, values: Array | None) -> Bool[Array, "batch rows"]:
    """**Returns:** which rows of ``keys`` (or of ``values``) hold a NaN or an Inf: the rows
    that poison exactly the queries that read them (``AbstractAttentionKernel``'s contract)."""
    bad = ~jnp.all(jnp.isfinite(keys), axis=-1)
    return bad if values is None else bad | ~jnp.all(jnp.isfinite(values), axis=-1)


def zero_rows(x: Array | None, bad: Array) -> Array | None:
    """**Returns:** ``x`` with the rows flagged in ``bad`` (its leading axes) set to zero (a
    flagged row must not reach the other queries of a matmul: ``0 x NaN``)."""
    if x is None:
        return None
    return jnp.where(bad.reshape(bad.shape + (1,) * (x.ndim - bad.ndim)), 0, x)


def picked_mask(
    picks: Int[Array, "batch seq p"], entries: int
) -> Bool[Array, "batch seq {entries}"]:
    """**Arguments:** int32 ``picks [B, S, p]`` (``-1`` picks nothing) and the entry count ``T``.

    **Returns:** bool ``[B, S, T]``, ``mask[b, s, j]`` = entry ``j`` is among ``picks[b, s]``.
    """
    slot = jnp.where(picks >= 0, picks, entries)  # out of range: dropped
    return scatter_rows(slot, jnp.ones(picks.shape, bool), entries, False)
