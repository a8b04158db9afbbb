"""The sparse attention kernel (``PallasAttention``, here in interpret mode) against the
reference kernel (``XlaAttention``): outputs, ``lse`` and every gradient (queries, keys, values,
sinks) within 1e-5 relative in float32, on every kind of ``Reads`` the layers build (V4 CSA's
band + gathered or masked picks, HCA's band + dense entries, V3.2's MLA picks with their own
values, ``extend``'s band with a history, the gathered window); the kernel contract
(non-finite rows, rows that see nothing); whole V4 CSA, HCA and V3.2 layers with both kernels;
no ``[S, S + T]`` mask in the program; the Triton lowering; ``AutoAttention``.

Tiny tiles (``query_block`` 4, ``key_block`` 2) over 11 query rows give partial programs,
several tiles per read set and lanes past the end of each; row 0 of the gathered sets picks
nothing, and packed documents leave rows with few visible entries.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_close
from jaxpr_helpers import gpu_lowering, tpu_lowering, walk_avals

import csa_eqx as ce
from csa_eqx import _backend, presets

B, S, H, D, W, T, K = 2, 11, 3, 8, 4, 6, 3
KERNEL = ce.PallasAttention(query_block=4, key_block=2)
TRITON_DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"


def inputs(seed=0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), dtype)  # noqa: E731
    seg = jnp.asarray([[0] * 5 + [1] * 6, [0] * 11], jnp.int32)
    first = r.integers(0, T, (B, S, 1))
    picks = (first + np.arange(K)) % T  # distinct per query
    picks = np.where(np.arange(K) < r.integers(0, K + 1, (B, S, 1)), picks, -1)
    picks[:, 0] = -1  # a query that picks nothing
    arrays = dict(q=f(B, S, H, D), kv=f(B, S + W - 1, D), entries=f(B, T, D), sinks=f(H))
    return arrays, seg, jnp.asarray(picks, jnp.int32)


def reads_of(kind, kv, entries, seg, picks):
    """The ``Reads`` of one layer path (entries: segment-aligned, 2 tokens each)."""
    index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    layout = ce.EntryLayout(*(a[:, :T] for a in ce.entry_layout(seg, 2)))
    band = ce.BandRows(kv, seg, W)
    if kind == "csa-gathered":
        return ce.Reads((ce.GatheredRows(entries, picks),), band=band)
    if kind == "csa-masked":
        return ce.Reads(band=band, dense=ce.DenseKeys(entries, layout, index, seg, None, picks))
    if kind == "hca":
        return ce.Reads(band=band, dense=ce.DenseKeys(entries, layout, index, seg))
    if kind == "v32":  # MLA: keys and (narrower) values differ
        tokens = jnp.where(picks >= 0, picks + W, -1)
        return ce.Reads((ce.GatheredRows(kv, tokens, kv[..., :5] * 2.0),))
    if kind == "extend":  # the ring's 3 rows (one empty), then the queries' own
        history = jnp.asarray([[-1, 0, 0], [0, 0, 0]], jnp.int32)
        band = ce.BandRows(kv, seg, W, history)
        return ce.Reads((ce.GatheredRows(entries, picks),), band=band)
    assert kind == "gathered-window"
    return (
        ce.GatheredWindow()
        .reads(kv, index, seg, W)
        .join(ce.Reads((ce.GatheredRows(entries, picks),)))
    )


KINDS = ["csa-gathered", "csa-masked", "hca", "v32", "extend", "gathered-window"]


def attend(kernel, kind, arrays, seg, picks):
    """``(out, lse)`` of ``kernel`` over the reads of ``kind`` (``arrays``: ``inputs``')."""
    q, kv, entries = arrays["q"], arrays["kv"], arrays["entries"]
    sinks = None if kind == "v32" else arrays["sinks"]
    reads = reads_of(kind, kv, entries, seg, picks)
    return kernel.attend(q, reads, sinks, 0.3, return_lse=True, query_block=4)


@eqx.filter_jit
def outputs_and_grads(kernel, kind, arrays, seg, picks, cotangent):
    def loss(arrays):
        out, lse = attend(kernel, kind, arrays, seg, picks)
        seen = jnp.isfinite(lse)
        return jnp.sum(out * cotangent) + 0.1 * jnp.sum(jnp.where(seen, lse, 0.0)), (out, lse)

    return jax.grad(loss, has_aux=True)(arrays)


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_and_gradients_equal_the_reference(kind):
    arrays, seg, picks = inputs()
    cotangent = jax.random.normal(jax.random.key(1), (B, S, H, 5 if kind == "v32" else D))
    got = outputs_and_grads(KERNEL, kind, arrays, seg, picks, cotangent)
    want = outputs_and_grads(ce.XlaAttention(), kind, arrays, seg, picks, cotangent)
    (grads, (out, lse)), (ref_grads, (ref_out, ref_lse)) = got, want
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")
    for name in grads:
        assert_close(grads[name], ref_grads[name], what=f"d{name}")
    assert float(jnp.max(jnp.abs(ref_grads["q"]))) > 0
    if kind == "v32":  # query 0 picks nothing (and has no sink): zeros, lse = -inf
        assert (np.asarray(out)[:, 0] == 0).all() and (np.asarray(lse)[:, 0] == -np.inf).all()


def test_bf16_within_bf16_rounding():
    arrays, seg, picks = inputs(2, jnp.bfloat16)
    arrays["sinks"] = arrays["sinks"].astype(jnp.float32)
    run = eqx.filter_jit(attend)
    out, lse = run(KERNEL, "csa-gathered", arrays, seg, picks)
    ref_out, ref_lse = run(ce.XlaAttention(), "csa-gathered", arrays, seg, picks)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref_out, rtol=2e-2, what="out")
    assert_close(lse, ref_lse, rtol=1e-2, what="lse")


