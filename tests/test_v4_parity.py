"""V4 attention vs transformers' DeepseekV4Attention (float32, random weights), elementwise.

Every execution path is checked against HF itself, not against another path of ours: the
default tiles, small key blocks (streaming top-k), small and large query blocks (the band
slab with a window larger / smaller than the block), head-chunked scoring, and CSA picks
attended both by a masked matmul and by gathering. Outputs match per element within
``rtol=1e-5`` plus ``atol=1e-6·max|HF|``; selections match as sets on rows whose top-k
boundary is not (nearly) tied.
"""

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

RTOL, ATOL = 1e-5, 1e-6  # ATOL is relative to the largest |HF output|


def with_path(state, hf_cfg, path: dict):
    """Our layer with HF's weights, forced onto an execution path. The one place that knows
    how a path is chosen: ``path`` keys are ``tile``-style options (``key_block``,
    ``query_block``, ``head_chunk``) translated to the loader's options here."""
    names = dict(
        key_block="indexer_key_block", query_block="query_block", head_chunk="qk_head_chunk_size"
    )
    return load_v4_attention(state, hf_cfg, 0, **{names[k]: v for k, v in path.items()})


def attends_masked_picks(entries: int, k: int) -> bool:
    """Whether the CSA layer attends to its picks by masked matmul (else it gathers them);
    asserted by the cases so that each really exercises the side it claims."""
    import csa_eqx as ce

    return isinstance(ce.AutoPicks().choose(entries, k), ce.MaskedPicks)


def untied_rows(scores: np.ndarray, k: int, m: int, rel_gap: float = 0.0) -> np.ndarray:
    """[B,S] mask of rows whose k-th and (k+1)-th best visible scores differ by more than
    ``rel_gap·max|scores|`` (rows with at most k visible entries have no boundary)."""
    b, s, t = scores.shape
    if t == 0:
        return np.ones((b, s), bool)
    visible = np.arange(t)[None, :] < ((np.arange(s) + 1) // m)[:, None]
    srt = -np.sort(-np.where(visible[None], scores, -np.inf), axis=-1)
    has_next = (visible.sum(-1) > k)[None]
    with np.errstate(invalid="ignore"):  # -inf - -inf where a row has no boundary
        gap = srt[..., k - 1] - srt[..., min(k, t - 1)]
    scale = np.abs(np.where(visible[None], scores, 0.0)).max()
    return ~(has_next & ~(gap > rel_gap * scale))


def assert_close(got: np.ndarray, want: np.ndarray, rows: np.ndarray) -> None:
    """Per element on the chosen rows: |got - want| <= RTOL·|want| + ATOL·max|want|."""
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[rows], want[rows], rtol=RTOL, atol=ATOL * np.abs(want).max())


def run_case(kind, b, s, window, topk, rate, yarn, paths, seed=None):
    """One HF reference, then our layer on each path: returns (HF output, HF top-k)."""
    seed = s if seed is None else seed
    arch = dataclasses.replace(
        tiny_v4(kind, sliding_window=window, index_topk=topk),
        rope_scaling=TINY_YARN if yarn else None,
        compress_rate=rate if kind == "hca" else tiny_v4(kind).compress_rate,
    )
    cfg = hf_v4_config(arch)
    hf_layer = random_hf_v4_layer(cfg, seed=seed)
    x = np.random.default_rng(seed).normal(size=(b, s, cfg.hidden_size)).astype(np.float32)
    want, want_topk, scores = run_hf_v4(hf_layer, cfg, x)
    state = state_dict_numpy(hf_layer)

    rows = np.ones((b, s), bool)
    if kind == "csa" and scores is not None:
        rows = untied_rows(scores, min(topk, scores.shape[-1]), 4, rel_gap=1e-5)
        assert rows.mean() > 0.5, "too few untied rows to be a meaningful test"
    for path in paths:
        got, aux = jax.jit(lambda m, x: m(x, return_aux=True))(with_path(state, cfg, path), x)
        got, sel = np.asarray(got), aux["selection"]
        if kind != "csa":
            assert sel is None, path
        elif want_topk is None:  # S < m: no entry at all
            assert (np.asarray(sel) == -1).all(), path
        else:
            sel = np.asarray(sel)
            assert sel.shape == (b, s, topk)
            k_eff = want_topk.shape[-1]
            for bi, si in zip(*np.nonzero(rows), strict=True):
                mine, theirs = sel[bi, si], want_topk[bi, si]
                assert set(mine[mine >= 0]) == set(theirs[theirs >= 0]), (path, bi, si)
                assert (mine[k_eff:] == -1).all()
        try:
            assert_close(got, want, rows)
        except AssertionError as e:
            raise AssertionError(f"path {path}: {e}") from None


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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-b{c[1]}-s{c[2]}-w{c[3]}-k{c[4]}")
def test_matches_hf(case):
    run_case(*case, paths=[{}])


