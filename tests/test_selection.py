"""``select_topk`` / ``exact_topk`` against a numpy brute force (a stable full sort)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csa_eqx import select_topk
from csa_eqx._topk import exact_topk


def brute_force(scores: np.ndarray, visible: np.ndarray, k: int) -> np.ndarray:
    """Per row: sort visible entries by (score descending, index ascending), keep k, list
    them in increasing index order, pad with -1."""
    out = np.full(scores.shape[:-1] + (k,), -1)
    for row in np.ndindex(scores.shape[:-1]):
        idx = np.flatnonzero(visible[row])
        s = scores[row][idx] + 0.0  # -0.0 -> +0.0
        best = np.sort(idx[np.lexsort((idx, -s))][:k])
        out[row][: len(best)] = best
    return out


@functools.partial(jax.jit, static_argnames="k")
def both_topks(scores, visible, k):
    """``select_topk`` and ``exact_topk`` in one program: one compile per drawn shape and k."""
    return select_topk(scores, visible, k), exact_topk(scores, visible, k=k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 40)),
    k=st.integers(1, 45),
    kind=st.sampled_from(["float", "ties", "signed_zeros", "extremes"]),
    density=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_topk_equals_a_stable_full_sort(shape, k, kind, density, seed):
    rng = np.random.default_rng(seed)
    if kind == "float":
        scores = rng.normal(size=shape)
    elif kind == "ties":
        scores = rng.integers(-2, 3, shape) / 2.0
    elif kind == "signed_zeros":
        scores = np.where(rng.random(shape) < 0.5, -0.0, 0.0) * (rng.random(shape) < 0.8)
        scores = np.where(rng.random(shape) < 0.2, rng.normal(size=shape), scores)
    else:
        pick = rng.integers(0, 5, shape)
        # (not subnormals: XLA flushes them to zero, so they tie with 0 there)
        scores = np.choose(pick, [-np.inf, -3e38, -1e-37, 1e-37, 3e38])
    scores = scores.astype(np.float32)
    visible = rng.random(shape) < density if density < 1 else np.ones(shape, bool)
    got, (values, pos) = both_topks(jnp.asarray(scores), jnp.asarray(visible), k=k)
    np.testing.assert_array_equal(np.asarray(got), brute_force(scores, visible, k))
    pos = np.asarray(pos)
    want = np.where(pos >= 0, np.take_along_axis(scores, np.maximum(pos, 0), -1), -np.inf)
    np.testing.assert_array_equal(np.asarray(values), want)