def test_nonfinite_rows_reach_only_their_readers():
    """A NaN key row, an Inf value row (dense entries) and a NaN query: exactly the queries
    that read them (or own them) return NaN, as the reference says; the others agree."""
    arrays, seg, picks = inputs(3)
    arrays["kv"] = arrays["kv"].at[0, 6].set(jnp.nan)  # token 3 of row 0 (history rows first)
    arrays["entries"] = arrays["entries"].at[1, 2, 1].set(jnp.inf)
    arrays["q"] = arrays["q"].at[1, 9, 0, 0].set(jnp.nan)
    run = eqx.filter_jit(attend)
    for kind in ("hca", "extend"):
        out, lse = run(KERNEL, kind, arrays, seg, picks)
        ref_out, ref_lse = run(ce.XlaAttention(), kind, arrays, seg, picks)
        bad = np.isnan(np.asarray(ref_out)).any(axis=(2, 3))
        assert bad.any() and not bad.all()
        np.testing.assert_array_equal(np.isnan(np.asarray(out)).all(axis=(2, 3)), bad)
        assert_close(out, ref_out, what=kind)  # NaN exactly where the reference's
        assert_close(lse, ref_lse, what=kind)


def layer(kind, execution):
    if kind == "v32":
        return ce.V32Attention(presets.tiny_v32(), key=jax.random.key(0), execution=execution)
    return ce.V4Attention(presets.tiny_v4(kind), key=jax.random.key(0), execution=execution)


