"""Running a stack of attention layers of any kinds (V4, V3.2, V4.1, mixed) in order, threading
the state they publish from each layer to the next (from ``StackState()``, nothing published;
a layer kind with a state of its own, V4.1's, carries it on), in the forward (``run_stack``)
and chunk by chunk after caches (``extend_stack``); a V4.1 stack's checked wiring and
DeepSeek's stale index keys (``run_v41_stack``, ``extend_v41_stack``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._decode.cache import AbstractCache, V4Cache
from ._layers.forward import StackState
from ._layers.v41 import V41Attention
from ._layers.v41_config import V41WiringError
from ._layers.v41_parts import V41Shared

__all__ = ["run_stack", "extend_stack", "stack_inputs", "run_v41_stack", "extend_v41_stack"]


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


def _check_stack(layers: Sequence[V41Attention], xs) -> list:
    """The layers are ``0..n-1`` of one config; one input per layer (or one for all)."""
    xs = stack_inputs(layers, xs)
    config = layers[0].config
    for i, layer in enumerate(layers):
        if layer.config != config or layer.layer != i:
            raise V41WiringError(
                f"layers[{i}] is layer {layer.layer} of its config; a V4.1 stack needs "
                "layers 0..n-1 of one config in order"
            )
    if len(layers) != config.num_layers:
        raise V41WiringError(f"the config has {config.num_layers} layers, got {len(layers)}")
    return xs


def run_v41_stack(
    layers: Sequence[V41Attention],
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    positions: Int[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    return_aux: bool = False,
    indexer_loss: str | None = None,
):
    """Run the attention layers of a V4.1 stack in order, threading what they publish
    (``csa_eqx.run_stack`` once the wiring is checked).

    **Arguments:** ``layers`` (``V41Attention`` layers ``0..n-1`` of one config, in order) and
    the rest as for ``run_stack``.

    **Returns:** as ``run_stack``: ``(ys, published)`` or ``(ys, published, auxes)``
    (``aux["indexer_loss"]`` is ``None`` but at the index sources with the loss on; the
    stack's indexer loss is the sum of the others).
    """
    xs = _check_stack(layers, xs)
    kw = dict(return_aux=return_aux, indexer_loss=indexer_loss)
    return run_stack(layers, xs, positions, segment_ids, **kw)


def extend_v41_stack(
    layers: Sequence[V41Attention],
    xs: Float[Array, "batch seq hidden"] | Sequence[Float[Array, "batch seq hidden"]],
    caches: Sequence[V4Cache],
    lengths: Int[Array, " batch"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    step=None,
    stale_index_keys: int | None = None,
) -> tuple[list[Array], list[V4Cache], list[V41Shared]] | tuple:
    """``run_v41_stack`` for one chunk after ``caches`` (``csa_eqx.extend_stack``).

    **Arguments:**

    - ``layers`` (as for ``run_v41_stack``), the chunk's inputs ``xs`` (one per layer, or one
        for all), each layer's cache and the chunk's ``lengths`` / ``segment_ids``; ``step``
        as for ``extend_stack``.
    - ``stale_index_keys``: ``None`` (the default: every KV source publishes its keys on
        every call), or, to reproduce DeepSeek's inference code for comparison, the layer whose
        keys DeepSeek's global ``index_k`` last pointed to (``-1`` before the first call).
        DeepSeek republishes a KV source's keys only on calls that close one of its groups;
        on the others its own indexer and the reindex layers after it score the last
        publisher's keys (another layer's, even of another ratio). Needs a batch whose rows
        are at equal positions, without ``lengths`` or ``segment_ids``; runs eagerly.

    **Returns:** ``(ys, caches, published)`` per layer; with ``stale_index_keys``, also the
    layer the pointer points to after the chunk (pass it to the next call).
    """
    xs = _check_stack(layers, xs)
    if stale_index_keys is None:
        return extend_stack(layers, xs, caches, lengths, segment_ids, step=step)
    if lengths is not None or segment_ids is not None:
        raise ValueError("stale_index_keys needs a chunk without lengths or segment_ids")
    config, pointer = layers[0].config, [stale_index_keys]

    def stale(i, x, caches_now, shared):  # DeepSeek's index_k pointer, before layer i
        layer = layers[i]
        if layer.indexer is None:
            return shared
        if layer.compressor is not None and _closes_group(caches_now[i], x.shape[1], layer):
            pointer[0] = i  # DeepSeek's owner publishes (its own, fresh keys)
            return shared
        if pointer[0] == config.kv_source(i) and layer.compressor is None:
            return shared
        if pointer[0] is None or pointer[0] < 0:
            raise V41WiringError(f"layer {i} would read keys nobody published")
        keys = caches_now[pointer[0]].compressor.entries[..., config.head_dim :]
        slots = caches[config.kv_source(i)].compressor.entries.shape[1]
        keys = jnp.pad(keys, [(0, 0), (0, max(slots - keys.shape[1], 0)), (0, 0)])
        return layer._state(shared)._replace(stale_keys=keys[:, :slots])  # the first: StackState()

    ys, new, published = extend_stack(layers, xs, caches, step=step, before=stale)
    return ys, new, published, pointer[0]


def _closes_group(cache: V4Cache, seq: int, layer: V41Attention) -> bool:
    """Whether a chunk of ``seq`` tokens after ``cache`` closes one of ``layer``'s groups (on
    the host: the stale-key emulation decides in Python, as DeepSeek does)."""
    position = int(np.asarray(cache.position)[0])
    m = layer.entry_rate
    return (position + seq) // m > position // m
