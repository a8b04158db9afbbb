"""The scorer family's conformance suite: every ``AbstractScorer`` through the same checks
against the definition of the indexer scores (issue 43; docs/testing.md, "Conformance
suites").

Checks, each a test parametrised over ``MEMBERS`` (one jitted program per member computes
them all):

- scores bitwise equal to the float64 formula on small-integer inputs (every score exact in
  float32; many exact ties, ``+0.0`` next to ``-0.0``), with and without head chunks; within
  float32 rounding of it on random inputs;
- bf16 scores (``score_dtype="bfloat16"``) bitwise equal to a numpy model of DeepSeek-V4's
  bf16 einsum, on inputs that bf16 must round: logits in the thousands and head weights with
  12 significant bits (``test_the_bf16_inputs_tell_right_from_wrong`` shows that skipping
  either rounding changes the scores);
- gradients with respect to queries, weights and keys: in float32 against the formula's
  derivative in numpy; in bf16 against the autodiff of a plain ``jnp`` formula written here
  with the same roundings;
- ``gathered_scores`` (each query against its own keys) and its gradient against the formula;
- zero weights (every score an exact zero) and no entries / no queries.

A scorer masks nothing, so fully masked rows, ragged inputs and an automatic chooser do not
arise in this family (the selection and loss suites run them through their scorer).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import bf16, member_results, scores_np

import csa_eqx as ce

# each member's results come from one program (``member_results``): its tests run in one half
# of `make test` (tests/conftest.py, ``_unit``)
DEALT_TOGETHER = ("name",)
MEMBERS = {
    "xla": ce.XlaScorer(),
    "blocked": ce.BlockedScorer(5),  # 13 keys: two blocks and a padded one
    "triton": ce.TritonScorer(query_block=4, key_block=8),  # interpret mode; partial tiles
    # "mosaic": the TPU scorer (issue 44) joins here
}
# (member, check) -> why the member cannot run the check
EXCEPTIONS = {
    ("blocked", "bf16 weight gradient"): (
        "BlockedScorer differentiates indexer_scores per key block: the weights' gradient is "
        "a sum over the entries, and reduce_precision's transpose rounds each block's share "
        "of it to bf16 before the blocks are added (the reference rounds the whole sum once), "
        "so it is the reference's only to bf16 rounding; its float32 gradients and its bf16 "
        "query and key gradients are checked"
    ),
}

B, S, H, D, T = 2, 9, 4, 16, 13
R = np.random.default_rng(43)
EXACT = (  # small integers, d = 4: every score exact in float32, many exact ties and +-0.0
    R.integers(-1, 2, (B, S, H, 4)),
    R.integers(-2, 3, (B, S, H)),
    R.integers(-1, 2, (B, T, 4)),
)
FLOAT = (R.normal(size=(B, S, H, 8)), R.normal(size=(B, S, H)), R.normal(size=(B, T, 8)))
# bf16 must round: integer logits up to 4096 (exact in float32, not in bf16), weights with 12
# significant bits (w·d^-1/2 = w/4 is not a bf16 value)
ROUNDS = (
    R.integers(-16, 17, (B, S, H, D)),
    R.choice([-1, 1], (B, S, H)) * R.integers(2048, 4096, (B, S, H)) / 1024,
    R.integers(-16, 17, (B, T, D)),
)
PICKS = R.integers(0, T, (B, S, 3))
COTANGENT = R.normal(size=(B, S, T))
F32 = jnp.float32


def _f32(arrays):
    return tuple(jnp.asarray(a, F32) for a in arrays)


def _rounded_jnp(x):
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def bf16_scores_jnp(q, w, keys, head_chunk=0):
    """The bf16 scores as a plain ``jnp`` formula (the same roundings as ``scores_np``): its
    autodiff is the reference gradient of a bf16 scorer."""
    d, h = q.shape[-1], q.shape[2]
    logits = jnp.einsum("bshd,btd->bsht", q, keys, precision="highest")
    relu = jnp.where(_rounded_jnp(logits) > 0, _rounded_jnp(logits), 0.0)
    terms = _rounded_jnp(relu * _rounded_jnp(w * d**-0.5)[..., None])
    chunk = head_chunk or h
    total = sum(terms[:, :, c : c + chunk].sum(2) for c in range(0, h, chunk))
    return _rounded_jnp(total)


def grads_np(q, w, keys, g):
    """float64 ``(dq, dw, dkeys)`` of ``Σ g · scores`` from the formula's derivative."""
    q, w, keys, g = (np.asarray(a, np.float64) for a in (q, w, keys, g))
    d = q.shape[-1]
    logits = np.einsum("bshd,btd->bsht", q, keys)
    dw = np.einsum("bst,bsht->bsh", g, np.maximum(logits, 0)) * d**-0.5
    dl = g[:, :, None, :] * w[..., None] * (logits > 0) * d**-0.5
    return np.einsum("bsht,btd->bshd", dl, keys), dw, np.einsum("bsht,bshd->btd", dl, q)


