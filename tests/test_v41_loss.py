"""The V4.1 indexer KL loss (docs/v41.md, "Training the indexers"): against the KL formula in
plain numpy over the main attention's probabilities, dense against streaming, and where its
gradient goes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_v41_config import SIZES
from test_v41_layers import candidate_entries

import csa_eqx as ce

# layer 0: a ratio-2 KV source and the candidate source; 1: a reindex consumer whose filter
# bites (S = 20: 10 entries in 5 blocks of 2, 3 kept: 6 candidates, k = 4); 2: reuse
CONFIG = ce.V41AttentionConfig(
    compress_ratios=(2, 2, 2),
    kv_source_layers=(0,),
    index_source_layers=(0, 1),
    candidate_source_layer=0,
    candidate_topk_blocks=3,
    candidate_block_size=2,
    **SIZES,
)
B, S, M = 2, 20, 2
INDEX_SOURCES = (0, 1)
STREAMING = ce.StreamingIndexerLoss(key_block=4, query_block=8)


def _stack(indexer_kl):
    """The stack with sharper indexer scores and non-zero sinks (a loss well away from 0)."""
    keys = jax.random.split(jax.random.key(0), CONFIG.num_layers)
    execution = ce.Execution(indexer_kl=indexer_kl)
    layers = [ce.V41Attention(CONFIG, i, key=k, execution=execution) for i, k in enumerate(keys)]
    layers = [
        eqx.tree_at(
            lambda m: m.block.sinks, layer, 0.5 * jax.random.normal(k, layer.block.sinks.shape)
        )
        for layer, k in zip(layers, keys, strict=True)
    ]
    for i in INDEX_SOURCES:
        indexer = lambda m: (m.indexer.q_b_proj, m.indexer.weights_proj)  # noqa: E731
        layers[i] = eqx.tree_at(indexer, layers[i], replace_fn=lambda w: 8 * w)
    return layers


def stack_loss(inputs, stage):
    """The sum of the index sources' losses over ``inputs = (layers, x)``, and what the numpy
    reference needs: the layers' own projections (no loss code) and what they published."""
    layers, x = inputs
    _, published, auxes = ce.run_v41_stack(layers, x, return_aux=True, indexer_loss=stage)
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    parts = []
    for i in INDEX_SOURCES:
        layer = layers[i]
        qr, q, kv = layer.block.project_qkv(x, positions)
        parts.append(
            dict(
                q=q,
                kv=kv,
                sinks=layer.block.sinks,
                index_q=layer.indexer.queries(qr, positions),
                weights=layer.indexer.head_weights(x),
                entries=published[i].entries,
                keys=published[i].keys,
                selection=auxes[i]["selection"],
                loss=auxes[i]["indexer_loss"],
            )
        )
    assert auxes[2]["indexer_loss"] is None and auxes[2]["selection"] is auxes[1]["selection"]
    total = sum(a["indexer_loss"] for a in auxes if a["indexer_loss"] is not None)
    return total, (parts, published[0].candidates)


loss_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(stack_loss, has_aux=True))


def kl_np(q, kv, entries, sinks, index_q, weights, keys, reads, cands) -> float:
    """docs/concepts.md's formula in float64: each head's softmax over its window, the entries
    it ``reads`` and its sink; the mass on the candidates ``cands`` summed over heads and
    L1-normalised is ``p_t``; ``mean_t KL(p_t ‖ softmax(I_t))`` over the queries with a
    candidate, ``I = d_I^-1/2 Σ_h w_h ReLU(q_h·k)``."""
    q, kv, entries, index_q, weights, keys = (
        np.asarray(a, np.float64) for a in (q, kv, entries, index_q, weights, keys)
    )
    scale = q.shape[-1] ** -0.5
    t = np.arange(S)
    window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - SIZES["sliding_window"])
    lw = np.exp(np.einsum("bshd,bjd->bshj", q, kv) * scale) * window[None, :, None]
    le = np.exp(np.einsum("bshd,btd->bsht", q, entries) * scale) * reads[:, :, None]
    den = lw.sum(-1) + le.sum(-1) + np.exp(np.asarray(sinks, np.float64))
    mass = (le / den[..., None]).sum(2)
    logits = np.maximum(np.einsum("bshd,btd->bsht", index_q, keys), 0)
    scores = np.einsum("bsh,bsht->bst", weights, logits) * index_q.shape[-1] ** -0.5
    kls = []
    for b, s in zip(*np.nonzero(cands.any(-1)), strict=True):
        c = cands[b, s]
        p = mass[b, s, c] / mass[b, s, c].sum()
        log_q = scores[b, s, c] - np.log(np.exp(scores[b, s, c]).sum())
        kls.append(np.sum(p * (np.log(p) - log_q)))
    return float(np.mean(kls))


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_losses_match_numpy_and_streaming_and_train_only_indexers(stage):
    """Each index source's loss against ``kl_np``: the candidate source over every visible
    entry (dense) or its picks; the consumer over its visible candidates (dense) or its picks.
    The streaming strategy gives the same loss and gradient; the gradient reaches the
    indexers' weights (the key projection of layer 0 included) and nothing else."""
    layers = _stack(ce.DenseIndexerLoss())
    x = jax.random.normal(jax.random.key(1), (B, S, CONFIG.hidden_size))
    (total, (parts, candidates)), grads = loss_and_grad((layers, x), stage)
    visible = np.arange(S // M)[None, None, :] < ((np.arange(S) + 1) // M)[None, :, None]
    visible = np.broadcast_to(visible, (B, S, S // M))
    within = visible & candidate_entries(candidates, CONFIG.candidate_block_size, S // M)
    assert (within.sum(-1) < visible.sum(-1)).any()  # the filter bites
    for part, dense_cands in zip(parts, (visible, within), strict=True):
        sel = np.asarray(part["selection"])
        picked = (sel[..., None] == np.arange(S // M)).any(-2)
        assert (picked <= dense_cands).all()
        reads, cands = (visible, dense_cands) if stage == "dense" else (picked, picked)
        arrays = {k: np.asarray(v) for k, v in part.items() if k not in ("selection", "loss")}
        want = kl_np(**arrays, reads=reads, cands=cands)
        assert want > 5e-3  # well away from 0 (the comparisons below are relative)
        np.testing.assert_allclose(float(part["loss"]), want, rtol=1e-5)

    layers_s = [layer.with_execution(ce.Execution(indexer_kl=STREAMING)) for layer in layers]
    (total_s, _), grads_s = loss_and_grad((layers_s, x), stage)
    np.testing.assert_allclose(float(total_s), float(total), rtol=1e-5)
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    leaves_s = jax.tree_util.tree_leaves(grads_s)
    trained = set()
    for (path, g), g_s in zip(leaves, leaves_s, strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(g_s, g, rtol=1e-4, atol=1e-6 * np.abs(g).max(), err_msg=name)
        if np.abs(g).max() > 0:
            trained.add(name)
    assert trained == {
        "[0][0].entry_source.compressor.key_proj",
        "[0][0].entry_source.compressor.key_norm",
        "[0][0].selection_source.indexer.q_b_proj",
        "[0][0].selection_source.indexer.weights_proj",
        "[0][1].selection_source.indexer.q_b_proj",
        "[0][1].selection_source.indexer.weights_proj",
    }
