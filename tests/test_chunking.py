"""Head-chunked indexer scoring and KL target (qk_head_chunk_size) == unchunked."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from csa_eqx import (
    Execution,
    V4Attention,
    V4AttentionConfig,
    indexer_kl_loss,
    indexer_scores,
    select_topk,
)
from csa_eqx._loss.kl import selection_mask
from csa_eqx.hf import load_v4_attention
from csa_eqx.presets import tiny_v4
from csa_eqx.testing import hf_v4_config, random_hf_v4_layer, state_dict_numpy

B, S, H, D, T, K = 2, 24, 8, 4, 6, 3  # D < T: only the score tensor reaches B·S·H·T


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def largest_intermediate(fn, *args) -> int:
    """Element count of the largest value in fn's jaxpr, nested jaxprs (scan, remat) included."""

    def walk(jaxpr) -> int:
        best = 0
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                best = max(best, int(np.prod(v.aval.shape)) if hasattr(v.aval, "shape") else 0)
            for p in eqn.params.values():
                for sub in p if isinstance(p, list | tuple) else [p]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        best = max(best, walk(sub))
        return best

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def indexer_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, S, H)) * H**-0.5, jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    return q, w, k


def visible() -> jnp.ndarray:
    vis = np.arange(T)[None, :] < ((np.arange(S) + 1) // 4)[:, None]
    return jnp.broadcast_to(jnp.asarray(vis), (B, S, T))


def score_objective(chunk):
    def f(q, w, k):
        return jnp.sum(jnp.tanh(indexer_scores(q, w, k, head_chunk=chunk)) * jnp.arange(T))

    return f


@pytest.mark.parametrize("chunk", [1, 2, H])
def test_indexer_scores_chunked_equal_unchunked(chunk):
    q, w, k = indexer_inputs()
    want = indexer_scores(q, w, k)
    got = jax.jit(lambda *a: indexer_scores(*a, head_chunk=chunk))(q, w, k)
    assert rel(got, want) <= 1e-6
    vis = visible()
    np.testing.assert_array_equal(select_topk(got, vis, K), select_topk(want, vis, K))
    g_want = jax.grad(score_objective(0), argnums=(0, 1, 2))(q, w, k)
    g_got = jax.jit(jax.grad(score_objective(chunk), argnums=(0, 1, 2)))(q, w, k)
    for a, b in zip(g_got, g_want, strict=True):
        assert rel(a, b) <= 1e-5
    if chunk < H:  # [B, S, H, T] never exists, forward or backward
        grad_fn = jax.grad(score_objective(chunk), argnums=(0, 1, 2))
        assert largest_intermediate(grad_fn, q, w, k) < B * S * H * T
        assert largest_intermediate(jax.grad(score_objective(0)), q, w, k) >= B * S * H * T


def kl_inputs(seed=1):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    lse = jnp.asarray(rng.normal(size=(B, S, H)) + 4.0, jnp.float32)
    scores = jnp.asarray(rng.normal(size=(B, S, T)), jnp.float32)
    sel = select_topk(jnp.asarray(rng.normal(size=(B, S, T)), jnp.float32), visible(), K)
    return q, keys, lse, scores, selection_mask(sel, T)


@pytest.mark.parametrize("chunk", [1, 2, H])
def test_kl_loss_chunked_equal_unchunked(chunk):
    q, keys, lse, scores, cand = kl_inputs()

    def loss(chunk):
        return lambda q, sc: indexer_kl_loss(q, keys, lse, sc, cand, 0.25, head_chunk=chunk)

    want, g_want = jax.value_and_grad(loss(0), argnums=1)(q, scores)
    got, g_got = jax.jit(jax.value_and_grad(loss(chunk), argnums=1))(q, scores)
    assert rel(got, want) <= 1e-6 and float(want) > 0
    assert rel(g_got, g_want) <= 1e-5
    assert (jax.grad(loss(chunk))(q, scores) == 0).all()  # the target is detached
    if chunk < H:
        assert largest_intermediate(jax.grad(loss(chunk), argnums=1), q, scores) < B * S * H * T


def test_chunk_must_divide_heads():
    q, w, k = indexer_inputs()
    with pytest.raises(ValueError, match="head_chunk=3"):
        indexer_scores(q, w, k, head_chunk=3)
    q, keys, lse, scores, cand = kl_inputs()
    with pytest.raises(ValueError, match="head_chunk=3"):
        indexer_kl_loss(q, keys, lse, scores, cand, 0.25, head_chunk=3)
    with pytest.raises(ValueError, match="qk_head_chunk_size"):
        V4Attention(
            V4AttentionConfig(hidden_size=32, num_heads=6, index_n_heads=4, o_groups=2),
            key=jax.random.key(0),
            execution=Execution(qk_head_chunk_size=4, indexer_loss="sparse"),
        )


@pytest.mark.parametrize("stage, chunks", [("sparse", (1, 4)), ("dense", (2,))])
def test_layer_chunked_equal_unchunked(stage, chunks):
    """The whole V4 CSA layer (H = 4): same output, selection, loss and loss gradients."""
    cfg = hf_v4_config(tiny_v4("csa", sliding_window=6, index_topk=3))  # 4 heads, 4 indexer heads
    state = state_dict_numpy(random_hf_v4_layer(cfg, seed=4))
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 22, cfg.hidden_size)), jnp.float32)

    @eqx.filter_jit
    def run(layer, x):
        (loss, (y, sel)), g = eqx.filter_value_and_grad(
            lambda m: (lambda y, aux: (aux["indexer_loss"], (y, aux["selection"])))(
                *m(x, return_aux=True)
            ),
            has_aux=True,
        )(layer)
        return loss, y, sel, g.indexer

    want = run(load_v4_attention(state, cfg, 0, indexer_loss=stage), x)
    for chunk in chunks:
        got = run(load_v4_attention(state, cfg, 0, indexer_loss=stage, qk_head_chunk_size=chunk), x)
        assert rel(got[0], want[0]) <= 1e-6
        assert rel(got[1], want[1]) <= 1e-6
        np.testing.assert_array_equal(got[2], want[2])
        for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3]), strict=True):
            assert rel(a, b) <= 1e-5
