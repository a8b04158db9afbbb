"""V4 attention vs transformers' DeepseekV4Attention (float32, random weights)."""

import dataclasses

import jax
import numpy as np
import pytest

from csa_eqx.hf import load_v4_attention
from csa_eqx.presets import tiny_v4
from csa_eqx.testing import (
    TINY_YARN,
    hf_v4_config,
    random_hf_v4_layer,
    run_hf_v4,
    state_dict_numpy,
)

CASES = [
    # kind, batch, seq, window, topk, hca_rate, yarn
    ("sliding", 2, 13, 6, 3, 8, False),
    ("sliding", 1, 5, 8, 3, 8, False),
    ("csa", 2, 13, 6, 3, 8, False),  # S not a multiple of m
    ("csa", 2, 3, 6, 3, 8, False),  # S < m: no entries at all
    ("csa", 2, 16, 2, 2, 8, False),  # window smaller than m
    ("csa", 2, 22, 6, 9, 8, True),  # k larger than the visible entries; YaRN
    ("csa", 1, 40, 12, 4, 8, False),  # window larger than m
    ("csa", 1, 72, 6, 3, 8, False),  # T = 18 > 4k: picks gathered, not masked
    ("hca", 2, 21, 6, 3, 8, False),
    ("hca", 2, 5, 3, 3, 8, False),  # S < m
    ("hca", 1, 40, 12, 3, 16, True),
]


def untied_rows(scores: np.ndarray, k: int, m: int) -> np.ndarray:
    """[B,S] mask of rows whose k-th and (k+1)-th best visible scores differ."""
    b, s, t = scores.shape
    if t == 0:
        return np.ones((b, s), bool)
    visible = np.arange(t)[None, :] < ((np.arange(s) + 1) // m)[:, None]
    masked = np.where(visible[None], scores, -np.inf)
    srt = -np.sort(-masked, axis=-1)
    n_vis = visible.sum(-1)[None].repeat(b, 0)
    ok = np.ones((b, s), bool)
    has_next = n_vis > k
    kth, nxt = srt[..., k - 1], srt[..., min(k, t - 1)]
    ok &= ~(has_next & (kth == nxt))
    return ok


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-b{c[1]}-s{c[2]}-w{c[3]}-k{c[4]}")
def test_matches_hf(case):
    kind, b, s, window, topk, hca_rate, yarn = case
    arch = dataclasses.replace(
        tiny_v4(kind, sliding_window=window, index_topk=topk),
        rope_scaling=TINY_YARN if yarn else None,
        compress_rate=hca_rate if kind == "hca" else tiny_v4(kind).compress_rate,
    )
    cfg = hf_v4_config(arch)
    hf_layer = random_hf_v4_layer(cfg, seed=s)
    x = np.random.default_rng(s).normal(size=(b, s, cfg.hidden_size)).astype(np.float32)
    want, want_topk, scores = run_hf_v4(hf_layer, cfg, x)

    layer = load_v4_attention(state_dict_numpy(hf_layer), cfg, 0)
    got, aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, x)
    got = np.asarray(got)

    rows = np.ones((b, s), bool)
    if kind == "csa" and want_topk is not None:
        rows = untied_rows(scores, min(topk, scores.shape[-1]), 4)
        sel = np.asarray(aux["selection"])
        assert sel.shape == (b, s, topk)
        k_eff = want_topk.shape[-1]
        for bi, si in zip(*np.nonzero(rows), strict=False):
            assert set(sel[bi, si][sel[bi, si] >= 0]) == set(
                want_topk[bi, si][want_topk[bi, si] >= 0]
            )
            assert (sel[bi, si, k_eff:] == -1).all()
        assert rows.mean() > 0.5, "too few untied rows to be a meaningful test"
        if k_eff == 0:
            assert (sel == -1).all()
    elif kind == "csa":
        assert (np.asarray(aux["selection"]) == -1).all()
    else:
        assert aux["selection"] is None

    assert np.isfinite(got).all()
    err = np.abs(got[rows] - want[rows]).max() / np.abs(want[rows]).max()
    assert err <= 1e-4, err
