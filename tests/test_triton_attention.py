"""The sparse attention kernel (``TritonAttention``, here in interpret mode) beyond what the
attention family's conformance suite checks (tests/test_conformance_attention.py: outputs,
``lse`` and gradients on every kind of ``Reads`` against softmax attention written out, bf16,
non-finite rows, the refusal of DeepSeek's rounded softmax): whole V4 CSA, HCA and V3.2 layers
with both kernels; no ``[S, S + T]`` mask in the program; the Triton lowering; the refusal on
a TPU; its fields.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_helpers import assert_close
from jaxpr_helpers import gpu_lowering, tpu_lowering, walk_avals

import csa_eqx as ce
from csa_eqx import presets

KERNEL = ce.TritonAttention(query_block=4, key_block=2)
TRITON_DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"


def layer(kind, execution):
    if kind == "v32":
        return ce.V32Attention(presets.tiny_v32(), key=jax.random.key(0), execution=execution)
    return ce.V4Attention(presets.tiny_v4(kind), key=jax.random.key(0), execution=execution)


@pytest.mark.parametrize("kind", ["csa", "hca", "v32"])
def test_layers_with_both_kernels(kind):
    """A whole layer with ``TritonSelection`` and ``TritonAttention``: the selection bitwise
    the default's, outputs within 1e-5, packed documents; for V4 CSA also every parameter's
    gradient (the other layers' reads are the kernel tests' above)."""
    kernels = ce.Execution(
        selection=ce.TritonSelection(query_block=8, key_block=4), attention=KERNEL
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

    assert largest(ce.TritonAttention(), True) < s * (s + t)
    assert largest(ce.TritonAttention(), False) < s * (s + t)
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
        return ce.TritonAttention().attend(q, reads, sinks, 0.1, query_block=16)

    def v32(q, kv, entries, picks, sinks):
        reads = ce.Reads((ce.GatheredRows(kv, picks, kv[..., :512]),))
        return ce.TritonAttention().attend(q, reads, None, 0.1, query_block=16)

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
        return ce.TritonSelection().select(ce.SelectionProblem.from_queries(q, w, keys, vis), 4)

    def attend(q, entries, picks):
        reads = ce.Reads((ce.GatheredRows(entries, picks),))
        return ce.TritonAttention().attend(q, reads, None, 0.1, query_block=16)

    def attend_grad(q, entries, picks):
        return jax.grad(lambda q: attend(q, entries, picks).sum())(q)

    def scores(q, w, keys):
        return ce.TritonScorer().scores(q, w, keys)

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


def test_fields_are_checked():
    with pytest.raises(ValueError, match="key_block must be a power of two"):
        ce.TritonAttention(key_block=6)
    with pytest.raises(ValueError, match="query_block must be an int >= 1"):
        ce.TritonAttention(query_block=0)
    with pytest.raises(ValueError, match="at least one key set"):
        KERNEL.attend(jnp.zeros((1, 5, 2, 4)), ce.Reads(), None, 1.0, query_block=4)
    with pytest.raises(ValueError, match="TritonAttention computes the exact softmax"):
        q = jnp.zeros((1, 5, 2, 4))
        KERNEL.attend(q, ce.Reads(), None, 1.0, query_block=4, numerics=ce.DeepSeekInference())
