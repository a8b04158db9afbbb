"""The fused indexer kernel (``PallasSelection``: scoring + exact top-k in one Pallas kernel,
here in interpret mode) selects what the XLA streaming selection selects, bitwise, and what
the numpy brute force of test_topk_reference.py selects; it writes no ``[B, S, T]`` array; it
lowers to Triton for a GPU; ``AutoSelection`` picks it on a GPU only (a TPU gets the Mosaic
kernel, tests/test_mosaic_selection.py).

Inputs are small integers wherever the comparison is with the XLA scorer (every score exact in
float32, so the bitwise claim does not rest on the contraction order): many exact ties, packed
documents, empty slots, queries that see nothing, ``k`` above the visible count. Tiny blocks
(``query_block`` 4 to 8, ``key_block`` 2 to 8) give several query blocks, skipped key tiles,
partial blocks, buffer compactions and several kernel calls (``query_chunk``).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import gpu_lowering, walk_avals
from test_topk_reference import B, S, T, brute_force, fixed_case, layout_of

import csa_eqx as ce
from csa_eqx import _backend

REFERENCE = ce.XlaScorer()
TRITON_DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
# (name, k, PallasSelection fields): every branch of the kernel
BLOCKS = {
    "compacting": (3, dict(query_block=4, key_block=2)),  # a compaction every other tile
    "chunked": (5, dict(query_block=8, key_block=4, query_chunk=8)),  # two calls, rows pulled back
    "k-above-visible": (20, dict(query_block=4, key_block=8)),  # k > T: every visible entry
}


def problem(q, w, keys, qi, qs, layout, head_chunk=0, score_dtype=None, scorer=REFERENCE):
    """The ``SelectionProblem`` of projected float32 queries, weights and keys."""
    visibility = ce.Visibility(jnp.asarray(qi), jnp.asarray(qs), layout)
    f32 = [jnp.asarray(a, jnp.float32) for a in (q, w, keys)]
    return ce.SelectionProblem.from_queries(*f32, visibility, head_chunk, score_dtype, scorer)


@eqx.filter_jit
def selections(strategies, k, *args, **kw):
    """Each strategy's selection of one problem, in one program."""
    p = problem(*args, **kw)
    return [s.select(p, k) for s in strategies]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_selection_equals_streaming_and_brute_force(name):
    k, fields = BLOCKS[name]
    q, w, keys, qi, qs, end = fixed_case(7)
    layout = layout_of(end, qs)
    streaming = ce.StreamingSelection(key_block=3, query_block=5, topk_block=6)
    got, want = selections((ce.PallasSelection(**fields), streaming), k, q, w, keys, qi, qs, layout)
    np.testing.assert_array_equal(got, want)
    seg = np.asarray(layout.segment)
    np.testing.assert_array_equal(got, brute_force(q, w, keys, qi, qs, end, seg, k))
    picks = np.asarray(got)
    assert (picks == -1).all(-1).any() and (picks >= 0).all(-1).any() == (k <= 5)


def v4_case(seed, s=29, heads=4, dim=16, m=2):
    """V4 CSA-like: compressed entries (``m`` tokens each, segment-aligned), two packed
    documents in row 0; integer keys near one common key, so the logits are large (bf16 rounds
    them, to ties) and close, while float32 holds every score exactly (``d = 16``)."""
    r = np.random.default_rng(seed)
    q = r.integers(-16, 17, (2, s, heads, dim))
    w = r.integers(-3, 4, (2, s, heads)) * 4
    seg = np.zeros((2, s), np.int32)
    seg[0, 11:] = 1
    layout = ce.entry_layout(jnp.asarray(seg), m)
    t = layout.end.shape[1]
    sparse = r.integers(-1, 2, (2, t, dim)) * (r.random((2, t, dim)) < 0.1)
    keys = r.integers(-8, 9, (1, 1, dim)) + sparse
    qi = np.broadcast_to(np.arange(s, dtype=np.int32), (2, s))
    return q, w, keys, qi, seg, layout


def test_bf16_scores_round_alike_in_compressed_entries():
    """V4 CSA's entries, scores rounded to bf16 (which here changes scores and picks) and
    summed over chunks of two heads: the kernel's selection is the streaming one's, bitwise;
    a document's first token sees no entry yet (all ``-1``)."""
    q, w, keys, qi, seg, layout = v4_case(0)
    k = 3
    kernel = ce.PallasSelection(query_block=8, key_block=2)
    streaming = ce.StreamingSelection(key_block=2, query_block=4)
    f32 = ce.indexer_scores(*(jnp.asarray(a, jnp.float32) for a in (q, w, keys)))
    bf16 = ce.indexer_scores(
        *(jnp.asarray(a, jnp.float32) for a in (q, w, keys)), score_dtype="bfloat16"
    )
    assert not np.array_equal(f32, bf16)  # bf16 really rounds here
    args = (q, w, keys, qi, seg, layout)
    got, want = selections((kernel, streaming), k, *args, head_chunk=2, score_dtype="bfloat16")
    np.testing.assert_array_equal(got, want)
    exact, _ = selections((kernel, streaming), k, *args, head_chunk=2)
    assert not np.array_equal(got, exact)  # the rounding reached the picks
    firsts = np.asarray(got)[[0, 0, 1], [0, 11, 0]]  # each document's first token
    assert (firsts == -1).all() and (np.asarray(got)[:, 1:11] >= 0).any()


