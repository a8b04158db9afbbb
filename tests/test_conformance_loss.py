"""The indexer-loss family's conformance suite: every ``AbstractIndexerLoss``, and the
functional ``indexer_kl_loss`` / ``projected_indexer_kl_loss``, through the same checks
against the KL formula (issue 43; docs/testing.md, "Conformance suites").

The reference (``conformance.kl_np``) is docs/concepts.md's formula written out: the main
attention's probability of each candidate summed over its heads and L1-normalised, against
the softmax of the indexer scores over the same candidates, averaged over the queries that
have one; float64 numpy for the value, the autodiff of the same formula in plain ``jnp`` for
the gradient with respect to the indexer's query projection, head-weight projection and keys
(the only inputs that train).

Checks, each a test parametrised over ``MEMBERS`` (one jitted program per member computes
them all): the dense warm-up (every visible entry) on packed documents of ragged lengths
with queries that see nothing; the sparse stage (a selection with ``-1`` picks); a V4.1
consumer's warm-up within its candidate blocks (``CandidateVisibility``, a partial last
block); the heads in chunks of two with ``score_dtype="bfloat16"`` (the loss is the float32
one: the loss never rounds its scores; ``test_bf16_scores_would_move_the_loss``); no
candidate anywhere (0, zero gradients, no NaN).
``test_auto_loss_chooses_by_size_and_filter`` puts ``AutoIndexerLoss`` on both sides of its
boundaries.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import (
    bf16,
    candidates_np,
    filter_bites,
    in_blocks_np,
    kl_np,
    member_results,
    scores_np,
    target_mass_np,
    visible_np,
)

import csa_eqx as ce

H, D, H_I, D_I, HIDDEN, SCALE = 4, 6, 4, 8, 12, 0.3


def _functional(problem, target, selection):
    """``indexer_kl_loss`` over the problem's dense scores and its candidates (the visible
    entries, or the selection's)."""
    q, w = problem.queries()
    scores = ce.indexer_scores(q, w, problem.keys, head_chunk=problem.head_chunk)
    if selection is None:
        candidates = problem.visibility.mask()
    else:
        hits = selection[..., None] == jnp.arange(problem.keys.shape[1])
        candidates = jnp.any(hits & (selection >= 0)[..., None], axis=-2)
    return ce.indexer_kl_loss(
        *target[:3], scores, candidates, target.scale, head_chunk=problem.head_chunk
    )


# each member's results come from one program (``member_results``): its tests run in one half
# of `make test` (tests/conftest.py, ``_unit``)
DEALT_TOGETHER = ("name",)
MEMBERS = {
    "dense": ce.DenseIndexerLoss().loss,
    "streaming": ce.StreamingIndexerLoss(key_block=3, query_block=5).loss,
    "gathered": ce.GatheredIndexerLoss(query_block=5).loss,
    "auto": ce.AutoIndexerLoss().loss,
    "functional": _functional,
    "projected": ce.projected_indexer_kl_loss,  # its default method
    # "mosaic": a TPU loss kernel joins here
}
# (member, check) -> why it cannot run the check: none, every loss runs every check
EXCEPTIONS: dict[tuple[str, str], str] = {}

B, S, M = 2, 22, 2
R = np.random.default_rng(4300)
SEG = np.zeros((B, S), np.int32)
SEG[0, 10:] = 1
SEG[1, 5:] = 1
SEG[1, 16:] = 2  # packed documents of ragged lengths (odd ones leave empty slots)
LAYOUT = ce.entry_layout(jnp.asarray(SEG), M)
T = LAYOUT.end.shape[1]
QSEG = SEG.copy()
QSEG[0, 4] = QSEG[1, 12] = 99  # queries that see nothing
QI = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))


def _f(*shape, scale=1.0):
    return (R.normal(size=shape) * scale).astype(np.float32)


PARAMS = {
    "wq": _f(H_I * D_I, HIDDEN, scale=0.5),
    "ww": _f(H_I, HIDDEN, scale=3.0),
    "keys": _f(B, T, D_I),
}
X, Q, ENTRIES, LSE = _f(B, S, HIDDEN), _f(B, S, H, D), _f(B, T, D), _f(B, S, H) + 2.0
VISIBLE = visible_np(QI, QSEG, np.asarray(LAYOUT.end), np.asarray(LAYOUT.segment))
_noise = np.where(VISIBLE, R.random(VISIBLE.shape), -1.0)
SELECTION = np.argsort(-_noise, -1)[..., :3].astype(np.int32)
SELECTION = np.where(np.take_along_axis(VISIBLE, SELECTION, -1), SELECTION, -1)
PICKED = (SELECTION[..., None] == np.arange(T)).any(-2)
BLOCKS = candidates_np(R.normal(size=VISIBLE.shape), VISIBLE, 2, 2)  # Nb = 2, bc = 2
WITHIN = VISIBLE & in_blocks_np(BLOCKS, 2, T)


