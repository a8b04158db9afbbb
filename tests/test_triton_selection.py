"""The fused indexer kernel (``TritonSelection``, here in interpret mode) beyond what the
selection family's conformance suite checks (tests/test_conformance_selection.py: its picks
against the numpy brute force on exact ties, packed documents, empty slots, queries that see
nothing, ``k`` above the visible count, bf16 scores, several kernel calls, inside the
row-sharded map): on random float scores it selects what the streaming selection selects over
the same in-kernel tile scores; it writes no ``[B, S, T]`` array; it lowers to Triton for a
GPU.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_helpers import gpu_lowering, walk_avals
from test_topk_reference import B, S, T, fixed_case, layout_of

import csa_eqx as ce

REFERENCE = ce.XlaScorer()
TRITON_DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"


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


def test_random_float_scores_select_alike():
    """Random float inputs: the kernel's selection equals the streaming selection over the
    same in-kernel tile scores (``TritonScorer`` with the kernel's tiles), bitwise: the
    selection is exact given the scores."""
    r = np.random.default_rng(3)
    q, w = r.normal(size=(B, S, 2, 24)), r.normal(size=(B, S, 2))
    keys = r.normal(size=(B, T, 24))
    _, _, _, qi, qs, end = fixed_case(3)
    layout = layout_of(end, qs)
    scorer = ce.TritonScorer(query_block=4, key_block=4)
    kernel = ce.TritonSelection(query_block=4, key_block=4)
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

    assert largest(ce.TritonSelection(query_block=16, key_block=16)) < b * s * t
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
        return ce.TritonSelection().select(p, 512)

    assert gpu_lowering(select, q, w, keys).count("__gpu$xla.gpu.triton") == 1


def test_fields_are_checked():
    for field in ("query_block", "key_block"):
        with pytest.raises(ValueError, match=f"TritonSelection.{field} must be a power of two"):
            ce.TritonSelection(**{field: 6})
    with pytest.raises(ValueError, match="query_chunk"):
        ce.TritonSelection(query_chunk=-1)
