"""The scoring kernel seam through the layers: ``Execution(scorer=...)`` reaches every
selection and loss path of a whole layer (V4 CSA, V3.2), and the layer scores through it.

What each scorer computes (scores, bf16 rounding, gradients, gathered scores) is the scorer
family's conformance suite (tests/test_conformance_scorer.py); that every selection strategy
scores through its problem's scorer is the selection suite's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx._numerics.base import V4_FORMATS
from csa_eqx._topk import exact_topk


class NegatedScorer(ce.AbstractScorer):
    """The reference's scores, negated: a selection that used another scorer would differ."""

    def scores(self, q, weights, keys, *, head_chunk=0, score_dtype=None):
        kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)
        return -ce.indexer_scores(q, weights, keys, **kw)


RUN = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))


def v32_layer():
    cfg = ce.V32AttentionConfig(
        hidden_size=32, num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, index_n_heads=4, index_head_dim=16, index_topk=5,
    )  # fmt: skip
    return randomise(ce.V32Attention(cfg, key=jax.random.key(0)), 2)


@pytest.mark.parametrize("kind", ["v4-csa", "v32"])
def test_layer_selection_through_execution(kind):
    """``Execution(scorer=BlockedScorer(...))`` with the streaming selection and loss: the
    layer's selection bitwise equal to the reference scorer's, outputs and the sparse-stage
    loss equal up to rounding; ``NegatedScorer`` changes the selection (the layer uses it)."""
    if kind == "v32":
        layer = v32_layer()
    else:
        layer = randomise(ce.V4Attention(tiny("csa", index_topk=3), key=jax.random.key(0)), 1)
    x = jax.random.normal(jax.random.key(5), (2, 30, 32))
    seg = jnp.asarray([[0] * 13 + [1] * 17, [0] * 30], jnp.int32)
    ref_y, ref_aux = RUN(layer.with_execution(ce.Execution(indexer_loss="sparse")), x, seg)
    sel = np.asarray(ref_aux["selection"])
    assert (sel >= 0).any()
    ex = ce.Execution(
        selection=ce.StreamingSelection(key_block=3, query_block=4),
        scorer=ce.BlockedScorer(4),
        indexer_kl=ce.StreamingIndexerLoss(key_block=4),
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