def project_with(params):
    def project(x):
        q = jnp.einsum("bsi,oi->bso", x, params["wq"]).reshape(*x.shape[:2], H_I, D_I)
        return q, jnp.einsum("bsi,hi->bsh", x, params["ww"]) * H_I**-0.5

    return project


def scores_jnp(params, x):
    """The indexer scores as a plain ``jnp`` formula (the reference's)."""
    q, w = project_with(params)(x)
    logits = jnp.einsum("bshd,btd->bsht", q, params["keys"])
    return jnp.einsum("bsh,bsht->bst", w, jnp.where(logits > 0, logits, 0.0)) * D_I**-0.5


def scores64() -> np.ndarray:
    """The indexer scores of the inputs in float64, from the definition."""
    p = {k: np.asarray(v, np.float64) for k, v in PARAMS.items()}
    q = (X @ p["wq"].T).reshape(B, S, H_I, D_I)
    return scores_np(q, X @ p["ww"].T * H_I**-0.5, p["keys"])


MASS = target_mass_np(Q, ENTRIES, LSE, SCALE)


def reference(candidates):
    """float64 loss and float32 reference gradient for ``candidates``."""
    value = kl_np(np, scores64(), MASS, candidates)
    grad = jax.grad(lambda p: kl_np(jnp, scores_jnp(p, jnp.asarray(X)), MASS, candidates))(PARAMS)
    return value, jax.device_get(grad)


def _problem(params, vis, head_chunk=0, score_dtype=None, tiles=None):
    kw = {} if tiles is None else dict(tiles=tiles)
    return ce.SelectionProblem(
        project_with(params), (jnp.asarray(X),), params["keys"], vis, head_chunk, score_dtype, **kw
    )


TARGET = ce.AttentionTarget(jnp.asarray(Q), jnp.asarray(ENTRIES), jnp.asarray(LSE), SCALE)


@eqx.filter_jit
def outputs(name: str, params, vis, foreign, blocks, selection):
    loss = MEMBERS[name]

    def run(vis, selection=None, **kw):
        return jax.value_and_grad(lambda p: loss(_problem(p, vis, **kw), TARGET, selection))(params)

    within = ce.CandidateVisibility.within(vis, blocks, 2)
    no_entries = vis._replace(layout=ce.EntryLayout(*(a[:, :0] for a in vis.layout)))
    target = TARGET._replace(keys=TARGET.keys[:, :0])
    empty = jax.value_and_grad(lambda p: loss(_problem(p, no_entries), target, None))(
        {**params, "keys": params["keys"][:, :0]}
    )
    return {
        "no_entries": empty,
        "dense": run(vis),
        "sparse": run(vis, selection),
        "consumer": run(within),
        "bf16": run(vis, head_chunk=2, score_dtype="bfloat16"),
        "nothing": run(foreign),
        "nothing_sparse": run(foreign, jnp.full_like(selection, -1)),
    }


def _visibility(qseg=QSEG, layout=LAYOUT):
    return ce.Visibility(jnp.asarray(QI), jnp.asarray(qseg), layout)


@pytest.fixture(scope="module")
def results():
    def run(name: str) -> dict:
        params = {k: jnp.asarray(v) for k, v in PARAMS.items()}
        foreign = _visibility(np.full_like(QSEG, 99))
        args = (_visibility(), foreign, jnp.asarray(BLOCKS), jnp.asarray(SELECTION))
        return jax.device_get(outputs(name, params, *args))

    return member_results(EXCEPTIONS, run)


@pytest.fixture(scope="module")
def references():
    return {"dense": reference(VISIBLE), "sparse": reference(PICKED), "consumer": reference(WITHIN)}


def assert_loss(got, want, what):
    (value, grads), (want_value, want_grads) = got, want
    assert want_value > 0.05
    np.testing.assert_allclose(value, want_value, rtol=1e-5, err_msg=what)
    for name in want_grads:
        scale = np.abs(want_grads[name]).max()
        assert scale > 0, name
        np.testing.assert_allclose(
            grads[name], want_grads[name], rtol=0, atol=2e-5 * scale, err_msg=f"{what} d{name}"
        )


