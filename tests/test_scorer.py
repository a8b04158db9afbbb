"""The scoring kernel seam: the other scorers (``BlockedScorer``, the Pallas tile kernel
``PallasScorer`` in interpret mode) chosen through ``Execution`` give the reference's
(``XlaScorer``) scores (bitwise where they are exact, bf16 rounding included, else to float32
rounding: XLA picks the dot per shape) and bitwise its selections on every selection path
(dense, streaming, row-sharded) and in whole layers (V4 CSA, V3.2), and every path really
scores through the problem's scorer.

References: a float64 numpy formula of the scores, and the numpy brute-force top-k of
test_topk_reference.py (integer inputs: exact scores, many exact ties, ties to the lower
index).
"""

import contextlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_topk_reference import B, S, T, brute_force, fixed_case, layout_of
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx._attention.reads import gather_keys
from csa_eqx._numerics.base import V4_FORMATS
from csa_eqx._topk import exact_topk

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCORERS = {"blocked-1": ce.BlockedScorer(1), "blocked-5": ce.BlockedScorer(5)}
# the Pallas kernel (interpret mode: a compile per program) runs the checks of every scorer
# below, and the selection paths on fewer seeds (test_kernel_scorer_selects_exact_ties)
KERNEL = {"pallas": ce.PallasScorer(query_block=4, key_block=8)}
ALL_SCORERS = SCORERS | KERNEL
PATHS = {
    "dense": ce.DenseSelection(),
    "streaming": ce.StreamingSelection(key_block=3, query_block=5, topk_block=6),
    "sharded": ce.ShardedSelection(ce.DenseSelection()),
    "sharded-streaming": ce.ShardedSelection(ce.StreamingSelection(key_block=4)),
}


class NegatedScorer(ce.AbstractScorer):
    """The reference's scores, negated: a selection that used another scorer would differ."""

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
        return -ce.indexer_scores(q, weights, keys, **kw)


def numpy_scores(q, w, keys):
    """float64 ``d^-1/2 Σ_h w ReLU(q · k)``."""
    q, w, keys = (np.asarray(a, np.float64) for a in (q, w, keys))
    dots = np.einsum("bshd,btd->bsht", q, keys)
    return np.einsum("bsh,bsht->bst", w, np.maximum(dots, 0.0)) * q.shape[-1] ** -0.5


def random_inputs(seed, b=2, s=9, h=4, d=8, t=13):
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)  # noqa: E731
    return f(b, s, h, d), f(b, s, h), f(b, t, d)


@pytest.mark.parametrize("head_chunk", [0, 2])
@pytest.mark.parametrize("score_dtype", [None, "bfloat16"])
def test_scores_equal_the_reference(head_chunk, score_dtype):
    """Random inputs: the formula to float32 rounding (bf16 rounding with ``score_dtype``);
    small-integer inputs (exact scores): bitwise the reference's and the formula's."""
    kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
    exact = fixed_case(4)[:3]
    for inputs, bitwise in ((random_inputs(0), False), (exact, True)):
        q, w, keys = (jnp.asarray(a, jnp.float32) for a in inputs)
        want = jax.jit(lambda *a: ce.XlaScorer().scores(*a, **kw))(q, w, keys)
        np.testing.assert_array_equal(want, ce.indexer_scores(q, w, keys, **kw))
        for name, scorer in ALL_SCORERS.items():
            got = jax.jit(lambda *a, scorer=scorer: scorer.scores(*a, **kw))(q, w, keys)
            assert got.shape == want.shape and got.dtype == jnp.float32
            formula = numpy_scores(q, w, keys)
            if bitwise:
                np.testing.assert_array_equal(got, want, err_msg=name)
                np.testing.assert_array_equal(got, formula, err_msg=name)
            # bf16: each head's term rounded, so the error scales with the largest score
            rtol, atol = (1e-5, 1e-5) if score_dtype is None else (1e-2, 0.03 * abs(formula).max())
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)
            np.testing.assert_allclose(got, formula, rtol=rtol, atol=atol, err_msg=name)


def test_gathered_scores_match_the_formula():
    """Each query against its own keys (the sparse stage of the loss), for both scorers."""
    q, w, keys = random_inputs(1)
    picks = jax.random.randint(jax.random.key(0), (2, 9, 3), 0, keys.shape[1])
    gathered = gather_keys(keys, picks)  # [B, S, 3, d]
    full = numpy_scores(q, w, keys)
    want = np.take_along_axis(full, np.asarray(picks), axis=-1)
    for scorer in (ce.XlaScorer(), *ALL_SCORERS.values()):
        for head_chunk in (0, 2):
            got = scorer.gathered_scores(q, w, gathered, head_chunk=head_chunk)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@jax.jit(static_argnames=("path", "scorer", "k"))