@eqx.filter_jit
def outputs(scorer):
    """Everything the checks read, for one scorer, in one program."""
    out = {}

    def scores(q, w, keys, **kw):
        return scorer.scores(q, w, keys, **kw)

    exact, rounds, flt = _f32(EXACT), _f32(ROUNDS), _f32(FLOAT)
    for chunk in (0, 2):
        out[f"exact{chunk}"] = scores(*exact, head_chunk=chunk)
        out[f"bf16_{chunk}"] = scores(*rounds, head_chunk=chunk, score_dtype="bfloat16")
    out["float"] = scores(*flt)
    g = jnp.asarray(COTANGENT, F32)
    _, vjp = jax.vjp(lambda *a: scores(*a), *flt)
    out["grad"] = vjp(g)
    for chunk in (0, 2):
        _, vjp = jax.vjp(lambda *a, c=chunk: scores(*a, head_chunk=c, score_dtype="bfloat16"), *flt)
        out[f"grad_bf16_{chunk}"] = vjp(g)
    picks = jnp.asarray(PICKS)
    gathered = jax.vmap(lambda k, p: k[p])(flt[2], picks)  # [B, S, 3, d]

    def gathered_scores(q, w, keys):
        return scorer.gathered_scores(q, w, keys, head_chunk=2)

    out["gathered"], vjp = jax.vjp(gathered_scores, flt[0], flt[1], gathered)
    out["grad_gathered"] = vjp(g[..., :3])
    out["zero"] = scores(exact[0], jnp.zeros_like(exact[1]), exact[2])
    out["no_entries"] = scores(exact[0], exact[1], exact[2][:, :0])
    out["no_queries"] = scores(exact[0][:, :0], exact[1][:, :0], exact[2])
    return out


@pytest.fixture(scope="module")
def results():
    return member_results(EXCEPTIONS, lambda name: jax.device_get(outputs(MEMBERS[name])))


def test_the_bf16_inputs_tell_right_from_wrong():
    """The bf16 inputs separate a correct scorer from one that skips a rounding: the float32
    scores, the scores without the weights' rounding and those without the logits' rounding
    all differ from the bf16 reference on many entries (measured: 94 %, 27 %, 19 %)."""
    want = scores_np(*ROUNDS, score_dtype="bfloat16")
    q, w, keys = (np.asarray(a, np.float64) for a in ROUNDS)
    logits = np.einsum("bshd,btd->bsht", q, keys)
    weight = np.float32(w) * np.float32(0.25)
    unrounded_w = bf16((bf16(np.maximum(bf16(logits), 0) * weight[..., None])).sum(2))
    unrounded_l = bf16((bf16(np.maximum(logits, 0) * bf16(weight)[..., None])).sum(2))
    for wrong in (scores_np(*ROUNDS), unrounded_w, unrounded_l):
        assert (wrong != want).mean() > 0.1


@pytest.mark.parametrize("name", MEMBERS)
def test_exact_scores(results, name):
    out = results(name, "exact")
    want = scores_np(*EXACT)
    assert (want == 0).mean() > 0.2  # many exact ties at zero (ReLU)
    for chunk in (0, 2):
        got = out[f"exact{chunk}"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want, err_msg=f"head_chunk={chunk}")


