"""What a layer's pipeline returns (``Forward``) and the state layers pass on to the later layers
of a stack (``V41Shared``, docs/v41.md, "The sharing schedule"), with how that state crosses a
placement (``carried`` / ``published``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxtyping import Array, Float, Int

from .._layout import EntryLayout
from .._loss.base import AttentionTarget
from .._placement.base import Carried

__all__ = ["Forward", "V41Shared", "carried", "published"]


class V41Shared(NamedTuple):
    """What the layers of a V4.1 stack publish to the later ones (docs/v41.md, "The sharing
    schedule"). A field is ``None`` until a layer publishes it. Every layer takes it
    (``layer(x, ..., shared=...)``, ``layer.extend(..., shared=...)``) and returns it with what
    it published; V4 and V3.2 layers publish nothing.

    **Arguments:**

    - ``entries``: the latest KV source's compressed entries (roped at each group's first
        position), ``[B, T, head_dim]``.
    - ``keys``: its index keys ``[B, T, index_head_dim]`` (roped likewise).
    - ``layout``: their slots' ``EntryLayout`` (``[B, T]``).
    - ``selection``: the latest index source's top-k, int32 ``[B, S, index_topk]`` entry slots
        in increasing order, ``-1`` = none.
    - ``candidates``: the candidate source's pre-filter, int32 ``[B, S, Nb]``: the ids of the
        kept blocks of ``bc`` entry slots, in increasing order, ``-1`` past the last
        (``csa_eqx.candidate_blocks``; docs/v41.md, "Memory").
    - ``stale_keys``: ``None``, or the keys the next index source scores instead of
        ``keys`` (only ``extend_v41_stack(..., stale_index_keys=True)`` sets it, to emulate
        DeepSeek's stale-key defect).
    """

    entries: Float[Array, "batch slots dim"] | None = None
    keys: Float[Array, "batch slots index_dim"] | None = None
    layout: EntryLayout | None = None
    selection: Int[Array, "batch seq k"] | None = None
    candidates: Int[Array, "batch seq blocks"] | None = None
    stale_keys: Float[Array, "batch slots index_dim"] | None = None


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
    - ``published``: the ``V41Shared`` fields the layer publishes, by name (empty: none).
    """

    y: Float[Array, "batch rows hidden"]
    selection: Int[Array, "batch rows k"] | None
    problem: Any
    target: AttentionTarget | None
    source: Any
    published: dict


_PER_ROW = ("selection", "candidates")  # V41Shared's fields with a row per query


def carried(fields: dict) -> Carried:
    """``V41Shared`` fields (by name) as a placement carries them: the selection and the
    candidates per query row, the entries, keys and layout whole-sequence (their entry slots
    on axis 1)."""
    per_row = {k: v for k, v in fields.items() if k in _PER_ROW}
    return Carried(per_row, {k: v for k, v in fields.items() if k not in _PER_ROW})


def published(shared: V41Shared, state: Carried) -> V41Shared:
    """**Arguments:** the state a layer got and what it published (as a placement returns it).

    **Returns:** the state after the layer."""
    fields = {**state.per_row, **state.whole}
    return shared._replace(**fields) if fields else shared
