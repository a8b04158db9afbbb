"""Where a layer's forward runs: the placement family (docs/scaling.md).

A placement runs ``body(layer, x, rows)`` -- a forward over ``Rows``, returning ``(y,
selection or None, sums)`` with ``sums`` a tuple of float32 scalars over its own rows -- and
returns ``(y, selection, sums)`` as one device would: ``y`` and ``selection`` ``[B, S, ...]``
and the ``sums`` summed over every device that computed a share. ``SingleDevice`` calls the
body; ``HeadParallel`` (_heads.py) splits the attention heads over a mesh axis and
``ContextParallel`` (_context.py) the sequence, wrapping another placement (``inner``) that
runs inside its ``shard_map``: context around heads composes by wrapping.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import equinox as eqx
from jaxtyping import Array

from ._rows import Rows

__all__ = ["AbstractPlacement", "SingleDevice", "Body"]

Body = Callable[..., tuple]


class AbstractPlacement(eqx.Module):
    """Where a layer's forward runs. One method, ``run``; ``rows_inputs`` lets a placement
    see the integer inputs whole before the rows are made."""

    @abc.abstractmethod
    def run(self, body: Body, layer: eqx.Module, x: Array, rows: Rows) -> tuple:
        """**Arguments:** the ``body(layer, x, rows)``, the layer (its arrays are what a
        placement splits: ``layer.head_specs``), the hidden states ``x [B, S, hidden]`` and
        the whole sequence's ``Rows``.

        **Returns:** ``(y, selection or None, sums)`` as ``body`` returns them on one device, the
        ``sums`` summed over the devices.
        """

    def rows_inputs(self, x: Array, positions: Array | None, segment_ids: Array | None):
        """**Arguments:** ``x [B, S, hidden]`` and the call's ``positions`` / ``segment_ids``.

        **Returns:** ``(like, positions, segment_ids)``: a ``[B, S, ...]`` array laid out as the
        integer rows should be, and the inputs as the rows are built from them (here
        unchanged)."""
        return x, positions, segment_ids


class SingleDevice(AbstractPlacement):
    """The forward as written: one call of the body (the compiler may still shard it, e.g.
    the batch over a data axis of the mesh). **Arguments:** none."""

    def run(self, body: Body, layer: eqx.Module, x: Array, rows: Rows) -> tuple:
        return body(layer, x, rows)
