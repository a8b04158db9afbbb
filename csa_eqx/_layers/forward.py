"""What a layer's pipeline returns (``Forward``) and the state a stack's layers pass on to the
later ones: a layer kind that reads and publishes some has a stack state of its own (a
``NamedTuple`` of optional fields, e.g. V4.1's; ``per_row`` names the fields
with a row per query), a stack starts from ``StackState()`` (nothing published), and the state
crosses a placement as its carried state (``carried`` / ``published``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxtyping import Array, Float, Int

from .._loss.base import AttentionTarget
from .._placement.base import Carried

__all__ = ["Forward", "StackState", "carried", "published"]


class StackState(NamedTuple):
    """What the layers of a stack published before its first layer: nothing. A layer kind
    without a state of its own passes any state on as it came; one with a state
    (``AbstractIndexedAttention.stack_state``) starts its own from this one."""

    per_row = ()  # the fields with a row per query: none


class Forward(NamedTuple):
    """What a layer's pipeline (``AbstractIndexedAttention.forward_rows``) returns.

    **Arguments:**

    - ``y``: the outputs ``[B', L, hidden]``.
    - ``selection``: what the attention read through, int32 ``[B', L, k]`` (``None``: no
        selection).
    - ``problem``: the indexer's ``SelectionProblem`` (``None`` without an indexer of its own).
    - ``target``: the ``AttentionTarget`` of the indexer loss (``None`` unless asked for).
    - ``source``: the source of the keys after the reads (``source.cache_after()``:
        ``extend``'s new cache).
    - ``published``: the stack state's fields the layer publishes, by name (empty: none).
    """

    y: Float[Array, "batch rows hidden"]
    selection: Int[Array, "batch rows k"] | None
    problem: Any
    target: AttentionTarget | None
    source: Any
    published: dict


def carried(fields: dict, per_row: tuple[str, ...]) -> Carried:
    """A stack state's ``fields`` (by name) as a placement carries them: those named in
    ``per_row`` with a row per query, the others whole-sequence (their entry slots on axis 1)."""
    rows = {k: v for k, v in fields.items() if k in per_row}
    return Carried(rows, {k: v for k, v in fields.items() if k not in per_row})


def published(state: Any, out: Carried) -> Any:
    """**Arguments:** the state a layer got and what it published (as a placement returns it).

    **Returns:** the state after the layer."""
    fields = {**out.per_row, **out.whole}
    return state._replace(**fields) if fields else state
