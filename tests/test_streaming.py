"""Streaming selection and query-blocked sparse attention equal their dense versions, on
random tilings and shapes (every strategy and kernel against the numpy references on fixed
cases: tests/test_conformance_selection.py, tests/test_conformance_attention.py), and what
they never form.

References: the dense ``select_topk(indexer_scores(...), entry_visibility(...), k)`` (itself
checked against transformers in test_v4_parity.py), a numpy brute force for block skipping,
the window gathered by index, the float64 formulas of tests/conformance.py for a float64
indexer.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import brute_topk, kl_np, scores_np, target_mass_np, visible_np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jaxpr_helpers import primitives, walk_avals
from selection_helpers import problem, selected

import csa_eqx as ce
from csa_eqx import (
    V4Attention,
    V4AttentionConfig,
    entry_layout,
    entry_visibility,
    indexer_scores,
    select_topk,
    sparse_attention,
)
from csa_eqx._blocks import key_block_ranges
from csa_eqx._tiles import streaming_block_sizes, topk_block_size


def window_indices(query_index, segment, window: int):
    """Reference for ``sparse_attention(window=...)``: the raw-token keys of each query's
    sliding window as gather indices (``t − window < j ≤ t``, same segment; ``-1`` where
    none)."""
    b, s = query_index.shape
    idx = query_index[..., None] - jnp.arange(window, dtype=jnp.int32)
    seg_at = jnp.take_along_axis(segment, jnp.clip(idx, 0, s - 1).reshape(b, -1), axis=1)
    return jnp.where((idx >= 0) & (seg_at.reshape(idx.shape) == segment[..., None]), idx, -1)


SETTINGS = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


@st.composite
def selection_case(draw):
    """Shapes, block sizes and inputs for one selection problem.

    ``exact`` inputs are small dyadic numbers with ``dim`` a power of 4, so every score is exact
    in float32 whatever the summation order and the two paths must agree bit for bit, ties
    (many exact zeros, ``-0.0`` from negative weights) included.
    """
    b = draw(st.integers(1, 2))
    s = draw(st.integers(1, 40))
    heads = draw(st.sampled_from([1, 2, 4]))
    m = draw(st.sampled_from([1, 2, 4, 8]))
    case = {
        "k": draw(st.integers(1, 24)),
        "head_chunk": draw(st.sampled_from([c for c in (0, 1, 2, 4) if c <= heads])),
        "key_block": draw(st.integers(1, 12)),
        "query_block": draw(st.integers(0, 16)),
        "topk_block": draw(st.integers(0, 30)),  # < entries: several merged row buffers
        "kind": draw(st.sampled_from(["exact", "relu_ties", "float"])),
    }
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):  # packed: contiguous runs, some shorter than m
        seg = np.sort(rng.integers(0, 4, (b, s)), axis=1)
    else:
        seg = np.zeros((b, s), np.int64)
    layout = entry_layout(jnp.asarray(seg, jnp.int32), m)
    t = layout.end.shape[1]
    qseg = seg.copy()
    qseg[rng.random((b, s)) < 0.15] = 99  # rows that see no entry at all
    d = 16 if case["kind"] != "float" else int(rng.integers(3, 9))
    if case["kind"] == "float":
        q = rng.normal(size=(b, s, heads, d))
        keys = rng.normal(size=(b, t, d))
        w = rng.normal(size=(b, s, heads))
    else:
        q = rng.integers(-2, 3, (b, s, heads, d)).astype(float)
        keys = rng.integers(-2, 3, (b, t, d)).astype(float)
        w = rng.integers(-2, 3, (b, s, heads)) / 2.0
        if case["kind"] == "relu_ties":  # mostly non-positive logits: scores of exactly +-0
            q = -np.abs(q) * (rng.random(q.shape) < 0.9)
            keys = np.abs(keys)
            w = -np.abs(w)
    case["args"] = (
        jnp.asarray(q, jnp.float32),
        jnp.asarray(w, jnp.float32),
        jnp.asarray(keys, jnp.float32),
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
        jnp.asarray(qseg, jnp.int32),
        layout,
    )
    return case


def selected_by(problem, k, key_block=0, query_block=0):
    """``StreamingSelection`` with these tiles when ``key_block`` is given, else automatic."""
    if key_block:
        return ce.StreamingSelection(key_block=key_block, query_block=query_block).select(
            problem, k
        )
    return ce.AutoSelection(query_block=query_block).select(problem, k)


@functools.partial(jax.jit, static_argnums=6)  # one program, not one per primitive
def dense_selection(q, w, keys, qidx, qseg, layout, k):
    scores = indexer_scores(q, w, keys)
    return select_topk(scores, entry_visibility(qidx, qseg, layout), k)


@SETTINGS
@given(selection_case())
def test_streaming_equals_dense(case):
    k, args = case["k"], case["args"]
    want = np.asarray(dense_selection(*args, k))
    opts = {n: case[n] for n in ("key_block", "query_block", "topk_block")}
    stream = ce.StreamingSelection(**opts)
    got = np.asarray(
        jax.jit(lambda *a: stream.select(problem(*a, head_chunk=case["head_chunk"]), k))(*args)
    )
    assert got.shape == want.shape
    if case["kind"] != "float":
        np.testing.assert_array_equal(got, want)
        return
    # Tiles may round scores differently from the dense matmul in the last bit: near-ties may
    # then swap, so compare the picked scores (sorted, same -1 pattern, distinct picks).
    scores = np.asarray(jax.jit(indexer_scores)(*args[:3]))
    np.testing.assert_array_equal(got < 0, want < 0)
    picked = np.take_along_axis(scores, np.maximum(got, 0), -1)
    best = np.take_along_axis(scores, np.maximum(want, 0), -1)
    np.testing.assert_allclose(
        np.where(got < 0, 0, picked), np.where(want < 0, 0, best), 1e-5, 1e-6
    )
    for row in got.reshape(-1, k):
        valid = row[row >= 0]
        assert len(set(valid.tolist())) == len(valid)


@pytest.mark.parametrize("packed", [False, True])
def test_key_block_ranges_cover_visible_blocks(packed):
    """Every (query block, key block) pair holding a visible entry is visited; without packing
    exactly those are (invisible blocks cost nothing)."""
    b, s, m, qb, kb = 2, 203, 4, 16, 8
    rng = np.random.default_rng(1)
    seg = np.sort(rng.integers(0, 5, (b, s)), axis=1) if packed else np.zeros((b, s), int)
    seg = jnp.asarray(seg, jnp.int32)
    layout = entry_layout(seg, m)
    t = layout.end.shape[1]
    qidx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    lo, hi = map(np.asarray, key_block_ranges(qidx, seg, layout, qb, kb))
    visible = np.asarray(entry_visibility(qidx, seg, layout)).any(0)  # [S, T]
    nq, nk = -(-s // qb), -(-t // kb)
    q_start = np.minimum(np.arange(nq) * qb, s - qb)
    k_start = np.minimum(np.arange(nk) * kb, t - kb)
    for i in range(nq):
        need = [visible[q_start[i] : q_start[i] + qb, k_start[j] : k_start[j] + kb].any()
                for j in range(nk)]  # fmt: skip
        needed = np.flatnonzero(need)
        if len(needed):
            assert lo[i] <= needed[0] and hi[i] >= needed[-1] + 1
        if not packed:
            assert hi[i] - lo[i] == len(needed)
    if not packed:  # about half of the full grid: the causal triangle
        assert (hi - lo).sum() < 0.6 * nq * nk


def test_select_entries_streams_long_sequences_without_score_matrix():
    """Long inputs take the streaming path on their own; no [B,S,T]-sized tensor is traced."""
    b, s, h, d, m, k = 1, 8192, 8, 32, 4, 64
    t = s // m
    seg = jnp.zeros((b, s), jnp.int32)
    layout = jax.eval_shape(lambda x: entry_layout(x, m), seg)
    spec = jax.ShapeDtypeStruct
    args = (
        spec((b, s, h, d), jnp.float32),
        spec((b, s, h), jnp.float32),
        spec((b, t, d), jnp.float32),
        spec((b, s), jnp.int32),
        spec((b, s), jnp.int32),
        layout,
    )
    jaxpr = jax.make_jaxpr(lambda *a: selected(*a, k=k))(*args).jaxpr
    sizes = [int(np.prod(a.shape)) for a in walk_avals(jaxpr) if hasattr(a, "shape")]
    assert max(sizes) <= b * s * t // 4  # a [B, Qb, H, Kb] tile at most, never [B, S, T]
    assert "while" in primitives(jaxpr)
    short = jax.make_jaxpr(lambda *a: selected(*a, k=k))(
        *(spec((b, 64, *x.shape[2:]), x.dtype) for x in args[:2]),
        spec((b, 16, d), jnp.float32),
        spec((b, 64), jnp.int32),
        spec((b, 64), jnp.int32),
        jax.eval_shape(lambda x: entry_layout(x, m), jnp.zeros((b, 64), jnp.int32)),
    )
    assert "while" not in primitives(short.jaxpr)


def test_projected_selection_matches_and_never_forms_queries():
    """Queries projected per query block (closed-over weights) select exactly what the
    materialised queries select; gradients through the surrounding code still work, and at
    length no [B, S, H, d] query tensor is traced."""
    b, s, h, d, m, k = 2, 50, 4, 16, 4, 5
    rng = np.random.default_rng(3)
    w_q = jnp.asarray(rng.integers(-2, 3, (8, h * d)), jnp.float32)
    w_h = jnp.asarray(rng.integers(-2, 3, (8, h)) / 2, jnp.float32)
    x = jnp.asarray(rng.integers(-2, 3, (b, s, 8)), jnp.float32)
    seg = jnp.zeros((b, s), jnp.int32)
    layout = entry_layout(seg, m)
    keys = jnp.asarray(rng.integers(-2, 3, (b, layout.end.shape[1], d)), jnp.float32)
    qidx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))

    def select(w_q, x, **tiles):
        def project(x):
            return (x @ w_q).reshape(*x.shape[:2], h, d), x @ w_h

        visibility = ce.Visibility(qidx, seg, layout)
        return selected_by(ce.SelectionProblem(project, (x,), keys, visibility), k, **tiles)

    want = dense_selection((x @ w_q).reshape(b, s, h, d), x @ w_h, keys, qidx, seg, layout, k)
    got = jax.jit(lambda w, x: select(w, x, key_block=3, query_block=7))(w_q, x)
    np.testing.assert_array_equal(got, want)

    def loss(w_q, x):
        sel = jax.checkpoint(lambda w, x: select(w, x, key_block=3))(w_q, x)
        return jnp.sum(jnp.take_along_axis(x, jnp.maximum(sel[..., :1], 0), axis=1) * w_q[0, 0])

    grads = jax.grad(loss, argnums=(0, 1))(w_q, x)
    assert all(np.isfinite(g).all() for g in grads)

    s_long, t_long = 8192, 2048
    spec = jax.ShapeDtypeStruct
    jaxpr = jax.make_jaxpr(
        lambda w, x, keys, qi, seg: ce.AutoSelection().select(
            ce.SelectionProblem(
                lambda x: ((x @ w).reshape(*x.shape[:2], h, d), x @ w_h),
                (x,),
                keys,
                ce.Visibility(qi, seg, entry_layout(seg, m)),
            ),
            k,
        )
    )(
        w_q,
        spec((1, s_long, 8), jnp.float32),
        spec((1, t_long, d), jnp.float32),
        spec((1, s_long), jnp.int32),
        spec((1, s_long), jnp.int32),
    ).jaxpr
    shapes = {tuple(a.shape) for a in walk_avals(jaxpr) if hasattr(a, "shape")}
    assert (1, s_long, h, d) not in shapes and (1, s_long, h * d) not in shapes
    assert (1, 256, h, d) in shapes  # one query block's queries


def test_automatic_block_sizes():
    assert streaming_block_sizes(1, 16384, 4096, 64) == (256, 128)
    assert topk_block_size(1, 256, 4096, 128) == 4096  # one top-k per query row
    assert topk_block_size(1, 256, 1 << 18, 1024) == 1 << 16  # [B, Qb, buffer] = 2^24
    assert topk_block_size(1, 16, 100, 8, topk_block=20) == 24  # rounded up to whole tiles
    assert streaming_block_sizes(1, 100, 7, 64, key_block=3, query_block=5) == (5, 3)
    assert streaming_block_sizes(1, 10, 7, 1) == (10, 7)


def assert_same_attention(fn, reference, *args):
    """``fn(*args)`` and ``reference(*args)`` (each ``(out, lse)``) agree, and so do the
    gradients of a loss on both w.r.t. every argument."""

    def loss(f, *args):
        o, lse = f(*args)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (o, lse)

    grad = jax.jit(  # jitted: eagerly, every primitive would compile on its own
        jax.grad(loss, argnums=tuple(range(1, len(args) + 1)), has_aux=True), static_argnums=0
    )
    (g, (o, lse)), (g_ref, (o_ref, lse_ref)) = grad(fn, *args), grad(reference, *args)
    np.testing.assert_allclose(o, o_ref, 1e-5, 1e-6)
    np.testing.assert_allclose(lse, lse_ref, 1e-5, 1e-6)
    for a, r in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(a, r, 1e-5, 1e-5)


@pytest.mark.parametrize("window, qb", [(4, 0), (4, 5), (1, 3), (9, 64), (30, 7)])
def test_band_window_equals_gathered_window(window, qb):
    """``window=`` (banded matmul over a slab of rows) equals gathering ``window_indices``:
    outputs, log-normalisers and gradients, packed segments, sinks, separate values, other
    gathered keys beside it, windows longer than a segment or the sequence."""
    b, s, h, d, extra = 2, 23, 3, 8, 3
    rng = np.random.default_rng(window * 100 + qb)
    seg = jnp.asarray(np.sort(rng.integers(0, 4, (b, s)), axis=1), jnp.int32)
    qidx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(b, s + 5, d)), jnp.float32)  # 5 rows beyond the tokens
    vals = jnp.asarray(rng.normal(size=(b, s + 5, 4)), jnp.float32)
    other = jnp.asarray(rng.integers(-1, 5, (b, s, extra)) + s, jnp.int32)  # the 5 extra rows
    other = jnp.where(other >= s, other, -1)
    sink = jnp.asarray(rng.normal(size=h), jnp.float32)

    def band(q, kv, vals):
        return sparse_attention(q, kv, other, sink, 0.3, vals, True, query_block=qb,
                                window=window, segment=seg)  # fmt: skip

    def gathered(q, kv, vals):
        idx = jnp.concatenate([window_indices(qidx, seg, window), other], axis=-1)
        return sparse_attention(q, kv, idx, sink, 0.3, vals, True, query_block=qb)

    assert_same_attention(band, gathered, q, kv, vals)


def test_blocked_sparse_attention_never_gathers_all_rows():
    """fwd+bwd jaxpr holds no [B, S, k, d] gathered tensor when blocked."""
    b, s, h, d, n, k = 1, 4096, 2, 16, 5000, 64
    spec = jax.ShapeDtypeStruct

    def loss(q, kv, idx):
        return jnp.sum(sparse_attention(q, kv, idx, None, 1.0, query_block=128))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(
        spec((b, s, h, d), jnp.float32), spec((b, n, d), jnp.float32), spec((b, s, k), jnp.int32)
    ).jaxpr
    sizes = [int(np.prod(a.shape)) for a in walk_avals(jaxpr) if hasattr(a, "shape")]
    assert max(sizes) < b * s * k * d // 8


def test_v4_layer_small_blocks_match_dense():
    """The CSA layer with forced tiny streaming/attention blocks equals the dense layer:
    same selection, same outputs (row 0 packed, row 1 one document)."""
    base = dict(
        hidden_size=32, num_heads=2, head_dim=16, rope_dim=8, q_lora_rank=16, o_groups=2,
        o_lora_rank=8, sliding_window=5, compress_rate=4, index_n_heads=4, index_head_dim=16,
        index_topk=3,
    )  # fmt: skip
    dense = V4Attention(V4AttentionConfig(**base), key=jax.random.key(0))
    small = ce.Execution(
        selection=ce.StreamingSelection(key_block=3, query_block=5),
        query_block=5,
        qk_head_chunk_size=2,
    )
    blocked = V4Attention(V4AttentionConfig(**base), key=jax.random.key(0), execution=small)
    for a, r in zip(jax.tree.leaves(blocked), jax.tree.leaves(dense), strict=True):
        np.testing.assert_array_equal(a, r)
    b, s = 2, 45
    x = jax.random.normal(jax.random.key(1), (b, s, 32))
    seg = jnp.asarray([[0] * 20 + [1] * 3 + [2] * 22, [0] * s], jnp.int32)

    def run(layer):
        return jax.jit(lambda m, x: m(x, segment_ids=seg, return_aux=True))(layer, x)

    (y_ref, aux_ref), (y, aux) = run(dense), run(blocked)
    sel = np.asarray(aux["selection"])
    np.testing.assert_array_equal(sel, aux_ref["selection"])
    assert (sel >= 0).any() and (sel == -1).any()
    np.testing.assert_allclose(y, y_ref, 1e-5, 1e-6)


FLOAT64_MEMBERS = {
    "streaming": (
        ce.StreamingSelection(key_block=4, query_block=8),
        ce.StreamingIndexerLoss(key_block=3, query_block=5),
    ),
    "gathered": (ce.GatheredSelection(query_block=8), ce.GatheredIndexerLoss(query_block=5)),
}


@pytest.mark.parametrize("name", FLOAT64_MEMBERS)
def test_selections_and_losses_take_float64_inputs(name):
    """Under ``jax_enable_x64``, a float64 indexer (a float64 layer's) goes through the
    streaming and the gathered selection and indexer loss: their buffers, online sums and
    counts stay float32 / int32, as every selection orders scores and the dense loss sums them
    (they failed on their carries before: float64 scores, a 64-bit count of queries). Against
    the float64 formulas: the picks are the brute-force top-k of the scores, the loss and its
    gradients through the projections and the keys those of the KL formula (float32
    rounding)."""
    rng = np.random.default_rng(64)
    b, s, hidden, heads, d, m, k = 1, 21, 6, 2, 5, 2, 3
    seg = np.zeros((b, s), np.int32)
    seg[0, 13:] = 1
    qidx = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    with jax.enable_x64(True):
        layout = entry_layout(jnp.asarray(seg), m)
        t = layout.end.shape[1]
        f64 = lambda *shape: rng.normal(size=shape)  # noqa: E731
        params = {"wq": f64(heads * d, hidden), "ww": f64(heads, hidden), "keys": f64(b, t, d)}
        x, target = f64(b, s, hidden), (f64(b, s, 2, 3), f64(b, t, 3), f64(b, s, 2) + 2.0, 0.3)
        vis = ce.Visibility(jnp.asarray(qidx), jnp.asarray(seg), layout)
        visible = visible_np(qidx, seg, layout.end, layout.segment)
        mass = target_mass_np(*target)

        def project(p, x):
            q = jnp.einsum("bsi,oi->bso", x, p["wq"]).reshape(*x.shape[:2], heads, d)
            return q, jnp.einsum("bsi,hi->bsh", x, p["ww"])

        def problem_of(p):
            return ce.SelectionProblem(
                functools.partial(project, p), (jnp.asarray(x),), p["keys"], vis
            )

        @jax.jit
        def run(params):
            selection, kl = FLOAT64_MEMBERS[name]
            target_ = ce.AttentionTarget(*map(jnp.asarray, target[:3]), target[3])
            loss = jax.value_and_grad(lambda p: kl.loss(problem_of(p), target_, None))
            return selection.select(problem_of(params), k), loss(params)

        def reference(p):  # the KL formula over the float64 scores
            q, w = project(p, jnp.asarray(x))
            logits = jnp.einsum("bshd,btd->bsht", q, p["keys"])
            scores = jnp.einsum("bsh,bsht->bst", w, jnp.maximum(logits, 0.0)) * d**-0.5
            return kl_np(jnp, scores, mass, visible)

        picks, (loss, grads) = run(params)
        want_grads = jax.grad(reference)(params)
        q, w = map(np.asarray, project(params, x))
    want = brute_topk(scores_np(q, w, params["keys"]), visible, k)
    assert (want >= 0).any() and (want == -1).any()
    np.testing.assert_array_equal(picks, want)
    want_loss = kl_np(np, scores_np(q, w, params["keys"]), mass, visible)
    assert want_loss > 0.05
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for name, r in want_grads.items():
        assert np.abs(r).max() > 0, name
        np.testing.assert_allclose(
            grads[name], r, rtol=0, atol=2e-5 * np.abs(r).max(), err_msg=name
        )