@pytest.mark.parametrize("kind", ["csa", "hca", "v32"])
def test_layers_with_both_kernels(kind):
    """A whole layer with ``PallasSelection`` and ``PallasAttention``: the selection bitwise
    the default's, outputs within 1e-5, packed documents; for V4 CSA also every parameter's
    gradient (the other layers' reads are the kernel tests' above)."""
    kernels = ce.Execution(
        selection=ce.PallasSelection(query_block=8, key_block=4), attention=KERNEL
    )
    base = layer(kind, ce.Execution())
    x = jax.random.normal(jax.random.key(2), (2, 24, base.config.hidden_size))
    seg = jnp.asarray([[0] * 9 + [1] * 15, [0] * 24], jnp.int32)

    def loss(model):
        y, aux = model(x, segment_ids=seg, return_aux=True)
        return jnp.sum(jnp.sin(y)), (y, aux["selection"])

    run = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True) if kind == "csa" else loss)
    got, want = run(base.with_execution(kernels)), run(base)
    (_, (y, selection)), (_, (ref_y, ref_selection)) = got, want
    if kind != "hca":
        assert (np.asarray(ref_selection) >= 0).any()
        np.testing.assert_array_equal(selection, ref_selection)
    assert_close(y, ref_y, what="y")
    if kind == "csa":
        for g, r in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
            assert_close(g, r, what="grad")


def test_no_dense_mask_in_the_program():
    """The kernel's forward and backward (kernel bodies included) hold no ``[S, S + T]``-sized
    array, over gathered or masked picks; the reference run as one block does (the walk can
    fail)."""
    s, t, k, w, h, d = 512, 128, 8, 16, 4, 16
    q = jnp.zeros((1, s, h, d))
    kv, entries = jnp.zeros((1, s, d)), jnp.zeros((1, t, d))
    seg = jnp.zeros((1, s), jnp.int32)
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))
    layout = ce.entry_layout(seg, 4)
    picks = jnp.zeros((1, s, k), jnp.int32)

    def largest(kernel, dense_picks, block=64):
        band = ce.BandRows(kv, seg, w)
        if dense_picks:
            dense = ce.DenseKeys(entries, layout, index, seg, None, picks)
            reads = ce.Reads(band=band, dense=dense)
        else:
            reads = ce.Reads((ce.GatheredRows(entries, picks),), band=band)

        def loss(q):
            return jnp.sum(kernel.attend(q, reads, None, 1.0, query_block=block))

        jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
        return max(np.prod(a.shape, dtype=int) for a in walk_avals(jaxpr.jaxpr) if a.shape)

    assert largest(ce.PallasAttention(), True) < s * (s + t)
    assert largest(ce.PallasAttention(), False) < s * (s + t)
    # the reference in one block of every query: its band slab alone is [S, S + W - 1] per head
    assert largest(ce.XlaAttention(), True, block=s) >= s * (s + t)


@pytest.mark.filterwarnings(TRITON_DEPRECATED)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_and_backward_lower_to_triton(dtype):
    """V4-sized (64 heads x 512, window 128, 512 picks, sinks) and V3.2-sized (128 heads,
    keys 576 = 512 + 64 wide, values 512) reads: the forward and the backward lower through
    Pallas' Triton backend for CUDA."""
    b, s, t = 1, 256, 64
    seg = jnp.zeros((b, s), jnp.int32)
    sd = jax.ShapeDtypeStruct

    def v4(q, kv, entries, picks, sinks):
        reads = ce.Reads((ce.GatheredRows(entries, picks),), band=ce.BandRows(kv, seg, 128))
        return ce.PallasAttention().attend(q, reads, sinks, 0.1, query_block=16)

    def v32(q, kv, entries, picks, sinks):
        reads = ce.Reads((ce.GatheredRows(kv, picks, kv[..., :512]),))
        return ce.PallasAttention().attend(q, reads, None, 0.1, query_block=16)

    for fn, h, d in ((v4, 64, 512), (v32, 128, 576)):
        args = (
            sd((b, s, h, d), dtype), sd((b, s, d), dtype), sd((b, t, d), dtype),
            sd((b, s, 512), jnp.int32), sd((h,), jnp.float32),
        )  # fmt: skip

        def grads(q, kv, entries, picks, sinks, fn=fn):
            loss = lambda *a: fn(*a, picks, sinks).astype(jnp.float32).sum()  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))(q, kv, entries)

        assert gpu_lowering(fn, *args).count("__gpu$xla.gpu.triton") == 1
        assert gpu_lowering(grads, *args).count("__gpu$xla.gpu.triton") == 2


