"""Input checks of the layers' public calls (``__call__``, ``extend``).

Every error names the argument, what was expected and what was given, and is raised before any
compute. Shapes and dtypes are checked at trace time (``TypeError`` / ``ValueError``); values
(segment ids, ``lengths``) are checked right away, in Python, when they are concrete (numpy, a
list, a jax array that is no tracer: also one that a jitted function captures), raising a
``ValueError`` and leaving no check in the program (``checked_now``); traced values are checked
at run time inside ``jit`` through ``eqx.error_if``: ``equinox.EquinoxRuntimeError`` under
``eqx.filter_jit``; under a plain ``jax.jit`` the same message arrives wrapped in an
``INTERNAL: CpuCallback error`` (use ``eqx.filter_jit`` to read it).

Empty inputs (no rows or no tokens) are valid: they get empty outputs of the right shape.
"""

from __future__ import annotations

import contextlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Bool, Int, TypeCheckError

__all__ = [
    "layer_inputs",
    "warn_dtype_mismatch",
    "chunk_inputs",
    "empty_outputs",
    "readable",
    "ShapeCheckError",
    "checked_now",
    "require",
]


class ShapeCheckError(TypeCheckError, ValueError):
    """The type checker's error for a public call's argument of the wrong shape: a
    ``ValueError`` too, as the named check raises it."""


def _hidden_states(x: ArrayLike, hidden_size: int) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"x must be a floating-point array [batch, seq, hidden] (got dtype {x.dtype})"
        )
    if x.ndim != 3 or x.shape[-1] != hidden_size:
        raise ValueError(
            f"x must have shape [batch, seq, {hidden_size}] (hidden = config.hidden_size) "
            f"(got shape {tuple(x.shape)})"
        )
    return x


def _int_array(value: ArrayLike, name: str, shape: tuple[int, ...], axes: str) -> Array:
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array {axes} (got dtype {value.dtype})")
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {axes} = {shape} (got {tuple(value.shape)})")
    return value.astype(jnp.int32)


def checked_now(*values: object) -> contextlib.AbstractContextManager:
    """The context for checks of ``values``' contents: where no array in ``values`` is a
    tracer, the checks run now, in Python (``jax.ensure_compile_time_eval``: even inside a
    ``jit`` trace the arrays computed from them are concrete), so ``require`` raises at once and
    the program holds no check; otherwise a no-op, and ``require`` checks at run time.

    A run-time check is a host callback (``eqx.error_if``) that XLA places on one device
    (``require``); a concrete value needs none.

    **Arguments:** the values (pytrees: arrays, numpy arrays, caches, ``None``) the checks read.

    **Returns:** ``jax.ensure_compile_time_eval()`` or a ``contextlib.nullcontext()``.
    """
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values))
    return contextlib.nullcontext() if traced else jax.ensure_compile_time_eval()


def require(
    value: Array, bad: Bool[Array, " batch"], message: str, given: ArrayLike, label: str = ""
) -> Array:
    """``value``, checked for no ``bad`` row: a ``ValueError`` now (showing ``given``, or its
    first bad row, after ``label``) when ``bad`` is concrete (computed under ``checked_now``
    from concrete values), else an ``eqx.error_if`` at run time. The run-time check guards a
    scalar zero that is added to ``value``: what leaves the callback's device is that scalar,
    not ``value`` (a broadcast XLA makes quietly; a sharded ``value`` through the callback
    would be gathered on one device and sent back, an "involuntary full rematerialization")."""
    if isinstance(bad, jax.core.Tracer):
        return value + eqx.error_if(jnp.zeros((), value.dtype), jnp.any(bad), message)
    bad, given = np.asarray(bad), np.asarray(given)
    if bad.any():
        row = int(np.argmax(bad))
        shown = f"row {row}: {given[row]}" if given.ndim > 1 else str(given)
        raise ValueError(f"{message} (got {label}{shown})")
    return value


def _reused_ids(ids: Int[Array, "batch n"]) -> Bool[Array, " batch"]:
    """Rows where some id comes back after another id (more runs than distinct ids)."""
    spec = tuple(jax.typeof(ids).sharding.spec)
    if len(spec) > 1 and spec[1] is not None:  # split along the sequence: compare on a whole copy
        ids = jax.reshard(ids, P(spec[0], None))
    runs = jnp.sum(ids[:, 1:] != ids[:, :-1], axis=1)
    ordered = jnp.sort(ids, axis=1)
    return runs > jnp.sum(ordered[:, 1:] != ordered[:, :-1], axis=1)


