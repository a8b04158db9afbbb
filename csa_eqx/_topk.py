"""Exact top-k with a ``-1`` sentinel (docs/concepts.md, "Top-k selection").

Ties go to the lower index everywhere. ReLU-based scores produce both ``-0.0`` and ``+0.0``,
which must tie, so scores are canonicalised (all zeros made ``+0.0``) before they are ranked.
Selections list their picks in increasing index order (a set; the attention does not care
about order), which lets an exact radix select replace a sort (``exact_topk``). On a TPU, where
the radix select's compaction (a gather per halving) is slow, the same selection comes from
``lax.top_k`` on order-preserving integer keys and a sort of the ``k`` picks by index
(``method="top_k"``, ``TileSizes.select``; docs/kernels.md, "The XLA path on a TPU").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._ops import varying_like

__all__ = [
    "METHODS",
    "canonical_scores",
    "exact_topk",
    "merge_topk",
    "select_topk",
    "signed_keys",
]

METHODS = ("radix", "top_k")  # exact_topk's ways to one selection (TileSizes.select)
_INT_MIN = jnp.iinfo(jnp.int32).min  # the key of an invalid entry (below every value's)
_INT_MAX = jnp.iinfo(jnp.int32).max


def canonical_scores(scores: Array) -> Array:
    """Map ``-0.0`` to ``+0.0`` so that equal scores tie (XLA sorts by total order). XLA
    flushes subnormals to zero, so they become ``+0.0`` here too.

    **Arguments:** float ``scores`` of any shape.

    **Returns:** the same shape and dtype, without ``-0.0``.
    """
    return jnp.where(scores == 0, jnp.zeros_like(scores), scores)


def _order_keys(values: Array) -> Array:
    """``uint32`` keys in the order of the float32 ``values`` (``-0.0`` and ``+0.0`` equal)."""
    bits = jax.lax.bitcast_convert_type(canonical_scores(values.astype(jnp.float32)), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def signed_keys(values: Array) -> Array:
    """``int32`` keys in the order of the float32 ``values`` (``-0.0`` and ``+0.0`` equal):
    ``_order_keys`` with its top bit flipped, from signed integer operations only (the Mosaic
    kernel forms them too). The map is its own inverse on the bits (``_key_values``).

    **Arguments:** float ``values`` of any shape.

    **Returns:** int32 keys of the same shape, above ``INT32_MIN`` but for one NaN bit pattern.
    """
    word = jax.lax.bitcast_convert_type(canonical_scores(values.astype(jnp.float32)), jnp.int32)
    return jnp.where(word < 0, word ^ 0x7FFFFFFF, word)


def _key_values(keys: Array) -> Array:
    """The float32 values of ``signed_keys`` (zeros as ``+0.0``)."""
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ 0x7FFFFFFF, keys), jnp.float32)


def _by_index(keys: Array, index: Array, k: int) -> tuple[Array, Array]:
    """``(values, index)`` of the picks among ``keys`` / ``index`` (a pick: a key above
    ``INT32_MIN``), sorted by index and padded to ``k`` with ``(-inf, -1)``: one sort of the
    picks, no gather."""
    index = jnp.where(keys > _INT_MIN, index, _INT_MAX)
    index, keys = jax.lax.sort((index, keys), dimension=-1, num_keys=1)
    pad = [(0, 0)] * (keys.ndim - 1) + [(0, k - keys.shape[-1])]
    index = jnp.pad(index, pad, constant_values=_INT_MAX)
    keys = jnp.pad(keys, pad, constant_values=_INT_MIN)
    picked = index < _INT_MAX
    return jnp.where(picked, _key_values(keys), -jnp.inf), jnp.where(picked, index, -1)


def _top_k_select(values: Array, valid: Array, k: int) -> tuple[Array, Array]:
    """``exact_topk`` by ``lax.top_k`` (exact; equal keys: the lower position first) on the
    ``signed_keys`` of the valid values, then the picks sorted by position."""
    want = min(k, values.shape[-1])
    keys = jnp.where(valid, signed_keys(values), _INT_MIN)
    top, pos = jax.lax.top_k(keys, want)
    return _by_index(top, pos, k)


def _compact(count: Int[Array, "*rows n"], k: int, unroll: bool) -> Int[Array, "*rows {k}"]:
    """The positions of the picks in increasing order, ``-1`` past the last: pick ``j`` is the
    first position where the running pick ``count`` reaches ``j + 1``, found by a binary search
    per pick (``[*rows, k]`` gathers). A scatter of every position to its slot would need
    ``[*rows, n]`` index tuples, 12 bytes per element, the largest buffers of a selection."""
    n = count.shape[-1]
    target = jnp.arange(1, k + 1, dtype=jnp.int32)
    # typed as the input varies (inside a shard_map with check_vma, the body makes it vary)
    lo = varying_like(jnp.zeros((*count.shape[:-1], k), jnp.int32), count)

    def halve(_, bounds):  # invariant: the answer is in [lo, hi]; hi = n means none
        lo, hi = bounds
        mid = (lo + hi) // 2
        short = jnp.take_along_axis(count, jnp.minimum(mid, n - 1), axis=-1) < target
        return jnp.where(short, mid + 1, lo), jnp.where(short, hi, mid)

    steps = max(n, 1).bit_length()
    pos = jax.lax.fori_loop(0, steps, halve, (lo, jnp.full_like(lo, n)), unroll=unroll)[0]
    return jnp.where(pos < n, pos, -1)


def exact_topk(
    values: Float[Array, "*rows n"],
    valid: Bool[Array, "*rows n"],
    k: int,
    *,
    unroll: bool = False,
    method: str = "radix",
) -> tuple[Float[Array, "*rows {k}"], Int[Array, "*rows {k}"]]:
    """The ``k`` largest valid values of each row and their positions, in increasing position
    order (the set a full sort would pick, ties to the lower position); ``(-inf, -1)`` fill
    the rest.

    A radix select, not a sort: 32 halving steps find each row's k-th largest value (as an
    order-preserving ``uint32`` key) by counting, then the picks are compacted by a binary
    search per pick over their running count. On
    CPU this is ~4x faster than ``lax.top_k`` at indexer sizes (k = 512 of 1024), and the
    cost does not grow with ``k`` (docs/concepts.md, "Top-k selection").

    ``method="top_k"`` gives the same selection by ``lax.top_k`` on the ``signed_keys`` and a
    sort of the ``k`` picks by position: no gather (a TPU's; the values come from the keys, so
    a ``-0.0`` comes back as ``+0.0``).

    **Arguments:** float ``values [*rows, n]``, bool ``valid [*rows, n]``, ``k > 0``,
    ``unroll``: unroll the 32 steps (faster on accelerators, where each loop iteration costs a
    predicate round trip; on CPU unrolling only slows compiles, ~1.5 s per layer), and
    ``method``: ``"radix"`` or ``"top_k"`` (``METHODS``). The strategies take both from
    ``TileSizes`` (``unroll``, ``select``), chosen for the backend in ``_backend.py``.

    **Returns:** ``(top values, positions)``, float32 and int32 ``[*rows, k]``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (got {method!r})")
    if method == "top_k":
        return _top_k_select(values, valid, k)
    want = min(k, values.shape[-1])
    key = jnp.where(valid, _order_keys(values), jnp.uint32(0))  # valid keys are > 0

    def halve(_, bounds):  # invariant: at least `want` keys >= lo; none >= hi + 1 would do
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        enough = jnp.sum(key >= mid[..., None], axis=-1, dtype=jnp.int32) >= want
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo = varying_like(jnp.zeros(key.shape[:-1], jnp.uint32), key)
    kth, _ = jax.lax.fori_loop(0, 32, halve, (lo, jnp.full_like(lo, 0xFFFFFFFF)), unroll=unroll)
    above, tied = key > kth[..., None], key == kth[..., None]
    room = want - jnp.sum(above, axis=-1, dtype=jnp.int32)
    pick = valid & (above | (tied & (jnp.cumsum(tied, -1, dtype=jnp.int32) <= room[..., None])))
    pos = _compact(jnp.cumsum(pick, -1, dtype=jnp.int32), k, unroll)
    picked = jnp.take_along_axis(values.astype(jnp.float32), jnp.maximum(pos, 0), axis=-1)
    return jnp.where(pos >= 0, picked, -jnp.inf), pos