def selected(path, scorer, q, w, keys, visibility, k):
    problem = ce.SelectionProblem.from_queries(q, w, keys, visibility, scorer=scorer)
    return PATHS[path].select(problem, k)


def select(path, scorer, case, k):
    q, w, keys, qi, qs, end = case
    visibility = ce.Visibility(jnp.asarray(qi), jnp.asarray(qs), layout_of(end, qs))
    f32 = (jnp.asarray(a, jnp.float32) for a in (q, w, keys))
    return selected(path, scorer, *f32, visibility, k)


@pytest.mark.parametrize("path", PATHS)
def test_selections_bitwise_equal_with_exact_ties(path):
    """Integer inputs (exact scores, many exact ties and +0.0 / -0.0): every scorer selects
    what the brute force does (ties to the lower index) on every path; a scorer of negated
    scores selects the brute force of the negated weights, so the path scores through it."""
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        for seed, k in [(0, 3), (1, 5), (2, 20)]:
            case = fixed_case(seed)
            q, w, keys, qi, qs, end = case
            seg = np.asarray(layout_of(end, qs).segment)
            want = brute_force(q, w, keys, qi, qs, end, seg, k)
            assert (want == -1).any() and (want >= 0).any()
            ref = select(path, ce.XlaScorer(), case, k)
            np.testing.assert_array_equal(ref, want, err_msg=f"{path} reference")
            for name, scorer in SCORERS.items():
                got = select(path, scorer, case, k)
                np.testing.assert_array_equal(got, want, err_msg=f"{path} {name} seed={seed}")
            negated = (q, -w, keys, qi, qs, end)
            want_neg = brute_force(*negated[:3], qi, qs, end, seg, k)
            got = select(path, NegatedScorer(), case, k)
            np.testing.assert_array_equal(got, want_neg, err_msg=f"{path} negated")