_CONTIGUOUS = "segment_ids must be contiguous runs, one per document (an id may not come back)"


def _segments(seg: Int[Array, "batch seq"], given: ArrayLike) -> Int[Array, "batch seq"]:
    seg = require(seg, jnp.any(seg < 0, axis=1), "segment_ids must be >= 0", given)
    return require(seg, _reused_ids(seg), _CONTIGUOUS, given)


def layer_inputs(
    hidden_size: int,
    x: ArrayLike,
    positions: ArrayLike | None,
    segment_ids: ArrayLike | None,
) -> tuple[Array, Array | None, Array | None]:
    """``(x, positions, segment_ids)`` of a forward call, checked: ``x`` float
    ``[B, S, hidden_size]``, ``positions`` / ``segment_ids`` integer ``[B, S]``, segment ids
    ``>= 0`` in contiguous runs (``[0, 1, 0]`` is rejected)."""
    x = _hidden_states(x, hidden_size)
    rows = tuple(x.shape[:2])
    if positions is not None:
        positions = _int_array(positions, "positions", rows, "[batch, seq]")
    if segment_ids is not None:
        given = segment_ids
        with checked_now(given):
            seg = _int_array(given, "segment_ids", rows, "[batch, seq]")
            segment_ids = _segments(seg, given)
    return x, positions, segment_ids


# (layer class, weight dtype, input dtype) pairs warned about already: once each per process
_WARNED_DTYPES: set[tuple[str, str, str]] = set()


def warn_dtype_mismatch(layer, x: Array) -> None:
    """A ``UserWarning``, once per layer class, when the ``layer``'s weight matrices are
    bfloat16 and its exact numerics (``exact_softmax``) get a float32 ``x``: JAX promotes the
    weights, so the layer computes in float32 (at float32's speed and memory) and returns
    float32. Run at trace time, by ``__call__`` and ``extend`` (DeepSeek's numerics round the
    input themselves).

    **Arguments:** the ``layer`` and its checked input ``x``.

    **Returns:** ``None``.
    """
    # DeepSeek's numerics (the ones without the exact softmax) round to bf16 on purpose
    if x.dtype != jnp.float32 or not layer.execution.numerics.exact_softmax:
        return
    weights = eqx.filter(layer, eqx.is_inexact_array)
    if not any(w.ndim >= 2 and w.dtype == jnp.bfloat16 for w in jax.tree.leaves(weights)):
        return
    name = type(layer).__name__
    if (name, "bfloat16", "float32") in _WARNED_DTYPES:
        return
    _WARNED_DTYPES.add((name, "bfloat16", "float32"))
    warnings.warn(
        f"{name}'s weights are bfloat16 but its input x is float32: the layer computes in "
        "float32 (JAX promotes the weights) and returns float32. Pass "
        "x.astype(jnp.bfloat16) to compute in bfloat16, or build the layer with "
        "dtype=jnp.float32 (warned once per layer class)",
        stacklevel=4,
    )


def chunk_inputs(
    layer, x: ArrayLike, cache, lengths: ArrayLike | None, segment_ids: ArrayLike | None
) -> tuple[Array, Array | None, Array | None]:
    """``(x, lengths, segment_ids)`` of an ``extend`` call, checked against ``layer`` and
    ``cache``: the cache is ``layer``'s kind, ``x`` float ``[B, T, hidden_size]`` with the
    cache's batch, ``lengths`` integer ``[B]`` in ``0..T``, ``segment_ids`` integer ``[B, T]``,
    ``>= 0`` on real tokens, contiguous runs that continue the cache's last document or start
    a new one whose id no key or entry in the cache carries."""
    expected = jax.eval_shape(lambda: layer.init_cache(1, cache.max_length))
    shapes = [[leaf.shape[1:] for leaf in jax.tree.leaves(c)] for c in (expected, cache)]
    if jax.tree.structure(expected) != jax.tree.structure(cache) or shapes[0] != shapes[1]:
        raise TypeError(
            f"cache must come from this layer's init_cache ({type(expected).__name__} for a "
            f"{getattr(layer.config, 'layer_type', 'V3.2')} layer) (got a {type(cache).__name__} "
            "made for another layer)"
        )
    x = _hidden_states(x, layer.config.hidden_size)
    batch, seq = x.shape[:2]
    if batch != cache.length.shape[0]:
        raise ValueError(
            f"x must have the cache's batch size {cache.length.shape[0]} "
            f"(got shape {tuple(x.shape)})"
        )
    if lengths is not None:
        given = lengths
        with checked_now(given):
            lengths = _int_array(given, "lengths", (batch,), "[batch]")
            outside = (lengths < 0) | (lengths > seq)
            lengths = require(lengths, outside, f"lengths must be in 0..{seq} (the chunk)", given)
    if segment_ids is not None:
        given = segment_ids
        with checked_now(given, lengths, cache):
            segment_ids = _chunk_segments(cache, given, lengths, batch, seq)
    return x, lengths, segment_ids


