"""Dense and streaming indexer top-k against a numpy brute force, on random inputs and tilings
(every selection strategy on fixed cases: tests/test_conformance_selection.py).

The reference is independent of the library's top-k: float64 scores from the definition
``Σ_h w·d^-1/2·ReLU(q·k)``, the visibility rule written out, and a stable sort by
``(-score, index)`` over each row's visible entries (ties to the lower index, ``-0.0`` equal to
``+0.0``), keeping the ``k`` first as a sorted set padded with ``-1``. Inputs are small
integers (``d = 4``, so ``d^-1/2 = 0.5``): every score is exact in float32, and exact ties,
including ``+0.0`` / ``-0.0`` from negative weights, are frequent. Tiny key blocks and row
buffers (``topk_block``) make the streaming path merge several buffers per row.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from csa_eqx import EntryLayout

B, S, H, D, T = 2, 12, 2, 4, 16

# (k, key_block, query_block, topk_block); 0 = automatic. A few fixed combinations, so the
# random examples reuse a handful of compiled functions.
STREAM_TILES = [
    (3, 1, 1, 1),  # a merge after every entry
    (3, 2, 5, 4),  # buffers of two key tiles, ragged query blocks
    (5, 3, 4, 3),
    (1, 5, 12, 5),
    (7, 4, 3, 8),
    (20, 3, 5, 6),  # k > T: every row has fewer visible entries than k
    (16, 16, 12, 0),  # k = T, one buffer
]


def selection(path: str, q, w, keys, qi, qs, layout, k, tiles=(0, 0, 0)):
    """The library's selection on one execution path (the one place that knows the names)."""
    import csa_eqx as ce

    kb, qb, tb = tiles
    streaming = ce.StreamingSelection(key_block=kb, query_block=qb, topk_block=tb)
    strategy = {"dense": ce.DenseSelection(), "stream": streaming}[path]
    problem = ce.SelectionProblem.from_queries(q, w, keys, ce.Visibility(qi, qs, layout))
    return strategy.select(problem, k)


run = jax.jit(selection, static_argnames=("path", "k", "tiles"))


def brute_force(q, w, keys, qi, qs, end, seg, k) -> np.ndarray:
    """Numpy reference (see the module docstring): int32 [B, S, k]."""
    q, w, keys = (np.asarray(a, np.float64) for a in (q, w, keys))
    dots = np.einsum("bshd,btd->bsht", q, keys)
    scores = np.einsum("bsh,bsht->bst", w, np.maximum(dots, 0.0)) * q.shape[-1] ** -0.5
    visible = (end[:, None, :] >= 0) & (end[:, None, :] <= qi[:, :, None])
    visible &= seg[:, None, :] == qs[:, :, None]
    b, s, _ = scores.shape
    out = np.full((b, s, k), -1, np.int32)
    for bi in range(b):
        for si in range(s):
            idx = np.nonzero(visible[bi, si])[0]
            ranked = sorted(idx, key=lambda j: (-scores[bi, si, j], j))
            picks = sorted(ranked[:k])
            out[bi, si, : len(picks)] = picks
    return out


def layout_of(end: np.ndarray, qs: np.ndarray) -> EntryLayout:
    """Entry layout whose valid entries (``end >= 0``) belong to the segment of the token
    that closes them."""
    seg = np.where(end >= 0, np.take_along_axis(qs, np.maximum(end, 0), axis=1), -1)
    return EntryLayout(jnp.asarray(end), jnp.asarray(seg, jnp.int32), jnp.asarray(end >= 0))


def check(path, case, k, tiles=(0, 0, 0)):
    q, w, keys, qi, qs, end = case
    layout = layout_of(end, qs)
    got = run(path, *(jnp.asarray(a, jnp.float32) for a in (q, w, keys)), qi, qs, layout, k, tiles)
    want = brute_force(q, w, keys, qi, qs, end, np.asarray(layout.segment), k)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{path} k={k} tiles={tiles}")


def fixed_case(seed: int):
    """Integer inputs with many ties, three segments, every other entry slot empty."""
    r = np.random.default_rng(seed)
    q = r.integers(-1, 2, (B, S, H, D))
    w = r.integers(-2, 3, (B, S, H))
    keys = r.integers(-1, 2, (B, T, D))
    qi = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    qs = np.zeros((B, S), np.int32)
    qs[:, 5:] += 1
    qs[:, 9:] += 1
    end = np.sort(r.integers(0, S, (B, T)), axis=1)
    end[:, 1::2] = -1
    return q, w, keys, qi, qs, end.astype(np.int32)


SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@st.composite
def random_case(draw):
    """Fixed shapes, random integer inputs, segments and entry layout."""

    def ints(lo, hi, shape):
        return draw(hnp.arrays(np.int64, shape, elements=st.integers(lo, hi)))

    q, w, keys = ints(-1, 1, (B, S, H, D)), ints(-2, 2, (B, S, H)), ints(-1, 1, (B, T, D))
    qs = np.cumsum(ints(0, 1, (B, S)) * (ints(0, 3, (B, S)) == 0), axis=1).astype(np.int32)
    end = np.sort(ints(0, S - 1, (B, T)), axis=1)
    end = np.where(ints(0, 4, (B, T)) == 0, -1, end).astype(np.int32)  # ~1/5 slots empty
    qi = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    tiles = draw(st.sampled_from(STREAM_TILES))
    return (q, w, keys, qi, qs, end), tiles


@SETTINGS
@given(random_case())
def test_random_examples(drawn):
    case, (k, *tiles) = drawn
    check("stream", case, k, tuple(tiles))
    if k == STREAM_TILES[0][0]:
        check("dense", case, k)


@st.composite
def raw_scores(draw):
    """Scores from a few values with ``-0.0`` next to ``+0.0``, and a random visibility."""
    values = st.sampled_from([-1.0, -0.0, 0.0, 0.5, 1.0])
    scores = draw(hnp.arrays(np.float32, (B, S, T), elements=values))
    visible = draw(hnp.arrays(np.bool_, (B, S, T)))
    return scores, visible, draw(st.sampled_from([1, 3, 16, 20]))


@SETTINGS
@given(raw_scores())
def test_select_topk_random_scores(drawn):
    """The top-k primitive alone: ties to the lower index, ``-0.0`` ties ``+0.0``."""
    from csa_eqx import select_topk

    scores, visible, k = drawn
    got = np.asarray(jax.jit(select_topk, static_argnums=2)(scores, visible, k))
    want = np.full((B, S, k), -1, np.int32)
    for bi in range(B):
        for si in range(S):
            idx = np.nonzero(visible[bi, si])[0]
            ranked = sorted(idx, key=lambda j: (-float(scores[bi, si, j]), j))
            want[bi, si, : min(k, len(idx))] = sorted(ranked[:k])
    np.testing.assert_array_equal(got, want)
