"""A tiny DeepSeek-V4.1 attention stack against DeepSeek's own V4.1 ``inference/model.py``.

``tests/fixtures/deepseek/v41_stack.npz`` holds what DeepSeek's code computed for a six-layer
attention-only stack covering every role: sliding (0), full ratio 2 (1), reuse (2), full
ratio 1 and candidate source (3), reindex restricted to the candidates (4), reuse after the
reindex (5). The exact path: float32, nothing quantised, ``sparse_attn_exact``, a stable
lower-index top-k, the stale-key defect fixed (``tests/fixtures/deepseek/README.md``).
"""

import dataclasses
import json
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from test_v41_layers import candidate_entries

import csa_eqx as ce
from csa_eqx.hf import load_v41_attention, v41_config_from_hf

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek" / "v41_stack.npz"
# the stack runs jitted: eagerly, every primitive would be compiled as a program of its own
run_stack = eqx.filter_jit(ce.run_v41_stack)


def _layer(config, i: int, fx: dict) -> ce.V41Attention:
    prefix = f"l{i}:"
    return load_v41_attention(
        config, i, {k: v for k, v in fx.items() if k.startswith(prefix)}, prefix
    )


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE) as f:
        fx = {k: f[k] for k in f.files}
    config = v41_config_from_hf(json.loads(str(fx["config_json"])))
    layers = [_layer(config, i, fx) for i in range(config.num_layers)]
    xs = [jnp.asarray(fx[f"x{i}"]) for i in range(config.num_layers)]
    ys, published = run_stack(layers, xs)
    return fx, config, ys, published


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def test_roles_cover_every_kind(reference):
    _, config, _, _ = reference
    assert [config.role(i) for i in range(6)] == [
        "sliding",
        "full",
        "reuse",
        "full",
        "reindex",
        "reuse",
    ]
    assert config.is_candidate_source(3) and config.uses_candidates(4)


@pytest.mark.parametrize("i", range(6))
def test_prefill_outputs(reference, i):
    fx, _, ys, _ = reference
    assert _rel(ys[i], fx[f"prefill_y{i}"]) < 1e-5


def _untied(scores: np.ndarray, k: int) -> np.ndarray:
    """``[B, S]``: rows whose k-th and (k+1)-th best reference scores differ (or with no
    (k+1)-th finite score: no boundary to tie on)."""
    s = -np.sort(-scores, axis=-1)
    last, nxt = s[..., k - 1], s[..., k]
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(nxt) | ~np.isfinite(last) | (np.abs(last - nxt) > 1e-6 * np.abs(last))


@pytest.mark.parametrize("i", [1, 3, 4])
def test_prefill_selections(reference, i):
    fx, config, _, published = reference
    ref, mine = fx[f"prefill_sel{i}"], np.asarray(published[i].selection)
    untied = _untied(fx[f"prefill_score{i}"], config.index_topk)
    assert untied.mean() > 0.9
    for b, t in zip(*np.nonzero(untied), strict=True):
        assert set(ref[b, t][ref[b, t] >= 0]) == set(mine[b, t][mine[b, t] >= 0]), (b, t)
    # reuse layers attend their index source's selection unchanged (they run no top-k:
    # test_v41_layers::test_reuse_layers_trace_no_topk)
    for j in range(i + 1, config.num_layers):
        if config.index_source(j) == i:
            np.testing.assert_array_equal(published[j].selection, published[i].selection)


def test_candidates(reference):
    fx, config, _, published = reference
    ref = fx["prefill_cand3"]
    mine = candidate_entries(published[3].candidates, config.candidate_block_size, ref.shape[-1])
    np.testing.assert_array_equal(mine, ref)
    # the pre-filter bites: some queries have visible entries outside their candidates
    t = np.arange(ref.shape[1])
    visible = np.arange(ref.shape[-1])[None, :] <= t[:, None]
    assert ((~ref) & visible[None]).any(-1).sum() >= 16
    # and the reindex layer's selection stays inside the candidates
    sel = np.asarray(published[4].selection)
    picked = np.take_along_axis(ref, np.maximum(sel, 0), axis=-1)
    assert np.all(picked | (sel < 0))


def test_prefilter_is_load_bearing(reference):
    """Without the candidates, the reindex layer picks otherwise on many rows and layers 4-5
    no longer match: the fixture exercises the pre-filter, not just its bookkeeping."""
    fx, config, _, published = reference
    off = dataclasses.replace(
        config, candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=0
    )
    layers = [_layer(off, i, fx) for i in range(off.num_layers)]
    ys, unfiltered = run_stack(layers, [jnp.asarray(fx[f"x{i}"]) for i in range(6)])
    a = np.sort(np.asarray(unfiltered[4].selection), -1)
    b = np.sort(np.asarray(published[4].selection), -1)
    assert (a != b).any(-1).sum() >= 16
    assert _rel(ys[4], fx["prefill_y4"]) > 0.1 and _rel(ys[5], fx["prefill_y5"]) > 0.1


_EXTEND = ce.V41Attention.extend


