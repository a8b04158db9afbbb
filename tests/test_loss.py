"""Indexer KL distillation (docs/concepts.md): a layer's loss against HF's attention
probabilities, gradient routing, no NaN (every loss strategy and the functional forms against
the KL formula: tests/test_conformance_loss.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_v4_parity import untied_rows

from csa_eqx import indexer_kl_loss
from csa_eqx.hf import load_v4_attention
from csa_eqx.presets import tiny_v4
from csa_eqx.testing import hf_v4_config, random_hf_v4_layer, run_hf_v4, state_dict_numpy

M = 4  # CSA compression rate


def visible_np(s: int, t: int) -> np.ndarray:
    """[S,T]: entry w is visible to query i iff w < (i + 1) // m."""
    return np.arange(t)[None, :] < ((np.arange(s) + 1) // M)[:, None]


def kl_from_target_np(mass: np.ndarray, scores: np.ndarray, cand: np.ndarray) -> float:
    """Plain formula: p = mass on the candidates, L1-normalised; mean over rows with candidates
    of KL(p || softmax of the scores over the candidates)."""
    kls = []
    for b, t in zip(*np.nonzero(cand.any(-1)), strict=True):
        c = cand[b, t]
        p = mass[b, t, c] / mass[b, t, c].sum()
        sc = scores[b, t, c].astype(np.float64)
        log_q = sc - sc.max() - np.log(np.exp(sc - sc.max()).sum())
        nz = p > 0
        kls.append(np.sum(p[nz] * (np.log(p[nz]) - log_q[nz])))
    return float(np.mean(kls)) if kls else 0.0


def hf_attention_probs(hf_layer, cfg, x) -> np.ndarray:
    """HF's per-head attention probabilities [B,H,S,S+T] (sink dropped)."""
    got = {}
    handle = hf_layer.register_forward_hook(lambda _m, _i, out: got.update(w=out[1].numpy()))
    out, _, _ = run_hf_v4(hf_layer, cfg, x)
    handle.remove()
    return out, got["w"]


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_layer_loss_matches_hf_probabilities(stage):
    """aux["indexer_loss"] == numpy KL of HF's own attention probabilities vs HF's scores.

    Dense warm-up == an HF layer whose top-k covers every entry (it then attends to all visible
    entries), so the layer output must match that one too.
    """
    b, s, k = 2, 22, 3
    t = s // M
    cfg = hf_v4_config(tiny_v4("csa", sliding_window=6, index_topk=k))
    hf_layer = random_hf_v4_layer(cfg, seed=1)
    x = np.random.default_rng(1).normal(size=(b, s, cfg.hidden_size)).astype(np.float32)
    layer = load_v4_attention(state_dict_numpy(hf_layer), cfg, 0, indexer_loss=stage)
    y, aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, x)

    scores = run_hf_v4(hf_layer, cfg, x)[2]
    vis = np.broadcast_to(visible_np(s, t), (b, s, t))
    if stage == "dense":
        hf_layer.compressor.indexer.index_topk = 64  # HF then selects every visible entry
        want_y, probs = hf_attention_probs(hf_layer, cfg, x)
        np.testing.assert_allclose(np.asarray(y), want_y, rtol=0, atol=1e-4 * np.abs(want_y).max())
        cand = vis
    else:
        assert untied_rows(scores, k, M).all()  # so HF's and our selections agree exactly
        _, probs = hf_attention_probs(hf_layer, cfg, x)
        sel = np.asarray(aux["selection"])
        cand = np.zeros((b, s, t), bool)
        for bi, si, j in zip(*np.nonzero(sel >= 0), strict=True):
            cand[bi, si, sel[bi, si, j]] = True
        assert (cand.sum(-1) == np.minimum(vis.sum(-1), k)).all()
    mass = probs[..., s:].sum(axis=1).astype(np.float64)
    assert (mass[~cand] == 0).all()  # HF attends to exactly our candidates
    want = kl_from_target_np(mass, scores, cand)
    np.testing.assert_allclose(float(aux["indexer_loss"]), want, rtol=1e-4)


