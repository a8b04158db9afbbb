"""A selection strategy chosen through ``Execution`` reaches the whole layer: the default and a
forced one (the row-sharded streaming top-k, the most involved) select what an exhaustive
numpy top-k of the layer's own indexer scores selects (ties to the lower index), with equal
outputs and indexer losses. Every strategy on its own, and every way of reading picks and the
window: the conformance suites (tests/test_conformance_selection.py,
tests/test_conformance_attention.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx._backend import GPU_TILES as ACCELERATOR_TILES

FORCED = ce.ShardedSelection(ce.StreamingSelection(key_block=3))
RUN = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))


def brute_topk(scores, visible, k):
    """Exhaustive: the k highest visible scores, ties to the lower index, ascending order."""
    out = np.full(scores.shape[:2] + (k,), -1)
    for b, t in np.ndindex(scores.shape[:2]):
        idx = np.flatnonzero(visible[b, t])
        best = sorted(idx, key=lambda j: (-scores[b, t, j], j))[:k]
        out[b, t, : len(best)] = sorted(best)
    return out


def inputs():
    x = jax.random.normal(jax.random.key(5), (2, 30, 32))
    seg = jnp.asarray([[0] * 13 + [1] * 17, [0] * 30], jnp.int32)
    return x, seg


def reference_selection(layer, x, seg):
    """The selection from the layer's own projections scored in numpy, top-k by brute force."""
    c, ix = layer.config, layer.indexer
    positions = ce.segment_positions(seg)
    qr = layer.block.project_qkv(x, positions)[0]
    layout = ce.entry_layout(seg, c.compress_rate)
    q = np.asarray(ix.queries(qr, positions), np.float64)
    w = np.asarray(ix.head_weights(x), np.float64) * c.index_head_dim**-0.5
    keys = np.asarray(layer.index_compressor(x, positions, layout), np.float64)
    scores = np.einsum("bsh,bsht->bst", w, np.maximum(np.einsum("bshd,btd->bsht", q, keys), 0))
    qi = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    visible = np.asarray(ce.entry_visibility(qi, seg, layout))
    return brute_topk(scores, visible, c.index_topk)


@pytest.mark.parametrize("stage", ["off", "sparse"])
def test_selection_strategies_agree(stage):
    base = randomise(ce.V4Attention(tiny("csa", index_topk=3), key=jax.random.key(0)), 1)
    x, seg = inputs()
    want = reference_selection(base, x, seg)
    assert (want >= 0).any() and (want == -1).any()
    ref_y, ref_aux = RUN(base.with_execution(ce.Execution(indexer_loss=stage)), x, seg)
    np.testing.assert_array_equal(ref_aux["selection"], want)
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        y, aux = RUN(
            base.with_execution(ce.Execution(selection=FORCED, indexer_loss=stage)), x, seg
        )
    np.testing.assert_array_equal(aux["selection"], want)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    if stage == "sparse":
        np.testing.assert_allclose(aux["indexer_loss"], ref_aux["indexer_loss"], rtol=1e-5)


def test_auto_strategies_choose_by_size():
    """The automatic choices, and the one place their thresholds live."""
    auto, loss = ce.AutoSelection(), ce.AutoIndexerLoss()
    assert isinstance(auto.choose(1, 64, 16, 4), ce.DenseSelection)
    assert isinstance(auto.choose(1, 16384, 4096, 64), ce.StreamingSelection)
    assert isinstance(loss.choose(1, 64, 16, 4), ce.DenseIndexerLoss)
    assert isinstance(loss.choose(1, 16384, 4096, 64), ce.StreamingIndexerLoss)
    # one rule, by the tile budget the problem carries (CPU: 2^24; accelerators: 2^26)
    assert isinstance(auto.choose(1, 1024, 1024, 16), ce.DenseSelection)  # 2^24
    assert isinstance(auto.choose(1, 1024, 1024, 32), ce.StreamingSelection)
    assert isinstance(auto.choose(1, 1024, 1024, 32, ACCELERATOR_TILES), ce.DenseSelection)
    assert isinstance(loss.choose(1, 1024, 1024, 32, ACCELERATOR_TILES), ce.DenseIndexerLoss)
    assert isinstance(ce.AutoPicks().choose(2048, 512), ce.MaskedPicks)
    assert isinstance(ce.AutoPicks().choose(2049, 512), ce.GatheredPicks)


def test_shard_indexer_acts_must_divide_heads():
    layer = randomise(ce.V4Attention(tiny("csa"), key=jax.random.key(0)), 1)
    ex = ce.Execution(indexer_heads_axis="tensor")
    x, seg = inputs()
    mesh = jax.set_mesh(jax.make_mesh((8,), ("tensor",)))
    with mesh, pytest.raises(ValueError, match="'tensor' has 8 devices.*4 indexer heads"):
        layer.with_execution(ex)(x, segment_ids=seg)