@eqx.filter_jit
def _extend(layer, x, cache, shared):
    return layer.extend(x, cache, shared)


def _stream(layers, xs, chunks):
    """Each layer's outputs over ``chunks`` (``(start, stop)`` pairs), one cache per layer."""
    caches = [layer.init_cache(xs[0].shape[0], 32) for layer in layers]
    xs = [np.asarray(x) for x in xs]  # numpy slices: no program per chunk shape
    ys = [[] for _ in layers]
    for s0, s1 in chunks:
        shared = None
        for i, layer in enumerate(layers):
            y, caches[i], shared = _extend(layer, xs[i][:, s0:s1], caches[i], shared)
            ys[i].append(y)
    return [np.concatenate(y, axis=1) for y in ys]


@pytest.fixture(scope="module")
def streams(reference):
    """csa_eqx's ``extend`` over DeepSeek's decode schedule (a 9-token prefill, so a ratio-2
    group stays open, then 15 one-token steps of both parities) and over chunks 7 + 6 + 11
    (groups across chunk boundaries)."""
    fx, config, _, _ = reference
    layers = [_layer(config, i, fx) for i in range(config.num_layers)]
    xs = [jnp.asarray(fx[f"x{i}"]) for i in range(config.num_layers)]
    decode = _stream(layers, xs, [(0, 9)] + [(t, t + 1) for t in range(9, 24)])
    chunked = _stream(layers, xs, [(0, 7), (7, 13), (13, 24)])
    return {"decode": decode, "chunked": chunked}


@pytest.mark.parametrize("i", range(6))
def test_decode_matches_reference_decode(reference, streams, i):
    """DeepSeek's own decode (stale keys fixed) against ``extend`` over the same stream."""
    assert _rel(streams["decode"][i], reference[0][f"decode_y{i}"]) < 1e-5


@pytest.mark.parametrize("i", range(6))
def test_chunked_prefill_matches_reference_prefill(reference, streams, i):
    """DeepSeek has no chunked prefill: chunks must equal its one-shot prefill."""
    assert _rel(streams["chunked"][i], reference[0][f"prefill_y{i}"]) < 1e-5


@pytest.fixture(scope="module")
def hf():
    with np.load(FIXTURE.with_name("v41_stack_hf.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("i", range(6))
def test_matches_transformers(reference, streams, hf, i):
    """transformers' ``deepseek_v41`` attention layers (one cache for the stream, a fresh
    ``shared`` dict per call): one-shot prefill, chunks 7 + 6 + 11 and the decode schedule."""
    ys = reference[2]
    assert _rel(ys[i], hf[f"hf_prefill_y{i}"]) < 1e-5
    assert _rel(streams["chunked"][i], hf[f"hf_chunked_y{i}"]) < 1e-5
    assert _rel(streams["decode"][i], hf[f"hf_decode_y{i}"]) < 1e-5


def test_transformers_selections_and_candidates(reference, hf):
    """transformers publishes selections as a mask over the entries (bias 0 = picked)."""
    _, config, _, published = reference
    for i in config.index_source_layers:
        sel = np.asarray(published[i].selection)
        picked = np.zeros_like(hf[f"hf_prefill_picked{i}"])
        b, s, _ = np.nonzero(sel >= 0)
        picked[b, s, sel[sel >= 0]] = True
        np.testing.assert_array_equal(picked, hf[f"hf_prefill_picked{i}"])
    cand = hf["hf_prefill_cand3"]
    bc = config.candidate_block_size
    np.testing.assert_array_equal(
        candidate_entries(published[3].candidates, bc, cand.shape[-1]), cand
    )


def test_stale_index_keys_reproduce_deepseek_decode(reference):
    """``stale_index_keys`` reproduces DeepSeek's code as released: on even decode positions
    the ratio-2 owner (layer 1) republishes no keys, so it and its reuse layer score the
    ratio-1 owner's (layer 3's) keys, and decode leaves DeepSeek's own prefill by ~27%."""
    fx, config, _, _ = reference
    layers = [_layer(config, i, fx) for i in range(config.num_layers)]
    xs = [fx[f"x{i}"] for i in range(config.num_layers)]  # numpy: slices compile nothing
    caches = [layer.init_cache(2, 32) for layer in layers]
    ys, pointer = [[] for _ in layers], -1
    step = eqx.filter_jit(_EXTEND)
    for s0, s1 in [(0, 9)] + [(t, t + 1) for t in range(9, 24)]:
        chunk = [jnp.asarray(x[:, s0:s1]) for x in xs]
        out, caches, _, pointer = ce.extend_v41_stack(
            layers, chunk, caches, step=step, stale_index_keys=pointer
        )
        for i, y in enumerate(out):
            ys[i].append(y)
    for i in range(config.num_layers):
        y = np.concatenate(ys[i], axis=1)
        assert _rel(y, fx[f"stale_decode_y{i}"]) < 1e-5, i
    for i in (1, 2):
        assert _rel(fx[f"stale_decode_y{i}"], fx[f"prefill_y{i}"]) > 0.1
