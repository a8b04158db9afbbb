"""The selection family's conformance suite: every ``AbstractSelection`` through the same
checks against a numpy brute force of the exact top-k (issue 43; docs/testing.md,
"Conformance suites").

Checks, each a test parametrised over ``MEMBERS`` (one jitted program per member computes
them all):

- the picks of every query, bitwise the brute force's (float64 scores from the definition,
  the visibility rule written out, a stable sort by ``(-score, index)``): small-integer inputs
  whose scores are exact in float32, full of exact ties (ReLU zeros, ``+0.0`` / ``-0.0``),
  with empty entry slots, three packed documents of ragged lengths in one row and two in the
  other, queries in a foreign segment and early queries that see nothing (all ``-1``), ``k``
  below and above the visible counts;
- all-zero weights: every score ties, each query picks its lowest visible slots;
- bf16 scores (``score_dtype="bfloat16"``, heads in chunks of two) on inputs bf16 must round,
  head weights not exact in bf16 among them: the brute force over a numpy model of the bf16
  scores (``test_the_bf16_inputs_tell_right_from_wrong``: the float32 scores and the scores
  without the weights' rounding pick otherwise);
- the problem's scorer is the one scored through (a negating scorer gives the brute force of
  the negated weights);
- no gradient through the picks: the gradient of scores gathered at the picks is the one
  with the brute force's picks held fixed (and differentiating through the strategy works);
- V4.1: a candidate source's picks and blocks (``select_candidates`` of the member's
  candidate source, as the layers route it: ``candidate_source``) and a consumer's picks
  within them (``CandidateVisibility``, a partial last block), against the brute force;
- no entries at all (``T = 0``).

``test_auto_selection_chooses_by_size_and_filter`` puts ``AutoSelection`` on both sides of
each of its boundaries (``streams``' tile budget, ``filter_bites`` at a partial last candidate
block, the backend: the Triton kernel on a GPU, the Mosaic one on a TPU) and checks what it
chose and that the picks are the brute force's.
"""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import (
    bf16,
    brute_topk,
    candidate_source,
    candidates_np,
    choosers,
    filter_bites,
    in_blocks_np,
    member_results,
    scores_np,
    visible_np,
)

import csa_eqx as ce

# each member's results come from one program (``member_results``): its tests run in one half
# of `make test` (tests/conftest.py, ``_unit``)
DEALT_TOGETHER = ("name",)
MEMBERS = {
    "dense": ce.DenseSelection(),
    "streaming": ce.StreamingSelection(key_block=3, query_block=5, topk_block=6),
    "gathered": ce.GatheredSelection(query_block=5),
    # rows over a 4-way tensor axis (13 rows: padded), the batch over a 2-way data axis
    "sharded": ce.ShardedSelection(ce.StreamingSelection(key_block=4, query_block=3)),
    # interpret mode: a compaction every other tile, two kernel calls (rows pulled back)
    "triton": ce.TritonSelection(query_block=4, key_block=2, query_chunk=8),
    "sharded-pallas": ce.ShardedSelection(ce.TritonSelection(query_block=4, key_block=4)),
    "auto": ce.AutoSelection(),
    # Pallas' TPU interpreter: two key tiles of 8 lanes, query blocks of 4 (the last padded),
    # interpolated and halved threshold steps, three output tiles at k = 20, two kernel calls
    "mosaic": ce.MosaicSelection(query_block=4, key_block=8, search="secant", query_chunk=8),
}
SHARDED = {"sharded", "sharded-pallas"}  # run under MESH
MESH = jax.make_mesh((2, 4), ("data", "tensor"))
_IN_KERNEL = (
    "the fused kernel scores its tiles in-kernel (tile_scores), not through problem.scorer; "
    "its scores are the scorer suite's pallas member's"
)
# (member, check) -> why the member cannot run the check
EXCEPTIONS = {
    ("triton", "scorer"): _IN_KERNEL,
    ("sharded-pallas", "scorer"): _IN_KERNEL,
    ("mosaic", "scorer"): (
        "the Mosaic kernel forms the scores in-kernel as indexer_scores does, not through "
        "problem.scorer (docs/kernels.md)"
    ),
}
# (member, check) -> the error the member refuses the check's problem with (asserted)
REFUSES = {
    ("triton", "consumer"): (TypeError, "TritonSelection scores a plain Visibility"),
    ("sharded-pallas", "consumer"): (TypeError, "TritonSelection scores a plain Visibility"),
    ("mosaic", "consumer"): (TypeError, "MosaicSelection scores a plain Visibility"),
}