@pytest.mark.parametrize("name", MEMBERS)
def test_float_scores(results, name):
    want = scores_np(*FLOAT)
    np.testing.assert_allclose(results(name, "float")["float"], want, rtol=0, atol=1e-6 * 8)


@pytest.mark.parametrize("name", MEMBERS)
def test_bf16_scores(results, name):
    out = results(name, "bf16")
    for chunk in (0, 2):
        want = scores_np(*ROUNDS, score_dtype="bfloat16", head_chunk=chunk)
        np.testing.assert_array_equal(out[f"bf16_{chunk}"], want, err_msg=f"head_chunk={chunk}")


def _assert_grads(got, want, what, skip=()):
    for name, g, w in zip(("dq", "dw", "dkeys"), got, want, strict=True):
        if name in skip:
            continue
        scale = np.abs(np.asarray(w)).max()
        assert scale > 0
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale, err_msg=f"{what} {name}")


@pytest.mark.parametrize("name", MEMBERS)
def test_float32_gradients(results, name):
    _assert_grads(results(name, "grad")["grad"], grads_np(*FLOAT, COTANGENT), "float32")


@pytest.mark.parametrize("name", MEMBERS)
def test_bf16_gradients(results, name):
    """The gradient of the bf16 scores with respect to the queries and keys is the bf16
    formula's (rounded logits and weights), not the float32 one's (which differs by ~2^-9
    relative: ``test_bf16_gradients_differ``)."""
    out = results(name, "bf16 gradient")
    for chunk in (0, 2):
        want = _bf16_reference_grads(chunk)
        _assert_grads(out[f"grad_bf16_{chunk}"], want, f"head_chunk={chunk}", skip=("dw",))


@pytest.mark.parametrize("name", MEMBERS)
def test_bf16_weight_gradient(results, name):
    out = results(name, "bf16 weight gradient")
    for chunk in (0, 2):
        want = _bf16_reference_grads(chunk)
        _assert_grads(out[f"grad_bf16_{chunk}"], want, f"head_chunk={chunk}", skip=("dq", "dkeys"))


def _bf16_reference_grads(chunk):
    flt = _f32(FLOAT)
    _, vjp = jax.vjp(lambda *a: bf16_scores_jnp(*a, head_chunk=chunk), *flt)
    return jax.device_get(vjp(jnp.asarray(COTANGENT, F32)))


def test_bf16_gradients_differ():
    """The bf16 reference gradient differs from the float32 one beyond the tolerance above."""
    got, f32 = _bf16_reference_grads(0), grads_np(*FLOAT, COTANGENT)
    for g, w in zip(got, f32, strict=True):
        assert np.abs(g - w).max() > 1e-3 * np.abs(w).max()


@pytest.mark.parametrize("name", MEMBERS)
def test_gathered_scores_and_gradients(results, name):
    out = results(name, "gathered")
    q, w, keys = FLOAT
    gathered = np.take_along_axis(keys[:, None], PICKS[..., None], axis=2)  # [B, S, 3, d]
    own = np.einsum("bshd,bsnd->bshn", q, gathered)
    want = np.einsum("bsh,bshn->bsn", w, np.maximum(own, 0)) * 8**-0.5
    np.testing.assert_allclose(out["gathered"], want, rtol=0, atol=1e-6 * 8)
    g = COTANGENT[..., :3]
    dl = g[:, :, None, :] * w[..., None] * (own > 0) * 8**-0.5
    grads = (
        np.einsum("bshn,bsnd->bshd", dl, gathered),
        np.einsum("bsn,bshn->bsh", g, np.maximum(own, 0)) * 8**-0.5,
        np.einsum("bshn,bshd->bsnd", dl, q),
    )
    _assert_grads(out["grad_gathered"], grads, "gathered")


@pytest.mark.parametrize("name", MEMBERS)
def test_zero_weights_and_empty_inputs(results, name):
    out = results(name, "edges")
    assert (out["zero"] == 0).all() and out["zero"].shape == (B, S, T)
    assert out["no_entries"].shape == (B, S, 0) and out["no_queries"].shape == (B, 0, T)
