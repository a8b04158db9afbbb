"""How the attention reads each query's sliding window of raw tokens (V4): the window
strategies describe the reads (``csa_eqx.Reads``), in the forward over the sequence's own rows
and in ``extend`` over ``[ring ; chunk]`` rows."""

from __future__ import annotations

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .reads import BandRows, GatheredRows, Reads

__all__ = ["AbstractWindow", "BandWindow", "GatheredWindow"]


class AbstractWindow(eqx.Module):
    """How the attention reads each query's sliding window of raw tokens: the forward over
    the sequence's own rows, ``extend`` over ``[ring ; chunk]`` rows (the ``window - 1``
    cached tokens before the chunk, then the chunk's own)."""

    @abc.abstractmethod
    def reads(
        self,
        keys: Float[Array, "batch rows dim"],
        query_index: Int[Array, "batch seq"],
        segment: Int[Array, "batch seq"],
        window: int,
        history: Int[Array, "batch ring"] | None = None,
    ) -> Reads:
        """**Arguments:** the token rows' ``keys`` (the ``history`` rows first, when there is
        one, then the queries' own), the queries' own row indices and segments, the window
        length and the segments of the ``window - 1`` earlier tokens stored before the
        queries' rows (``extend``'s ring, ``-1`` = empty; ``None``: nothing precedes them).

        **Returns:** the ``Reads`` of the window (a band or gathered rows).
        """


class BandWindow(AbstractWindow):
    """One banded matmul per query block over a slab of ``block + window - 1`` token rows
    (for a single decoded token: its ``window`` rows, what a gather reads). **Arguments:** none."""

    def reads(self, keys, query_index, segment, window, history=None):
        return Reads(band=BandRows(keys, segment, window, history))


class GatheredWindow(AbstractWindow):
    """Gather each query's ``window`` token rows (``t - window < j <= t``, same segment).
    **Arguments:** none."""

    def reads(self, keys, query_index, segment, window, history=None):
        b, s = query_index.shape
        before = 0 if history is None else history.shape[1]
        rows = segment if history is None else jnp.concatenate([history, segment], axis=1)
        idx = before + query_index[..., None] - jnp.arange(window, dtype=jnp.int32)
        flat = jnp.clip(idx, 0, before + s - 1).reshape(b, -1)
        key_segment = jnp.take_along_axis(rows, flat, axis=1).reshape(idx.shape)
        keep = (idx >= 0) & (key_segment == segment[..., None])
        return Reads(gathered=(GatheredRows(keys, jnp.where(keep, idx, -1)),))