B, S, T, K = 2, 13, 16, 3
R = np.random.default_rng(430)
QI = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
QS = np.zeros((B, S), np.int32)
QS[0, 5:] += 1
QS[0, 9:] += 1  # row 0: documents of 5, 4 and 4 tokens
QS[1, 7:] += 1  # row 1: 7 and 6
QS[0, 3] = QS[1, 11] = 99  # queries of a foreign segment: they see nothing
END = np.sort(R.integers(0, S, (B, T)), axis=1).astype(np.int32)
END[:, 1::2] = -1  # every other slot empty
SEG = np.where(END >= 0, np.take_along_axis(QS, np.maximum(END, 0), axis=1), -1).astype(np.int32)
VISIBLE = visible_np(QI, QS, END, SEG)
EXACT = (
    R.integers(-1, 2, (B, S, 2, 4)),
    R.integers(-2, 3, (B, S, 2)),
    R.integers(-1, 2, (B, T, 4)),
)
# bf16 must round: keys near one common key (large, close logits: bf16 ties them), weights
# with 12 significant bits; one document per row, every slot filled
_r = np.random.default_rng(2)
B_END = np.sort(_r.integers(0, S, (B, T)), axis=1).astype(np.int32)
B_VISIBLE = visible_np(QI, np.zeros((B, S)), B_END, np.zeros((B, T)))
_sparse = _r.integers(-1, 2, (B, T, 16)) * (_r.random((B, T, 16)) < 0.1)
ROUNDS = (
    _r.integers(-16, 17, (B, S, 4, 16)),
    _r.integers(512, 4096, (B, S, 4)) / 1024,
    4 * _r.integers(-8, 9, (1, 1, 16)) + _sparse,
)
# V4.1: 23 tokens, one entry each (m = 1), two documents; blocks of 4 (the last holds 3)
CS, NB, BC, CK = 23, 3, 4, 5
CQI = np.broadcast_to(np.arange(CS, dtype=np.int32), (B, CS))
CQS = np.zeros((B, CS), np.int32)
CQS[:, 9:] = 1
CAND = (
    R.integers(-1, 2, (B, CS, 2, 4)),
    R.integers(0, 3, (B, CS, 2)),
    R.integers(-1, 2, (B, CS, 4)),
)
C_VISIBLE = visible_np(CQI, CQS, CQI, CQS)
C_SCORES = scores_np(*CAND)
C_BLOCKS = candidates_np(C_SCORES, C_VISIBLE, NB, BC)


def layout(end, seg) -> ce.EntryLayout:
    end, seg = jnp.asarray(end, jnp.int32), jnp.asarray(seg, jnp.int32)
    return ce.EntryLayout(end, seg, end >= 0)


def problem(q, w, keys, visibility, **kw) -> ce.SelectionProblem:
    f32 = (jnp.asarray(a, jnp.float32) for a in (q, w, keys))
    return ce.SelectionProblem.from_queries(*f32, visibility, **kw)


class NegatedScorer(ce.AbstractScorer):
    """The definition's scores, negated: a path that scored otherwise would pick otherwise."""

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
        return -ce.indexer_scores(q, weights, keys, **kw)


def pick_loss(q, w, keys, picks):
    """The sum of each query's picked scores (``d = 4``), picks held as given."""
    logits = jnp.einsum("bshd,btd->bsht", q, keys)
    scores = 0.5 * jnp.einsum("bsh,bsht->bst", w, jnp.where(logits > 0, logits, 0.0))
    picked = jnp.take_along_axis(scores, jnp.maximum(picks, 0), axis=-1)
    return jnp.sum(jnp.where(picks >= 0, picked, 0.0))