def small_layer(stage: str, kind: str = "csa", s: int = 22, **options):
    cfg = hf_v4_config(tiny_v4(kind, sliding_window=6, index_topk=3))
    layer = load_v4_attention(
        state_dict_numpy(random_hf_v4_layer(cfg, seed=2)), cfg, 0, indexer_loss=stage, **options
    )
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, s, cfg.hidden_size)), jnp.float32)
    return layer, x


def grads_by_leaf(fn, layer, x) -> dict[str, np.ndarray]:
    g = eqx.filter_jit(eqx.filter_grad(fn))(layer, x)
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(g, eqx.is_inexact_array))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def indexer_loss_of(layer, x):
    return layer(x, return_aux=True)[1]["indexer_loss"]


def output_loss_of(layer, x):
    y = layer(x)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)


def assert_trains_only(grads: dict[str, np.ndarray], indexer: set[str]) -> None:
    """``grads`` (an indexer loss' gradient per leaf) is finite, non-zero somewhere in each of
    the ``indexer`` leaves (all among ``grads``, which has others too) and zero elsewhere."""
    assert set(grads) >= indexer and len(grads) > len(indexer)
    for name, g in grads.items():
        assert np.isfinite(g).all(), name
        if name in indexer:
            assert np.abs(g).max() > 0, f"indexer leaf {name} gets no gradient"
        else:
            assert (g == 0).all(), f"{name} gets gradient from the indexer loss"


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_loss_trains_only_the_indexer(stage):
    layer, x = small_layer(stage)
    grads = grads_by_leaf(indexer_loss_of, layer, x)
    # the indexer's heads and its own key compressor
    indexer = {n for n in grads if n.startswith(".selection_source.indexer.")}
    assert len(indexer) == 6
    assert_trains_only(grads, indexer)


@pytest.mark.parametrize("stage", ["off", "dense", "sparse"])
def test_output_gives_the_indexer_no_gradient(stage):
    layer, x = small_layer(stage)
    grads = grads_by_leaf(output_loss_of, layer, x)
    for name, g in grads.items():
        if name.startswith(".selection_source.indexer."):
            assert (g == 0).all(), f"{name} gets gradient from the layer output"
    assert (
        np.abs(grads[".block.q_a_proj"]).max() > 0
        and np.abs(grads[".entry_source.compressor.kv_proj"]).max() > 0
    )


def test_loss_absent_when_off_or_without_indexer():
    for stage, kind in [("off", "csa"), ("sparse", "sliding"), ("dense", "hca")]:
        layer, x = small_layer(stage, kind=kind, s=9)
        assert jax.eval_shape(indexer_loss_of, layer, x) is None


@pytest.mark.parametrize("stage, s", [("dense", 3), ("sparse", 5)])
def test_no_candidates_no_nan(stage, s):
    """S < m: no entry at all; S = 5: only the last rows see one entry. Loss and grads finite."""
    layer, x = small_layer(stage, s=s)
    loss = eqx.filter_jit(indexer_loss_of)(layer, x)
    assert np.isfinite(float(loss))
    if s < M:
        assert float(loss) == 0.0
    for name, g in grads_by_leaf(indexer_loss_of, layer, x).items():
        assert np.isfinite(g).all(), name


def test_loss_is_zero_when_the_indexer_matches_the_target():
    """KL(p || softmax(log p)) = 0; and a single candidate always gives 0."""
    rng = np.random.default_rng(3)
    b, s, h, d, t = 1, 9, 2, 4, 5
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    lse = jnp.asarray(rng.normal(size=(b, s, h)) + 3.0, jnp.float32)
    cand = jnp.asarray(rng.random((b, s, t)) < 0.6)
    logits = jnp.einsum("bshd,btd->bsht", q, keys) * 0.5 - lse[..., None]
    log_mass = jax.nn.logsumexp(logits, axis=2)
    loss = indexer_kl_loss(q, keys, lse, log_mass, cand, 0.5)
    assert abs(float(loss)) < 1e-6
    one = jnp.zeros((b, s, t), bool).at[:, :, 2].set(True)
    assert abs(float(indexer_kl_loss(q, keys, lse, jnp.zeros((b, s, t)), one, 0.5))) < 1e-6
