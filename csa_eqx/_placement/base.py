"""Where a layer's forward runs: the placement family (docs/scaling.md).

A placement runs ``body(layer, x, rows, carried)`` -- a forward over ``Rows``, returning
``(y, selection or None, sums, carried)`` with ``sums`` a tuple of float32 scalars over its own
rows and ``carried`` the state the layer passes on (``Carried``: V4.1's published entries and
selections; empty for V4 and V3.2) -- and returns the same as one device would: ``y``,
``selection`` and ``carried.per_row`` ``[B, S, ...]``, ``carried.whole`` ``[B, ...]`` and the
``sums`` summed over every device that computed a share. ``SingleDevice`` calls the body;
``HeadParallel`` (_heads.py) splits the attention heads over a mesh axis and
``ContextParallel`` (_context.py) the sequence, wrapping another placement (``inner``) that
runs inside its ``shard_map``: context around heads composes by wrapping.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
from jaxtyping import Array, Float

from .._mesh import in_manual_context
from .._rows import Rows

__all__ = ["AbstractPlacement", "SingleDevice", "Body", "Carried", "Hidden", "untagged"]

Body = Callable[..., tuple]
Hidden = Float[Array, "batch seq hidden"]  # a placement's x


class Carried(NamedTuple):
    """State a body takes besides ``x`` and returns besides ``y``, by how a placement lays it
    out (e.g. what a V4.1 layer publishes to the later layers of its stack).

    **Arguments:**

    - ``per_row``: a pytree of ``[B, S, ...]`` arrays, one row per token row (e.g. a
        selection): split, chunked and joined along the sequence as ``x`` and ``y`` are.
    - ``whole``: a pytree of ``[B, T, ...]`` arrays of the whole sequence's entry slots (e.g.
        compressed entries and their layout): split over the batch only, every shard of a row
        holds all of it. A body returns them equal on every device that shares the row
        (computed from the same inputs, or all-gathered), over the slots of the ``Rows`` it
        got; the placement returns them over the sequence's own slots (``rows.layout``'s).
    """

    per_row: Any = ()
    whole: Any = ()


class AbstractPlacement(eqx.Module):
    """Where a layer's forward runs. One method, ``run``; ``rows_inputs`` lets a placement
    see the integer inputs whole before the rows are made."""

    @abc.abstractmethod
    def run(self, body: Body, layer: eqx.Module, x: Hidden, rows: Rows, carried: Carried) -> tuple:
        """**Arguments:** the ``body(layer, x, rows, carried)``, the layer (its arrays are what
        a placement splits: ``layer.head_specs``), the hidden states ``x [B, S, hidden]``, the
        whole sequence's ``Rows`` and the state the body takes (a ``Carried``; ``Carried()``:
        none).

        **Returns:** ``(y, selection or None, sums, carried)`` as ``body`` returns them on one
        device, the ``sums`` summed over the devices.
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

    def run(self, body: Body, layer: eqx.Module, x: Hidden, rows: Rows, carried: Carried) -> tuple:
        return body(layer, x, rows, carried)


def untagged(layer: eqx.Module) -> eqx.Module:
    """``layer`` as a placement's ``shard_map`` runs it: inside a caller's ``shard_map``
    (``in_manual_context``) with its selection left unnamed (``save_selection=False``;
    ``csa_eqx._mesh.run_sharded`` recomputes the body in the backward there), elsewhere as it
    is. A remat policy around it that saved the named selection inside would make it a
    residual of the placement's ``shard_map``, which JAX types with the caller's manual axes
    too and cannot lower; the body recomputes the selection instead."""
    ex = layer.execution
    if not ex.save_selection or not in_manual_context():
        return layer
    return layer.with_execution(dataclasses.replace(ex, save_selection=False))