def merge_topk(
    running: tuple[Array, Array], new: tuple[Array, Array], k: int, *, unroll=False, method="radix"
) -> tuple[Array, Array]:
    """The top-k of two candidate lists ``(values, index) [*rows, n]`` (``-1`` = no candidate)
    whose valid indices increase along the running list, then along the new one: ties keep the
    lower index, and the merged indices increase.

    **Arguments:** the ``running`` and the ``new`` list, ``k``, ``unroll`` and ``method`` (as
    ``exact_topk``'s; ``"top_k"`` merges by one sort of the candidates' keys with their
    indices, no gather).

    **Returns:** ``(values, index) [*rows, k]``, ``(-inf, -1)`` past the last.
    """
    index = jnp.concatenate([running[1], new[1]], axis=-1)
    values = jnp.concatenate([running[0], new[0]], axis=-1)
    if method == "top_k":
        keys = jnp.where(index >= 0, signed_keys(values), _INT_MIN)
        # best key first (~ reverses the int32 order), equal keys by index
        order, index = jax.lax.sort((~keys, index), dimension=-1, num_keys=2)
        return _by_index(~order[..., :k], index[..., :k], k)
    val, pos = exact_topk(values, index >= 0, k, unroll=unroll, method=method)
    picked = jnp.take_along_axis(index, jnp.maximum(pos, 0), axis=-1)
    return val, jnp.where(pos >= 0, picked, -1)


def select_topk(
    scores: Float[Array, "batch seq entries"],
    visible: Bool[Array, "batch seq entries"],
    k: int,
    *,
    unroll: bool = False,
    method: str = "radix",
) -> Int[Array, "batch seq {k}"]:
    """Indices of the ``k`` best visible entries per query, in increasing index order
    (docs/concepts.md, "Top-k selection").

    Exact: the set a full sort would pick, ties to the lower index (see ``exact_topk``).

    **Arguments:**

    - ``scores``: float ``[B, S, T]`` (``-0.0`` ties ``+0.0``).
    - ``visible``: bool ``[B, S, T]``; invisible entries are never picked.
    - ``k``: picks per query (> 0).
    - ``unroll``: unroll the radix select's steps (``exact_topk``; same result).
    - ``method``: ``"radix"`` or ``"top_k"`` (``exact_topk``; same result).

    **Returns:**

    int32 ``[B, S, k]``: picks beyond the visible count are ``-1`` (at the end); when ``k``
    exceeds ``T`` the result is padded with ``-1`` so its shape is always ``[..., k]``.
    """
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    return exact_topk(scores, visible, k, unroll=unroll, method=method)[1]