def test_every_kernel_refuses_a_tpu_by_name():
    """Forced on a TPU, each Triton kernel (the fused indexer, the attention forward and
    backward, the scorer, also under ``vmap``) stops at lowering with csa_eqx's message naming
    it, not Pallas' bare assertion; the CPU lowering of the same programs is unchanged."""
    b, s, t, h, d = 1, 16, 8, 2, 16
    sd = jax.ShapeDtypeStruct
    seg = jnp.zeros((b, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))

    def select(q, w, keys):
        vis = ce.Visibility(qi, seg, ce.entry_layout(seg, 2))
        return ce.PallasSelection().select(ce.SelectionProblem.from_queries(q, w, keys, vis), 4)

    def attend(q, entries, picks):
        reads = ce.Reads((ce.GatheredRows(entries, picks),))
        return ce.PallasAttention().attend(q, reads, None, 0.1, query_block=16)

    def attend_grad(q, entries, picks):
        return jax.grad(lambda q: attend(q, entries, picks).sum())(q)

    def scores(q, w, keys):
        return ce.PallasScorer().scores(q, w, keys)

    f32 = jnp.float32
    indexer = (sd((b, s, h, d), f32), sd((b, s, h), f32), sd((b, t, d), f32))
    attn = (indexer[0], sd((b, t, d), f32), sd((b, s, 4), jnp.int32))
    stacked = tuple(sd((3, *a.shape), a.dtype) for a in indexer)
    cases = (
        ("indexer_topk", select, indexer),
        ("sparse_attention", attend, attn),
        ("sparse_attention", attend_grad, attn),
        ("indexer_scores", scores, indexer),
        ("indexer_scores", jax.vmap(scores), stacked),
    )
    for name, fn, args in cases:
        with pytest.raises(NotImplementedError, match=f"Pallas kernel '{name}' is a Triton"):
            tpu_lowering(fn, *args)
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",))


def test_auto_attention_runs_the_kernel_on_a_gpu(monkeypatch):
    assert ce.Execution().attention == ce.AutoAttention()
    assert ce.AutoAttention().choose() == ce.XlaAttention()  # CPU: the reference
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "gpu")
    assert ce.AutoAttention().choose() == ce.PallasAttention()
    # DeepSeek's rounded softmax is XlaAttention's only: the kernel refuses it
    assert ce.AutoAttention().choose(ce.DeepSeekInference()) == ce.XlaAttention()
    assert ce.AutoAttention().choose(ce.ExactNumerics()) == ce.PallasAttention()
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):  # Explicit axes: XLA, unless inside a shard_map over all of them
        assert ce.AutoAttention().choose() == ce.XlaAttention()
        chosen = []

        def local(x):
            chosen.append(ce.AutoAttention().choose())
            return x

        x = jax.device_put(jnp.zeros((8, 4)), jax.NamedSharding(mesh, jax.P("data")))
        jax.jit(jax.shard_map(local, in_specs=jax.P("data"), out_specs=jax.P("data")))(x)
        assert chosen == [ce.PallasAttention()]
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "tpu")  # the Mosaic kernel
    assert ce.AutoAttention().choose() == ce.MosaicAttention()


def test_fields_are_checked():
    with pytest.raises(ValueError, match="key_block must be a power of two"):
        ce.PallasAttention(key_block=6)
    with pytest.raises(ValueError, match="query_block must be an int >= 1"):
        ce.PallasAttention(query_block=0)
    with pytest.raises(ValueError, match="at least one key set"):
        KERNEL.attend(jnp.zeros((1, 5, 2, 4)), ce.Reads(), None, 1.0, query_block=4)
    with pytest.raises(ValueError, match="PallasAttention computes the exact softmax"):
        q = jnp.zeros((1, 5, 2, 4))
        KERNEL.attend(q, ce.Reads(), None, 1.0, query_block=4, numerics=ce.DeepSeekInference())
