"""What the context- and head-parallel tests share: tiny random layers, packed segments, the
comparison with the single-device layer, and a loader option checked against HF transformers."""

import jax
import jax.numpy as jnp
import numpy as np
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx import hf as ce_hf
from csa_eqx.presets import tiny_v4, tiny_v32


def packed_segments(b, s):
    """Row 0: packed documents of uneven lengths crossing chunk boundaries; row 1: one
    document (unpacked)."""
    seg = np.zeros((b, s), np.int32)
    seg[0, 17:], seg[0, 30:] = 1, 2
    return jnp.asarray(seg)


def relative_error(got, want):
    """Largest deviation relative to the largest reference value (exact for all-zero ones)."""
    got, want = np.asarray(got), np.asarray(want)  # numpy: no program compiled per shape
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), 1e-30)


def random_layer(kind, **v4_fields):
    """A tiny layer with random values in every leaf: V4 ``"sliding"`` / ``"csa"`` / ``"hca"``
    (hidden 32; ``v4_fields`` override the config) or ``"v32"`` (hidden 64, k = 8)."""
    if kind == "v32":
        return randomise(ce.V32Attention(tiny_v32(), key=jax.random.key(0)))
    return randomise(ce.V4Attention(tiny(kind, **v4_fields), key=jax.random.key(0)))


def assert_matches_single_device(kind, got, want):
    """``got`` and ``want`` are ``(y, aux, grads)``: outputs and every gradient within 1e-5
    relative, selections bitwise equal (and not trivial) for the layers with an indexer."""
    (y, aux, grads), (want_y, want_aux, want_grads) = got, want
    assert relative_error(y, want_y) < 1e-5
    if kind in ("csa", "v32"):
        sel = np.asarray(want_aux["selection"])
        assert (sel == -1).any() and (sel >= 0).any()
        np.testing.assert_array_equal(np.asarray(aux["selection"]), sel)
    else:
        assert aux["selection"] is None
    leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
    assert len(leaves) == len(want_leaves)
    for leaf, want_leaf in zip(leaves, want_leaves, strict=True):
        assert relative_error(leaf, want_leaf) < 1e-5


def assert_loader_matches_hf(family, options, mesh, seq, min_rows):
    """``load_{family}_attention(..., **options)`` (``family`` ``"v4"``: a tiny CSA layer, or
    ``"v32"``) run under ``mesh`` gives HF's output and top-k on the rows whose top-k is
    unambiguous (at least ``min_rows`` of them). Returns the loaded layer. The only helper
    here that needs torch: it imports the HF side itself, so the rest runs without torch."""
    from test_v4_parity import assert_close, untied_rows

    from csa_eqx import testing

    v4 = family == "v4"
    hf_cfg = testing.hf_v4_config(tiny_v4("csa")) if v4 else testing.hf_v32_config(tiny_v32())
    hf = (testing.random_hf_v4_layer if v4 else testing.random_hf_v32_layer)(hf_cfg)
    load = ce_hf.load_v4_attention if v4 else ce_hf.load_v32_attention
    layer = load(testing.state_dict_numpy(hf), hf_cfg, 0, **options)
    x = np.random.default_rng(0).normal(size=(1, seq, hf_cfg.hidden_size)).astype(np.float32)
    want, want_topk, scores = (testing.run_hf_v4 if v4 else testing.run_hf_v32)(hf, hf_cfg, x)
    with jax.set_mesh(mesh):
        got, aux = jax.jit(lambda layer, x: layer(x, return_aux=True))(layer, x)
    rows = untied_rows(scores, hf_cfg.index_topk, 4 if v4 else 1, rel_gap=1e-5)
    assert rows.sum() >= min_rows
    assert_close(np.asarray(got), want, rows)
    for b, t in zip(*np.nonzero(rows), strict=True):
        ours, theirs = np.asarray(aux["selection"][b, t]), want_topk[b, t]
        theirs = theirs[theirs >= 0] if v4 else theirs[theirs <= t]  # V3.2: HF pads with > t
        assert set(ours[ours >= 0].tolist()) == set(theirs.tolist())
    return layer