def test_random_float_scores_select_alike():
    """Random float inputs: the kernel's selection equals the streaming selection over the
    same in-kernel tile scores (``PallasScorer`` with the kernel's tiles), bitwise: the
    selection is exact given the scores."""
    r = np.random.default_rng(3)
    q, w = r.normal(size=(B, S, 2, 24)), r.normal(size=(B, S, 2))
    keys = r.normal(size=(B, T, 24))
    _, _, _, qi, qs, end = fixed_case(3)
    layout = layout_of(end, qs)
    scorer = ce.PallasScorer(query_block=4, key_block=4)
    kernel = ce.PallasSelection(query_block=4, key_block=4)
    streaming = ce.StreamingSelection(key_block=4, query_block=4)
    got, want = selections((kernel, streaming), 4, q, w, keys, qi, qs, layout, scorer=scorer)
    np.testing.assert_array_equal(got, want)


def test_no_score_matrix_in_the_program():
    """The fused selection's program (the kernel's own body included) holds no array of
    ``B x S x T`` elements or more; the dense selection's does (the walk can fail)."""
    b, s, t, k = 1, 256, 256, 8
    q = jnp.zeros((b, s, 4, 16))
    w, keys = jnp.zeros((b, s, 4)), jnp.zeros((b, t, 16))
    seg = jnp.zeros((b, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    layout = ce.entry_layout(seg, 1)

    def largest(strategy):
        p = ce.SelectionProblem.from_queries(q, w, keys, ce.Visibility(qi, seg, layout))
        jaxpr = jax.make_jaxpr(lambda: strategy.select(p, k))()
        return max(np.prod(a.shape, dtype=int) for a in walk_avals(jaxpr.jaxpr) if a.shape)

    assert largest(ce.PallasSelection(query_block=16, key_block=16)) < b * s * t
    assert largest(ce.DenseSelection()) >= b * s * t


@pytest.mark.filterwarnings(TRITON_DEPRECATED)
def test_lowers_to_triton():
    """At a GPU's sizes (bf16, 64 heads x 128, k = 512, head chunks) the kernel lowers through
    Pallas' Triton backend for CUDA (no GPU needed; compiling it needs one)."""
    b, s, h, d = 1, 1024, 64, 128
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((b, s, h), jnp.float32)
    keys = jax.ShapeDtypeStruct((b, s // 4, d), jnp.bfloat16)
    seg = jnp.zeros((b, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))

    def select(q, w, keys):
        vis = ce.Visibility(qi, seg, ce.entry_layout(seg, 4))
        p = ce.SelectionProblem.from_queries(q, w, keys, vis, 16, "bfloat16")
        return ce.PallasSelection().select(p, 512)

    assert gpu_lowering(select, q, w, keys).count("__gpu$xla.gpu.triton") == 1


def test_auto_selection_picks_the_triton_kernel_on_a_gpu_only(monkeypatch):
    q, w, keys, qi, qs, end = fixed_case(1)
    plain = problem(q, w, keys, qi, qs, layout_of(end, qs))
    filtered = ce.CandidateVisibility.within(plain.visibility, jnp.zeros((B, S, 1), jnp.int32), 4)
    candidates = plain._replace(visibility=filtered)  # a pre-filter that bites: 1 block kept
    auto = ce.AutoSelection()
    assert isinstance(auto.strategy(plain), ce.DenseSelection)  # CPU: unchanged
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "gpu")
    assert auto.strategy(plain) == ce.PallasSelection()
    assert isinstance(auto.strategy(candidates), ce.DenseSelection)  # V4.1 consumers: gathered
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):  # sharded by the compiler
        assert isinstance(auto.strategy(plain), ce.DenseSelection)
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "tpu")  # the Mosaic kernel
    assert auto.strategy(plain) == ce.MosaicSelection()


def test_fields_are_checked():
    for field in ("query_block", "key_block"):
        with pytest.raises(ValueError, match=f"PallasSelection.{field} must be a power of two"):
            ce.PallasSelection(**{field: 6})
    with pytest.raises(ValueError, match="query_chunk"):
        ce.PallasSelection(query_chunk=-1)
