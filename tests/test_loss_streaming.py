"""The streaming indexer KL loss: it forms no ``[B, S, T]`` tensor, a whole layer's loss and
indexer gradients equal the dense path's, and the automatic choice streams long sequences
only (its values and gradients against the KL formula, with every other loss strategy:
tests/test_conformance_loss.py).
"""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import primitives, walk_avals

import csa_eqx as ce
from csa_eqx import (
    V4Attention,
    entry_layout,
    entry_visibility,
    indexer_kl_loss,
    indexer_scores,
    projected_indexer_kl_loss,
    select_topk,
)
from csa_eqx._loss.kl import selection_mask
from csa_eqx.presets import tiny_v4

H, D, H_I, D_I, HIDDEN = 4, 6, 4, 8, 12


def problem(seed: int, b: int, s: int, m: int, packed: bool):
    """Random main-attention and indexer inputs; some rows see no entry (foreign segment)."""
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(0, 3, (b, s)), axis=1) if packed else np.zeros((b, s), np.int64)
    layout = entry_layout(jnp.asarray(seg, jnp.int32), m)
    t = layout.end.shape[1]
    qseg = seg.copy()
    qseg[rng.random((b, s)) < 0.15] = 99  # rows with no candidate
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    params = {"wq": f(H_I * D_I, HIDDEN) * 0.5, "ww": f(H_I, HIDDEN), "keys": f(b, t, D_I)}
    fixed = {
        "x": f(b, s, HIDDEN),
        "q": f(b, s, H, D),
        "entries": f(b, t, D),
        "lse": f(b, s, H) + 2.0,
        "qidx": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
        "qseg": jnp.asarray(qseg, jnp.int32),
        "layout": layout,
    }
    return params, fixed


def project_with(params):
    def project(x):
        b, s, _ = x.shape
        q = jnp.einsum("bsi,oi->bso", x, params["wq"]).reshape(b, s, H_I, D_I)
        return q, jnp.einsum("bsi,hi->bsh", x, params["ww"]) * H_I**-0.5

    return project


def dense_loss(params, fx, selection=None):
    scores = indexer_scores(*project_with(params)(fx["x"]), params["keys"])
    if selection is None:
        cand = entry_visibility(fx["qidx"], fx["qseg"], fx["layout"])
    else:
        cand = selection_mask(selection, params["keys"].shape[1])
    return indexer_kl_loss(fx["q"], fx["entries"], fx["lse"], scores, cand, 0.3)


def streaming_loss(params, fx, selection=None, key_block=0, query_block=0):
    visibility = ce.Visibility(fx["qidx"], fx["qseg"], fx["layout"])
    problem = ce.SelectionProblem(project_with(params), (fx["x"],), params["keys"], visibility)
    target = ce.AttentionTarget(fx["q"], fx["entries"], fx["lse"], 0.3)
    method = (
        ce.StreamingIndexerLoss(key_block=key_block, query_block=query_block)
        if key_block
        else ce.AutoIndexerLoss(query_block=query_block)
    )
    return projected_indexer_kl_loss(problem, target, selection, method=method)


def some_selection(params, fx, k, seed):
    scores = jax.random.normal(jax.random.key(seed), fx["qidx"].shape + params["keys"].shape[1:2])
    return select_topk(scores, entry_visibility(fx["qidx"], fx["qseg"], fx["layout"]), k)


@pytest.mark.parametrize("sparse", [False, True])
def test_streaming_forms_no_score_matrix(sparse):
    """fwd+bwd jaxpr holds no float array as large as [B, S, T] (nor the [B, S, H_I, d_I]
    queries), while the dense path does."""
    b, s, m = 1, 512, 4
    params, fx = problem(7, b, s, m, True)
    t = params["keys"].shape[1]
    sel = some_selection(params, fx, 16, 7) if sparse else None

    def floats(fn):
        jaxpr = jax.make_jaxpr(jax.grad(fn))(params).jaxpr
        return [a for a in walk_avals(jaxpr) if jnp.issubdtype(a.dtype, jnp.floating)]

    assert max(a.size for a in floats(lambda p: dense_loss(p, fx, sel))) >= b * s * t
    stream = floats(lambda p: streaming_loss(p, fx, sel, key_block=32, query_block=64))
    assert max(a.size for a in stream) < b * s * t // 2
    assert (b, s, H_I, D_I) not in {a.shape for a in stream}


def test_v4_layer_streaming_loss_matches_dense():
    """The layer's indexer loss and its indexer gradients, both stages: streaming (key blocks
    set) == dense, packed input."""
    small = dict(hidden_size=32, head_dim=16, q_lora_rank=16, o_lora_rank=8, sliding_window=4)
    config = tiny_v4("csa", **small, index_head_dim=8, index_topk=3)
    x = jax.random.normal(jax.random.key(0), (2, 30, 32))
    seg = jnp.asarray(np.repeat([[0] * 17 + [1] * 13], 2, 0), jnp.int32)

    def loss(indexer, layer):
        layer = eqx.tree_at(lambda a: a.indexer, layer, indexer)
        return layer(x, segment_ids=seg, return_aux=True)[1]["indexer_loss"]

    for stage in ["dense", "sparse"]:
        out = []
        for tiles in [{}, {"indexer_key_block": 2, "query_block": 8}]:
            ex = ce.Execution.from_options(indexer_loss=stage, qk_head_chunk_size=2, **tiles)
            layer = V4Attention(config, key=jax.random.key(1), execution=ex)
            out.append(eqx.filter_jit(eqx.filter_value_and_grad(loss))(layer.indexer, layer))
        (want, want_g), (got, got_g) = out
        assert float(want) > 0.01
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        pairs = zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True)
        for a, w in pairs:
            scale = np.abs(np.asarray(w)).max()
            assert scale > 0
            np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-4, atol=1e-6 * scale)


def test_automatic_choice_streams_long_sequences_only():
    """Without block sizes: dense path (no loop) when short, streaming loops when long."""
    for s, streams in [(64, False), (8192, True)]:
        params, fx = problem(8, 1, s, 4, False)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p, fx=fx: streaming_loss(p, fx)))(params).jaxpr
        assert ("while" in primitives(jaxpr)) == streams