@eqx.filter_jit
def outputs(strategy, vis, b_vis, c_vis, c_blocks, empty_vis, scorer: bool, consumer: bool):
    """Everything the checks read, for one strategy, in one program."""
    out = {}
    p = problem(*EXACT, vis)
    out["k3"], out["k20"] = strategy.select(p, K), strategy.select(p, 20)
    zero = problem(EXACT[0], np.zeros(EXACT[1].shape), EXACT[2], vis)
    out["zero"] = strategy.select(zero, K)
    out["bf16"] = strategy.select(problem(*ROUNDS, b_vis, head_chunk=2, score_dtype="bfloat16"), K)
    if scorer:
        out["negated"] = strategy.select(problem(*EXACT, vis, scorer=NegatedScorer()), K)

    def loss(q, w, keys):
        return pick_loss(q, w, keys, strategy.select(problem(q, w, keys, vis), K))

    out["grads"] = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float32) for a in EXACT))
    source = problem(*CAND, c_vis)
    out["cand_picks"], out["cand_blocks"] = candidate_source(strategy, source).select_candidates(
        source, CK, NB, BC
    )
    if consumer:
        within = ce.CandidateVisibility.within(c_vis, c_blocks, BC)
        out["consumer"] = strategy.select(problem(*CAND, within), CK)
    empty = problem(EXACT[0], EXACT[1], EXACT[2][:, :0], empty_vis)
    out["empty"] = strategy.select(empty, K)
    return out


def _run(name: str) -> dict:
    strategy = MEMBERS[name]
    vis = ce.Visibility(jnp.asarray(QI), jnp.asarray(QS), layout(END, SEG))
    zeros = jnp.zeros((B, S), jnp.int32)
    b_vis = ce.Visibility(jnp.asarray(QI), zeros, layout(B_END, np.zeros_like(B_END)))
    c_vis = ce.Visibility(jnp.asarray(CQI), jnp.asarray(CQS), layout(CQI, CQS))
    empty_vis = vis._replace(layout=layout(END[:, :0], SEG[:, :0]))
    args = (vis, b_vis, c_vis, jnp.asarray(C_BLOCKS), empty_vis)
    flags = dict(
        scorer=(name, "scorer") not in EXCEPTIONS, consumer=(name, "consumer") not in REFUSES
    )
    with jax.set_mesh(MESH) if name in SHARDED else contextlib.nullcontext():
        out = jax.device_get(outputs(strategy, *args, **flags))
        if not flags["consumer"]:
            error, match = REFUSES[name, "consumer"]
            within = ce.CandidateVisibility.within(c_vis, jnp.asarray(C_BLOCKS), BC)
            with pytest.raises(error, match=match):
                jax.eval_shape(lambda: strategy.select(problem(*CAND, within), CK))
            out["refused"] = True
    return out


@pytest.fixture(scope="module")
def results():
    return member_results(EXCEPTIONS, _run)