def _chunk_segments(
    cache, given: ArrayLike, lengths: Int[Array, " batch"] | None, batch: int, seq: int
) -> Int[Array, "batch seq"]:
    """``chunk_inputs``' check of ``segment_ids`` (``given``) against ``cache`` and the
    chunk's real tokens (``lengths``, ``None``: all ``seq``)."""
    n = jnp.full((batch,), seq, jnp.int32) if lengths is None else lengths
    seg = _int_array(given, "segment_ids", (batch, seq), "[batch, chunk]")
    valid = jnp.arange(seq) < n[:, None]
    seg = require(seg, jnp.any(valid & (seg < 0), 1), "segment_ids must be >= 0", given)
    # padded tokens repeat the last real id; a non-empty cache's last id comes first
    last = jnp.take_along_axis(seg, jnp.maximum(n - 1, 0)[:, None], axis=1)
    ids = jnp.where(valid, seg, last)
    first = jnp.where(cache.length > 0, cache.segment, ids[:, 0])[:, None]
    previous = jnp.concatenate([first, ids[:, :-1]], axis=1)
    new = jnp.where(valid & (ids != previous), ids, -2)  # -2: matches nothing cached
    seen = jnp.any(new[:, :, None] == cache.held_segments()[:, None, :], axis=(1, 2))
    reused = _reused_ids(jnp.concatenate([first, ids], axis=1)) | seen
    return require(seg, reused, _CONTIGUOUS + " across chunks", given)


def empty_outputs(
    x: Array, topk: int | None, indexer_loss: bool | None, return_aux: bool
) -> Array | tuple[Array, dict]:
    """What a call returns for an empty ``x`` (no rows or no tokens): zeros
    ``[B, S, hidden]``, and with ``return_aux`` ``{"selection": empty [B, S, topk] (None
    without an indexer), "indexer_loss": 0 (None when the loss is off)}`` (no
    ``"indexer_loss"`` key when ``indexer_loss`` is None, as for ``extend``)."""
    b, s, _ = x.shape
    y = jnp.zeros(x.shape, x.dtype)
    if not return_aux:
        return y
    aux = {"selection": None if topk is None else jnp.full((b, s, topk), -1, jnp.int32)}
    if indexer_loss is not None:
        aux["indexer_loss"] = jnp.float32(0) if indexer_loss else None
    return y, aux


def readable(
    error: TypeCheckError,
    hidden_size: int,
    x: ArrayLike,
    positions: ArrayLike | None,
    segment_ids: ArrayLike | None,
    lengths: ArrayLike | None = None,
) -> TypeCheckError:
    """The type checker's ``error`` of a public call, led by the named check's one line when
    that finds what is wrong (``x`` not floating point or not ``[batch, seq, hidden]``, an
    integer argument of another dtype or rank), so the first line names the argument, what it
    must be and what came; the type checker's account follows.

    **Arguments:** the ``TypeCheckError`` and the call's ``hidden_size`` and arguments.

    **Returns:** the error to raise: a ``TypeCheckError`` (a ``TypeError``), a
    ``ShapeCheckError`` (also a ``ValueError``) when the named check finds a wrong shape.
    """
    try:
        x = _hidden_states(x, hidden_size)
        rows = tuple(x.shape[:2])
        for name, value, shape, axes in (
            ("positions", positions, rows, "[batch, seq]"),
            ("segment_ids", segment_ids, rows, "[batch, seq]"),
            ("lengths", lengths, rows[:1], "[batch]"),
        ):
            if value is not None:
                _int_array(value, name, shape, axes)
    except (TypeError, ValueError) as named:
        kind = TypeCheckError if isinstance(named, TypeError) else ShapeCheckError
        return kind(f"{named}\n\n{error}")
    return error
