"""Cached decoding vs transformers' own cached path (DynamicCache), float32, random weights.

A prefill chunk then single-token steps through HF's cache (sliding window, HCA compressor
state, V3.2 latent and indexer-key caches) against our ``init_cache`` + ``extend``: outputs
per element (``rtol=1e-5`` plus ``atol=1e-6·max|HF|``) and, for V3.2, the selections on rows
whose top-k boundary is untied; and multi-token chunks after earlier ones, with the window
read as a band or gathered. The CSA case is ``test_decode.py::test_matches_hf_cached_path``.
"""

import equinox as eqx
import numpy as np
import pytest
from test_v4_parity import assert_close, untied_rows
from transformers import DynamicCache

from csa_eqx import BandWindow, Execution, GatheredWindow
from csa_eqx.hf import load_v4_attention, load_v32_attention
from csa_eqx.presets import tiny_v4, tiny_v32
from csa_eqx.testing import (
    hf_v4_config,
    hf_v4_extend,
    hf_v32_config,
    hf_v32_extend,
    random_hf_v4_layer,
    random_hf_v32_layer,
    state_dict_numpy,
)

B = 2


def chunks(prefill: int, steps: int) -> list[tuple[int, int]]:
    """(start, length) of the prefill chunk and each single-token step."""
    return [(0, prefill)] + [(prefill + i, 1) for i in range(steps)]


def run_ours(layer, x, plan):
    """Our prefill + steps: per-chunk outputs and selections concatenated over the sequence."""
    step = eqx.filter_jit(lambda m, x, c: m.extend(x, c, return_aux=True))
    cache = layer.init_cache(B, x.shape[1] + 3)
    outs, sels = [], []
    for start, n in plan:
        y, cache, aux = step(layer, x[:, start : start + n], cache)
        outs.append(np.asarray(y))
        sels.append(None if aux["selection"] is None else np.asarray(aux["selection"]))
    return np.concatenate(outs, 1), sels


@pytest.mark.parametrize("kind", ["sliding", "hca"])
def test_v4_matches_hf_cached_path(kind):
    """Window 6 slides out during the steps; HCA (m = 8) closes entries at 16 and 24."""
    prefill, steps = 13, 11
    cfg = hf_v4_config(tiny_v4(kind, sliding_window=6))
    hf = random_hf_v4_layer(cfg, seed=3)
    x = np.random.default_rng(3).normal(size=(B, prefill + steps, cfg.hidden_size))
    x = x.astype(np.float32)
    cache, want = DynamicCache(config=cfg), []
    for start, n in chunks(prefill, steps):
        want.append(hf_v4_extend(hf, cfg, x[:, start : start + n], start, cache)[0])
    want = np.concatenate(want, 1)
    got, sels = run_ours(load_v4_attention(state_dict_numpy(hf), cfg, 0), x, chunks(prefill, steps))
    assert all(s is None for s in sels)
    assert_close(got, want, np.ones(got.shape[:2], bool))


@pytest.mark.parametrize("window", [BandWindow(), GatheredWindow()], ids=["band", "gathered"])
@pytest.mark.parametrize("kind", ["sliding", "hca"])
def test_v4_multi_token_chunks_match_hf_cached_path(kind, window):
    """Chunks of several tokens after a non-empty ring (window 6), read as a band over
    ``[ring ; chunk]`` (4-query blocks: slabs that start inside the ring) or gathered."""
    plan = [(0, 9), (9, 11), (20, 1), (21, 10)]
    cfg = hf_v4_config(tiny_v4(kind, sliding_window=6))
    hf = random_hf_v4_layer(cfg, seed=11)
    x = np.random.default_rng(11).normal(size=(B, 31, cfg.hidden_size)).astype(np.float32)
    cache, want = DynamicCache(config=cfg), []
    for start, n in plan:
        want.append(hf_v4_extend(hf, cfg, x[:, start : start + n], start, cache)[0])
    want = np.concatenate(want, 1)
    execution = Execution(window=window, query_block=4)
    layer = load_v4_attention(state_dict_numpy(hf), cfg, 0, execution=execution)
    got, _ = run_ours(layer, x, plan)
    assert_close(got, want, np.ones(got.shape[:2], bool))


def test_v32_matches_hf_cached_path():
    """Prefill 9 tokens, then 7 steps: k = 4 of a growing causal prefix."""
    prefill, steps, k = 9, 7, 4
    cfg = hf_v32_config(tiny_v32(index_topk=k, v_head_dim=12))
    hf = random_hf_v32_layer(cfg, seed=5)
    x = np.random.default_rng(5).normal(size=(B, prefill + steps, cfg.hidden_size))
    x = x.astype(np.float32)
    plan = chunks(prefill, steps)
    got, sels = run_ours(load_v32_attention(state_dict_numpy(hf), cfg, 0), x, plan)
    cache, checked = DynamicCache(config=cfg), 0
    for (start, n), sel in zip(plan, sels, strict=True):
        want, top, scores = hf_v32_extend(hf, cfg, x[:, start : start + n], start, cache)
        # rows of this chunk, as the last n rows of a causal [start + n] score matrix
        full = np.zeros((B, start + n, start + n), np.float32)
        full[:, start:] = scores
        rows = untied_rows(full, k, 1, rel_gap=1e-5)[:, start:]
        for bi, qi in zip(*np.nonzero(rows), strict=True):
            pos = start + qi
            mine, theirs = sel[bi, qi], top[bi, qi]
            assert set(mine[mine >= 0]) == set(theirs[theirs <= pos]), (pos, bi)
            assert (mine >= 0).sum() == min(k, pos + 1)
            checked += 1
        assert_close(got[:, start : start + n], want, rows)
    assert checked >= 0.7 * B * (prefill + steps), checked