# S = 300 with m = 4: T = 75 entries. k = 16 gathers the picks (75 > 4·16); k = 24 attends
# to them by a masked matmul (75 <= 4·24). Window 16 is larger than a query block of 8 and
# smaller than one of 32; window 6 is smaller than every block used.
PATH_CASES = [
    # kind, seq, window, topk, hca_rate, masked picks, paths
    (
        "csa",
        300,
        16,
        16,
        8,
        False,
        [{}, dict(key_block=8, query_block=8, head_chunk=2), dict(query_block=32, key_block=32)],
    ),
    (
        "csa",
        300,
        6,
        24,
        8,
        True,
        [{}, dict(key_block=16, query_block=32, head_chunk=1), dict(query_block=4, key_block=5)],
    ),
    ("sliding", 300, 16, 3, 8, None, [{}, dict(query_block=8), dict(query_block=64)]),
    ("hca", 300, 6, 3, 8, None, [dict(query_block=16), dict(query_block=4)]),
]


@pytest.mark.parametrize(
    "case", PATH_CASES, ids=lambda c: f"{c[0]}-s{c[1]}-w{c[2]}-k{c[3]}-masked{c[5]}"
)
def test_every_path_matches_hf(case):
    kind, s, window, topk, rate, masked, paths = case
    if masked is not None:
        assert attends_masked_picks(s // 4, topk) == masked
    run_case(kind, 1, s, window, topk, rate, False, paths, seed=11)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_packed_documents_match_hf_alone(kind):
    """Two documents packed in one row == HF on each document alone. The second starts at
    token 13, mid-window for m = 4 and m = 8: compression windows, positions and the sliding
    window must all restart at the segment boundary."""
    lengths = (13, 22)
    cfg = hf_v4_config(tiny_v4(kind, sliding_window=6, index_topk=3))
    hf_layer = random_hf_v4_layer(cfg, seed=9)
    x = np.random.default_rng(9).normal(size=(1, sum(lengths), cfg.hidden_size))
    x = x.astype(np.float32)
    seg = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
    layer = with_path(state_dict_numpy(hf_layer), cfg, {})
    got = np.asarray(jax.jit(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg))
    start = 0
    for n in lengths:
        want, _, scores = run_hf_v4(hf_layer, cfg, x[:, start : start + n])
        rows = np.ones((1, n), bool)
        if scores is not None:
            rows = untied_rows(scores, 3, 4, rel_gap=1e-5)
        assert_close(got[:, start : start + n], want, rows)
        start += n


@pytest.mark.parametrize("beta", [(32.0, 1.0), (16.0, 2.0)])
def test_yarn_frequencies_match_hf_at_released_sizes(beta):
    """YaRN's inverse frequencies at V4-Flash's sizes (rope 64, theta 160000, factor 16 of
    65536) against transformers' own: at the tiny test sizes the band does not depend on
    ``beta_fast`` / ``beta_slow``, here it does."""
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from csa_eqx import YaRNScaling
    from csa_eqx._rope import rope_inv_freq
    from csa_eqx.presets import v4_flash

    yarn = YaRNScaling(16.0, 65536, beta_fast=beta[0], beta_slow=beta[1])
    cfg = dataclasses.replace(v4_flash("csa"), rope_scaling=yarn)
    with torch.device("meta"):  # the config only; no weights are built
        hf_cfg = hf_v4_config(cfg)
    rotary = DeepseekV4RotaryEmbedding(hf_cfg)
    want = rotary.compress_inv_freq.numpy()
    got = rope_inv_freq(cfg.rope_dim, cfg.compress_rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = rope_inv_freq(cfg.rope_dim, cfg.compress_rope_theta)
    ramp = got / plain  # 1 where extrapolated, 1/16 where interpolated, a ramp between
    assert (ramp > 0.99).sum() > 0 and (ramp < 1 / 15.9).sum() > 0
    assert ((ramp > 1 / 15.9) & (ramp < 0.99)).sum() >= 2  # the band that beta moves


def test_yarn_with_fewer_picks_than_entries_matches_hf():
    """YaRN on and k = 4 of up to 10 visible entries: the indexer queries' YaRN rotation
    decides the picks (the other YaRN case has k above the visible entries)."""
    run_case("csa", 1, 40, 12, 4, 8, True, paths=[{}])


def test_indexer_scores_match_hf():
    """The V4 indexer's float32 scores equal HF's on every visible entry (no tie caveat: a
    positive rescale of the head weights would change no selection, but it changes these)."""
    import jax.numpy as jnp
    import torch

    from csa_eqx import entry_layout, indexer_scores

    arch = dataclasses.replace(tiny_v4("csa", index_topk=4), rope_scaling=TINY_YARN)
    cfg = hf_v4_config(arch)
    hf_layer = random_hf_v4_layer(cfg, seed=5)
    b, s = 2, 40
    x = np.random.default_rng(5).normal(size=(b, s, cfg.hidden_size)).astype(np.float32)
    _, _, want = run_hf_v4(hf_layer, cfg, x)
    layer = load_v4_attention(state_dict_numpy(hf_layer), cfg, 0)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    qr = jnp.asarray(hf_layer.q_a_norm(hf_layer.q_a_proj(torch.tensor(x))).detach().numpy())
    xj, ix = jnp.asarray(x), layer.indexer
    keys = layer.index_compressor(xj, pos, entry_layout(jnp.zeros((b, s), jnp.int32), 4))
    got = np.asarray(indexer_scores(ix.queries(qr, pos), ix.head_weights(xj), keys))
    t = got.shape[-1]
    visible = np.broadcast_to(np.arange(t)[None] < ((np.arange(s) + 1) // 4)[:, None], got.shape)
    err = np.abs(got[visible] - want[visible]).max() / np.abs(want[visible]).max()
    assert err <= 1e-5, err