def test_the_inputs_tell_right_from_wrong():
    """Queries that see nothing, picks of ``-1``, empty entry slots, a filter that drops
    visible entries (its last block partial: 11 entries in blocks of 2)."""
    assert (~VISIBLE.any(-1)).sum() >= 4 and (SELECTION == -1).any() and PICKED.any()
    assert (WITHIN.sum(-1) < VISIBLE.sum(-1)).sum() >= 4 and T % 2 == 1
    assert (np.asarray(LAYOUT.end) == -1).any()


@pytest.mark.parametrize("name", MEMBERS)
def test_dense_warm_up(results, references, name):
    assert_loss(results(name, "dense")["dense"], references["dense"], "warm-up")


@pytest.mark.parametrize("name", MEMBERS)
def test_sparse_stage(results, references, name):
    assert_loss(results(name, "sparse")["sparse"], references["sparse"], "sparse")


@pytest.mark.parametrize("name", MEMBERS)
def test_v41_consumer_warm_up_within_its_candidates(results, references, name):
    assert_loss(results(name, "consumer")["consumer"], references["consumer"], "consumer")


@pytest.mark.parametrize("name", MEMBERS)
def test_head_chunks_and_bf16_problems_keep_float32_scores(results, references, name):
    """``head_chunk=2`` (the indexer's and the attention's heads) and ``score_dtype`` set: the
    loss is the float32 one (``AbstractIndexerLoss``: scores are not rounded)."""
    assert_loss(results(name, "bf16")["bf16"], references["dense"], "bf16 problem")


def test_bf16_scores_would_move_the_loss(references):
    """Scores rounded to bf16 change the loss well past the tolerance above (so a member that
    rounded them would fail)."""
    rounded = kl_np(np, bf16(scores64()).astype(np.float64), MASS, VISIBLE)
    assert abs(rounded - references["dense"][0]) > 1e-4 * references["dense"][0]  # 10x rtol


@pytest.mark.parametrize("name", MEMBERS)
def test_no_candidate_anywhere(results, name):
    out = results(name, "nothing")
    for stage in ("nothing", "nothing_sparse", "no_entries"):
        value, grads = out[stage]
        assert value == 0.0, stage
        assert all((np.asarray(g) == 0).all() for g in jax.tree.leaves(grads)), stage


# --- the automatic choice, on both sides of each boundary -------------------------------------

ONE_DOC = ce.entry_layout(jnp.zeros((B, S), jnp.int32), M)  # 11 entries: 6 blocks of 2
ONE_VISIBLE = visible_np(QI, np.zeros((B, S)), np.asarray(ONE_DOC.end), np.asarray(ONE_DOC.segment))
SIZE = B * S * T * max(H_I, H)  # AbstractIndexerLoss.sizes: [B, S, heads at once, T]


@pytest.mark.parametrize(
    "elements, nb, chosen",
    [
        (SIZE, 5, ce.DenseIndexerLoss),
        (SIZE - 1, 5, ce.GatheredIndexerLoss),  # 6 blocks > Nb = 5: the filter bites
        (SIZE - 1, 6, ce.StreamingIndexerLoss),  # 6 blocks = Nb: dropped
        (SIZE, 6, ce.DenseIndexerLoss),
    ],
)
def test_auto_loss_chooses_by_size_and_filter(elements, nb, chosen):
    """``AutoIndexerLoss`` at the tile budget's boundary and the candidate filter's (a partial
    last block): what it chooses, and its warm-up loss (jitted) the formula's within the
    candidates."""
    blocks = candidates_np(R.normal(size=ONE_VISIBLE.shape), ONE_VISIBLE, nb, 2)
    within = ONE_VISIBLE & in_blocks_np(blocks, 2, T)
    if nb == 5:
        assert (within != ONE_VISIBLE).any()
    vis = ce.CandidateVisibility.within(
        _visibility(np.zeros_like(QSEG), ONE_DOC), jnp.asarray(blocks), 2
    )
    tiles = ce.TileSizes(elements=elements)
    params = {k: jnp.asarray(v) for k, v in PARAMS.items()}
    p = _problem(params, vis, tiles=tiles)
    auto = ce.AutoIndexerLoss()
    assert filter_bites(vis, T) == (nb == 5)
    assert type(auto.choose(*auto.sizes(p, TARGET), tiles, nb == 5)) is chosen
    got = eqx.filter_jit(lambda p: auto.loss(p, TARGET))(p)
    np.testing.assert_allclose(float(got), kl_np(np, scores64(), MASS, within), rtol=1e-5)