def test_the_inputs_tell_right_from_wrong():
    """The cases reach what they claim: ties, rows that see nothing, rows with fewer visible
    entries than ``k``; bf16 rounding (of the scores, of the head weights) that changes picks;
    a candidate filter that drops visible entries, a partial last block kept by late queries."""
    scores = scores_np(*EXACT)
    picks = brute_topk(scores, VISIBLE, K)
    assert (picks == -1).all(-1).any() and (picks >= 0).all(-1).any()
    assert ((VISIBLE.sum(-1) > 0) & (VISIBLE.sum(-1) < K)).any()
    assert (np.sort(scores, -1)[..., 1:] == np.sort(scores, -1)[..., :-1]).any(-1).mean() > 0.9
    q, w, keys = (np.float32(a) for a in EXACT)  # float32 terms, summed head by head
    terms = w[..., None] * np.maximum(np.einsum("bshd,btd->bsht", q, keys), 0)
    zeros = (terms[:, :, 0] + terms[:, :, 1])[VISIBLE]
    assert (np.signbit(zeros) & (zeros == 0)).any() and ((zeros == 0) & ~np.signbit(zeros)).any()
    want = brute_topk(scores_np(*ROUNDS, score_dtype="bfloat16", head_chunk=2), B_VISIBLE, K)
    assert (brute_topk(scores_np(*ROUNDS), B_VISIBLE, K) != want).any(-1).sum() >= 3
    q, w, keys = (np.asarray(a, np.float64) for a in ROUNDS)
    logits = np.einsum("bshd,btd->bsht", q, keys)
    unrounded = bf16(bf16(np.maximum(bf16(logits), 0) * np.float32(w / 4)[..., None]).sum(2))
    assert (brute_topk(unrounded, B_VISIBLE, K) != want).any(-1).sum() >= 2
    within = C_VISIBLE & in_blocks_np(C_BLOCKS, BC, CS)
    assert (within.sum(-1) < C_VISIBLE.sum(-1)).sum() >= 5  # the filter bites
    assert (brute_topk(C_SCORES, within, CK) != brute_topk(C_SCORES, C_VISIBLE, CK)).any()
    assert (C_BLOCKS == (CS - 1) // BC).any(-1)[:, -3:].all()  # late queries keep the last block


@pytest.mark.parametrize("name", MEMBERS)
def test_picks_equal_the_brute_force(results, name):
    out = results(name, "picks")
    scores = scores_np(*EXACT)
    for k in (K, 20):
        np.testing.assert_array_equal(out[f"k{k}"], brute_topk(scores, VISIBLE, k), f"k={k}")


@pytest.mark.parametrize("name", MEMBERS)
def test_all_tied_scores_pick_the_lowest_visible_slots(results, name):
    want = np.full((B, S, K), -1, np.int32)
    for b, s in np.ndindex(B, S):  # written out: no sort
        slots = np.flatnonzero(VISIBLE[b, s])[:K]
        want[b, s, : len(slots)] = slots
    np.testing.assert_array_equal(results(name, "ties")["zero"], want)


@pytest.mark.parametrize("name", MEMBERS)
def test_bf16_scores_pick_as_bf16_rounds(results, name):
    want = brute_topk(scores_np(*ROUNDS, score_dtype="bfloat16", head_chunk=2), B_VISIBLE, K)
    np.testing.assert_array_equal(results(name, "bf16")["bf16"], want)


@pytest.mark.parametrize("name", MEMBERS)
def test_scores_through_the_problems_scorer(results, name):
    q, w, keys = EXACT
    want = brute_topk(scores_np(q, -w, keys), VISIBLE, K)
    np.testing.assert_array_equal(results(name, "scorer")["negated"], want)


@pytest.fixture(scope="module")
def reference_grads():
    picks = jnp.asarray(brute_topk(scores_np(*EXACT), VISIBLE, K))
    args = (jnp.asarray(a, jnp.float32) for a in EXACT)
    return jax.device_get(jax.jit(jax.grad(pick_loss, argnums=(0, 1, 2)))(*args, picks))


@pytest.mark.parametrize("name", MEMBERS)
def test_picks_carry_no_gradient(results, reference_grads, name):
    for got, want in zip(results(name, "gradient")["grads"], reference_grads, strict=True):
        assert np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", MEMBERS)
def test_v41_candidate_source(results, name):
    out = results(name, "candidates")
    np.testing.assert_array_equal(out["cand_blocks"], C_BLOCKS)
    np.testing.assert_array_equal(out["cand_picks"], brute_topk(C_SCORES, C_VISIBLE, CK))


@pytest.mark.parametrize("name", MEMBERS)
def test_v41_consumer_within_a_partial_last_block(results, name):
    out = results(name, "consumer")
    if out.get("refused"):  # asserted by _run: the member refuses a consumer's problem
        return
    within = C_VISIBLE & in_blocks_np(C_BLOCKS, BC, CS)
    np.testing.assert_array_equal(out["consumer"], brute_topk(C_SCORES, within, CK))


@pytest.mark.parametrize("name", MEMBERS)
def test_no_entries(results, name):
    np.testing.assert_array_equal(results(name, "empty")["empty"], np.full((B, S, K), -1))


# --- the automatic choice, on both sides of each boundary -------------------------------------

AS, AK = 23, 8  # one document of 23 entries in blocks of 4: ceil(23 / 4) = 6 blocks
A_QI = np.broadcast_to(np.arange(AS, dtype=np.int32), (B, AS))
A_ARGS = (
    R.integers(-1, 2, (B, AS, 2, 4)),
    R.integers(0, 3, (B, AS, 2)),
    R.integers(-1, 2, (B, AS, 4)),
)
A_VISIBLE = visible_np(A_QI, np.zeros_like(A_QI), A_QI, np.zeros_like(A_QI))
A_SIZE = B * AS * AS * 2  # the dense score tensor [B, S, heads, T]


@pytest.mark.parametrize(
    "elements, nb, chosen",
    [
        (A_SIZE, 5, ce.DenseSelection),  # fits one tile: dense, the filter applied
        (A_SIZE - 1, 5, ce.GatheredSelection),  # streams; 6 blocks > Nb = 5: the filter bites
        (A_SIZE - 1, 6, ce.StreamingSelection),  # 6 blocks = Nb: it cannot bite, dropped
        (A_SIZE, 6, ce.DenseSelection),
    ],
)
def test_auto_selection_chooses_by_size_and_filter(elements, nb, chosen):
    """``AutoSelection`` at the tile budget's boundary (``streams``: ``[B, S, H, T]`` against
    ``tiles.elements``) and at the candidate filter's (``filter_bites``: ``ceil(T / bc) > Nb``,
    a partial last block): the strategy it chooses, and its picks (jitted) the brute force's
    within the candidates."""
    scores = scores_np(*A_ARGS)
    blocks = candidates_np(scores, A_VISIBLE, nb, BC)
    within = A_VISIBLE & in_blocks_np(blocks, BC, AS)
    want = brute_topk(scores, within, AK)
    if nb == 5:  # the filter drops entries that would be picked without it
        assert (want != brute_topk(scores, A_VISIBLE, AK)).any()
    base = ce.Visibility(
        jnp.asarray(A_QI), jnp.zeros((B, AS), jnp.int32), layout(A_QI, np.zeros_like(A_QI))
    )
    visibility = ce.CandidateVisibility.within(base, jnp.asarray(blocks), BC)
    tiles = ce.TileSizes(elements=elements)
    p = problem(*A_ARGS, visibility, tiles=tiles)
    assert filter_bites(visibility, AS) == (nb == 5)
    assert type(ce.AutoSelection().strategy(p)) is chosen
    got = eqx.filter_jit(lambda p: ce.AutoSelection().select(p, AK))(p)
    np.testing.assert_array_equal(got, want)


def test_auto_selection_takes_the_platforms_kernel(monkeypatch):
    """The backend boundary: the platform's fused kernel (Mosaic on a TPU) for a plain problem
    not under a mesh the compiler shards, never for a biting V4.1 filter, never on a CPU or a
    GPU (the Triton kernel runs there only by name)."""
    base = ce.Visibility(
        jnp.asarray(A_QI), jnp.zeros((B, AS), jnp.int32), layout(A_QI, np.zeros_like(A_QI))
    )
    plain = problem(*A_ARGS, base)
    bites = plain._replace(
        visibility=ce.CandidateVisibility.within(base, jnp.zeros((B, AS, 1), jnp.int32), BC)
    )
    auto = ce.AutoSelection()
    assert type(auto.strategy(plain)) is ce.DenseSelection  # CPU
    monkeypatch.setattr(choosers.jax, "default_backend", lambda: "gpu")
    assert type(auto.strategy(plain)) is ce.DenseSelection
    monkeypatch.setattr(choosers.jax, "default_backend", lambda: "tpu")
    assert auto.strategy(plain) == ce.MosaicSelection()
    assert type(auto.strategy(bites)) is ce.DenseSelection
    with jax.set_mesh(MESH):
        assert type(auto.strategy(plain)) is ce.DenseSelection
