"""Running a stack of attention layers of any kinds (V4, V3.2, V4.1, mixed) in order, threading
the state they publish from each layer to the next (from ``StackState()``, nothing published;
a layer kind with a state of its own, V4.1's, carries it on)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxtyping import Array, Float, Int

from .cache import AbstractCache
from .forward import StackState

__all__ = ["run_stack", "extend_stack", "stack_inputs"]


def stack_inputs(layers: Sequence, xs) -> list:
    """**Arguments:** the ``layers`` and ``xs``: one input per layer, or one for all.

    **Returns:** one input per layer (``ValueError`` for no layers or a count that differs)."""
    if not layers:
        raise ValueError("a stack needs at least one layer")
    xs = [xs] * len(layers) if not isinstance(xs, list | tuple) else list(xs)
    if len(xs) != len(layers):
        raise ValueError(f"xs has {len(xs)} inputs for {len(layers)} layers")
    return xs


def run_stack(
    layers: Sequence,
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    positions: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    return_aux: bool = False,
    indexer_loss: str | None = None,
) -> tuple[list[Array], list] | tuple[list[Array], list, list[dict]]:
    """Run attention layers in order, each from what the earlier ones published.

    **Arguments:**

    - ``layers``: the layers (any ``AbstractIndexedAttention``; V4 and V3.2 layers publish
        nothing and pass the state on).
    - ``xs``: one input ``[B, S, hidden]`` for every layer (an attention-only stack feeds each
        layer its own input), or a single one fed to all.
    - ``positions``, ``segment_ids``, ``indexer_loss``: as for the layers' ``__call__``.
    - ``return_aux``: also return each layer's aux dict.

    **Returns:** ``(ys, published)``: each layer's output and the stack state after it; with
    ``return_aux``, ``(ys, published, auxes)``.
    """
    ys, after, auxes, shared = [], [], [], StackState()
    for layer, x in zip(layers, stack_inputs(layers, xs), strict=True):
        y, shared, *aux = layer(
            x, positions, segment_ids, return_aux, indexer_loss=indexer_loss, shared=shared
        )
        ys.append(y)
        after.append(shared)
        auxes.extend(aux)
    return (ys, after, auxes) if return_aux else (ys, after)


def extend_stack(
    layers: Sequence,
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    caches: Sequence[AbstractCache],
    lengths: Int[Array, " batch"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    step: Callable | None = None,
    before: Callable | None = None,
) -> tuple[list[Array], list[AbstractCache], list]:
    """``run_stack`` for one chunk after ``caches`` (each layer's ``extend``).

    **Arguments:**

    - ``layers``, ``xs``: as for ``run_stack``; ``caches``: each layer's cache; ``lengths``,
        ``segment_ids``: the chunk's, as for ``extend``.
    - ``step``: ``step(layer, x, cache, lengths, segment_ids, shared=...) -> (y, cache,
        shared)`` (default the layer's ``extend``; e.g. an ``eqx.filter_jit`` of it).
    - ``before``: ``before(i, x, caches, shared) -> shared``, run before layer ``i`` on the
        caches so far (``None``: nothing).

    **Returns:** ``(ys, caches, published)`` per layer.
    """
    xs = stack_inputs(layers, xs)
    if len(caches) != len(layers):
        raise ValueError(f"{len(caches)} caches for {len(layers)} layers")
    step = _extend if step is None else step
    ys, new, after, shared = [], list(caches), [], StackState()
    for i, (layer, x) in enumerate(zip(layers, xs, strict=True)):
        shared = shared if before is None else before(i, x, new, shared)
        y, new[i], shared = step(layer, x, new[i], lengths, segment_ids, shared=shared)
        ys.append(y)
        after.append(shared)
    return ys, new, after


def _extend(layer, *args, **kwargs):
    return layer.extend(*args, **kwargs)