@pytest.mark.parametrize("path", ["dense", "streaming", "sharded-streaming"])
def test_kernel_scorer_selects_exact_ties(path):
    """``test_selections_bitwise_equal_with_exact_ties`` for the Pallas scorer, on two seeds
    (``k`` below and above the entry count) and the paths that call a scorer differently (all
    entries at once, per key tile, per tile inside the row-sharded map; a kernel runs on an
    Explicit mesh inside a ``shard_map`` only, as every placement runs it)."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh) if path.startswith("sharded") else contextlib.nullcontext():
        for seed, k in [(1, 5), (2, 20)]:
            case = fixed_case(seed)
            q, w, keys, qi, qs, end = case
            want = brute_force(q, w, keys, qi, qs, end, np.asarray(layout_of(end, qs).segment), k)
            got = select(path, KERNEL["pallas"], case, k)
            np.testing.assert_array_equal(got, want, err_msg=f"{path} seed={seed}")


def test_scorers_agree_bitwise_where_bf16_rounds():
    """Integer inputs whose float32 scores are exact and whose bf16 rounding is real (logits in
    the thousands): every scorer's bf16 scores are the reference's bitwise, with and without
    head chunks. A scorer that ignored ``score_dtype`` would give the float32 scores, which
    differ (the check can fail)."""
    r = np.random.default_rng(5)
    q = jnp.asarray(r.integers(-16, 17, (2, 9, 4, 16)), jnp.float32)
    w = jnp.asarray(r.integers(-3, 4, (2, 9, 4)) * 4, jnp.float32)
    keys = jnp.asarray(r.integers(-16, 17, (2, 13, 16)), jnp.float32)
    for head_chunk in (0, 2):
        kw = dict(head_chunk=head_chunk, score_dtype="bfloat16")
        want = jax.jit(lambda *a, kw=kw: ce.XlaScorer().scores(*a, **kw))(q, w, keys)
        exact = ce.indexer_scores(q, w, keys, head_chunk=head_chunk)
        np.testing.assert_array_equal(exact, numpy_scores(q, w, keys))  # float32 is exact
        assert (np.asarray(want) != np.asarray(exact)).mean() > 0.5  # bf16 rounds most
        for name, scorer in ALL_SCORERS.items():
            got = jax.jit(lambda *a, scorer=scorer, kw=kw: scorer.scores(*a, **kw))(q, w, keys)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} head_chunk={head_chunk}")


def test_all_tied_scores_pick_the_lowest_slots():
    """Zero weights: every score is +0.0 in every scorer; picks are the lowest visible slots."""
    q, w, keys, qi, qs, end = fixed_case(3)
    case = (q, np.zeros_like(w), keys, qi, qs, end)
    seg = np.asarray(layout_of(end, qs).segment)
    want = brute_force(*case[:3], qi, qs, end, seg, 4)
    for scorer in ALL_SCORERS.values():
        for path in ("dense", "streaming"):
            np.testing.assert_array_equal(select(path, scorer, case, 4), want, err_msg=path)
    assert want.shape == (B, S, 4) and T >= 4


RUN = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))


def v32_layer():
    cfg = ce.V32AttentionConfig(
        hidden_size=32, num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, index_n_heads=4, index_head_dim=16, index_topk=5,
    )  # fmt: skip
    return randomise(ce.V32Attention(cfg, key=jax.random.key(0)), 2)


@pytest.mark.parametrize("kind", ["v4-csa", "v32"])
def test_layer_selection_through_execution(kind):
    """``Execution(scorer=BlockedScorer(...))``: the layer's selection bitwise equal to the
    reference scorer's on the dense and streaming paths, outputs and the sparse-stage loss
    equal up to rounding; ``NegatedScorer`` changes the selection (the layer uses it)."""
    if kind == "v32":
        layer = v32_layer()
    else:
        layer = randomise(ce.V4Attention(tiny("csa", index_topk=3), key=jax.random.key(0)), 1)
    x = jax.random.normal(jax.random.key(5), (2, 30, 32))
    seg = jnp.asarray([[0] * 13 + [1] * 17, [0] * 30], jnp.int32)
    ref_y, ref_aux = RUN(layer.with_execution(ce.Execution(indexer_loss="sparse")), x, seg)
    sel = np.asarray(ref_aux["selection"])
    assert (sel >= 0).any()
    for selection in (ce.DenseSelection(), ce.StreamingSelection(key_block=3, query_block=4)):
        for loss in (ce.DenseIndexerLoss(), ce.StreamingIndexerLoss(key_block=4)):
            ex = ce.Execution(
                selection=selection,
                scorer=ce.BlockedScorer(4),
                indexer_kl=loss,
                indexer_loss="sparse",
            )
            y, aux = RUN(layer.with_execution(ex), x, seg)
            np.testing.assert_array_equal(aux["selection"], sel, err_msg=str(ex))
            np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(aux["indexer_loss"], ref_aux["indexer_loss"], rtol=1e-5)
    _, neg = RUN(layer.with_execution(ce.Execution(scorer=NegatedScorer())), x, seg)
    assert not np.array_equal(neg["selection"], sel)


def test_exact_topk_unrolled_is_the_same():
    values = jax.random.normal(jax.random.key(0), (3, 40)).round(1)  # ties
    valid = jax.random.bernoulli(jax.random.key(1), 0.8, (3, 40))
    a = exact_topk(values, valid, 7)
    b = exact_topk(values, valid, 7, unroll=True)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_execution_fields_are_checked():
    # a ValueError naming the field (a jaxtyping TypeError first, where the suite checks types)
    for field, value in [("scorer", "blocked"), ("indexer_kl", ce.DenseSelection())]:
        with pytest.raises((TypeError, ValueError), match=field):
            ce.Execution(**{field: value})
    with pytest.raises((TypeError, ValueError), match="tiles"):
        ce.Execution(tiles=(1, 2, 3, False))
    with pytest.raises(ValueError, match="key_block must be an int > 0"):
        ce.BlockedScorer(0)
    ex = ce.Execution.from_options(indexer_key_block=8)
    assert ex.indexer_kl == ce.StreamingIndexerLoss(key_block=8)
    tiles = ce.TileSizes(elements=1 << 10)
    keys = jnp.zeros((1, 3, 4))
    rows = jnp.zeros((1, 2), jnp.int32)
    vis = ce.Visibility(rows, rows, ce.entry_layout(rows, 1))
    indexer = ce.IndexerHeads(tiny("csa"), key=jax.random.key(0))  # the problem's maker
    x, qr = jnp.zeros((1, 2, tiny("csa").hidden_size)), jnp.zeros((1, 2, tiny("csa").q_lora_rank))
    execution = ce.Execution(tiles=tiles)
    problem = indexer.problem(x, qr, rows, keys, vis, execution, V4_FORMATS)
    assert problem.tiles == tiles and problem.scorer == ce.XlaScorer()
