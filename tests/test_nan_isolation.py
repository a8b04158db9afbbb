"""A NaN or Inf token stays inside its document and after its position (causal).

One packed row holds three documents; each batch row puts NaN or Inf at the first, a middle or
the last token of the middle document. The reference is the same layer on the clean input: the
other documents' outputs, and the bad document's tokens before the bad one, must be equal to it;
the bad token's own output must be non-finite (nothing is silently swallowed).

Gradients: with a NaN *in x*, parameter gradients are NaN by IEEE arithmetic whatever the layer
does (``dW = Σ_t x_t g_tᵀ`` holds ``NaN · 0``), so the forward test checks the gradient w.r.t.
the other documents' rows of ``x`` (finite, equal to the clean one); the ``extend`` test checks
parameter gradients of a decode step whose cache holds the bad document.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import csa_eqx
from csa_eqx.presets import tiny_v4, tiny_v32

SEQ = 32
SEGMENTS = np.array([0] * 10 + [1] * 16 + [2] * 6)  # the bad document is 1: tokens 10..25
BAD_DOC = SEGMENTS == 1
CASES = [(v, p) for v in (np.nan, np.inf) for p in (10, 17, 25)]  # first, middle, last token

# every attention path: band window, dense entries (HCA, CSA warm-up), masked picks (CSA /
# V3.2 with few entries per pick), gathered picks (more entries per pick); 8-query blocks
BLOCKS = csa_eqx.Execution(query_block=8)
DENSE = csa_eqx.Execution(query_block=8, indexer_loss="dense")
LAYERS = {
    "sliding": ("v4", tiny_v4("sliding"), BLOCKS),
    "hca": ("v4", tiny_v4("hca"), BLOCKS),
    "csa-masked-picks": ("v4", tiny_v4("csa"), BLOCKS),
    "csa-gathered-picks": ("v4", tiny_v4("csa", index_topk=1), BLOCKS),
    "csa-dense": ("v4", tiny_v4("csa"), DENSE),
    "v32-masked-picks": ("v32", tiny_v32(), BLOCKS),
    "v32-gathered-picks": ("v32", tiny_v32(index_topk=4), BLOCKS),
    "v32-dense": ("v32", tiny_v32(), DENSE),
}


def _layer(name):
    family, config, execution = LAYERS[name]
    cls = csa_eqx.V4Attention if family == "v4" else csa_eqx.V32Attention
    return cls(config, key=jax.random.key(0), execution=execution)


def _inputs():
    """Clean ``x [6, S, 64]`` and the same with one bad token per row (``CASES``)."""
    clean = jax.random.normal(jax.random.key(1), (len(CASES), SEQ, 64))
    bad = clean
    for row, (value, pos) in enumerate(CASES):
        bad = bad.at[row, pos, ::3].set(value)
    return clean, bad


def _check_isolated(clean, bad, outputs=True):
    """``bad [B, S, ...]`` against the clean run: equal on the other documents and on the bad
    document's tokens before the bad one; for ``outputs``, non-finite at the bad token."""
    clean, bad = np.asarray(clean), np.asarray(bad)
    for row, (_, pos) in enumerate(CASES):
        same = ~BAD_DOC | (np.arange(SEQ) < pos)
        np.testing.assert_array_equal(bad[row, same], clean[row, same], err_msg=f"row {row}")
        if outputs:
            assert not np.isfinite(bad[row, pos]).any(), f"row {row}: the bad token is finite"


@pytest.mark.parametrize("name", list(LAYERS))
def test_forward_isolates_nonfinite_tokens(name):
    layer = _layer(name)
    clean, bad = _inputs()
    seg = jnp.broadcast_to(jnp.asarray(SEGMENTS), clean.shape[:2])

    def loss(x):  # the other documents' outputs only
        y, aux = layer(x, segment_ids=seg, return_aux=True)
        return jnp.sum(jnp.where(BAD_DOC[:, None], 0.0, y) ** 2), (y, aux["selection"])

    run = eqx.filter_jit(jax.grad(loss, has_aux=True))  # one compile: outputs and gradients
    (g_clean, (y_clean, sel_clean)), (g_bad, (y_bad, sel_bad)) = run(clean), run(bad)
    _check_isolated(y_clean, y_bad)
    if sel_clean is not None:  # the indexer's picks too (NaN scores of invisible entries)
        _check_isolated(sel_clean, sel_bad, outputs=False)
    g_clean, g_bad = np.asarray(g_clean), np.asarray(g_bad)
    assert np.isfinite(g_bad[:, ~BAD_DOC]).all()
    np.testing.assert_allclose(g_bad[:, ~BAD_DOC], g_clean[:, ~BAD_DOC], rtol=1e-6, atol=1e-7)


PREFILL = 24  # then one token at a time: tokens 24, 25 end the bad document, 26.. are doc 2


@pytest.mark.parametrize("name", ["sliding", "hca", "csa-masked-picks", "v32-masked-picks"])
def test_extend_isolates_nonfinite_tokens(name):
    layer = _layer(name)
    clean, bad = _inputs()
    seg = jnp.broadcast_to(jnp.asarray(SEGMENTS), clean.shape[:2])
    extend = eqx.filter_jit(lambda m, x, c, s: m.extend(x, c, segment_ids=s))

    def run(x):
        y, cache = extend(
            layer, x[:, :PREFILL], layer.init_cache(len(CASES), SEQ), seg[:, :PREFILL]
        )
        steps, caches = [y], []
        for t in range(PREFILL, SEQ):
            caches.append(cache)
            y, cache = extend(layer, x[:, t : t + 1], cache, seg[:, t : t + 1])
            steps.append(y)
        return jnp.concatenate(steps, axis=1), caches

    (clean_y, _), (bad_y, bad_caches) = run(clean), run(bad)
    _check_isolated(clean_y, bad_y)

    # a decode step of document 2 after the bad document: finite gradients for every parameter
    t = SEQ - 1
    step = eqx.filter_grad(
        lambda m: jnp.sum(extend(m, bad[:, t : t + 1], bad_caches[-1], seg[:, t : t + 1])[0] ** 2)
    )
    grads = jax.tree.leaves(step(layer))
    assert grads and all(np.isfinite(np.asarray(g)).all() for g in grads)
