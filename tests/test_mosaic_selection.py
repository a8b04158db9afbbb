"""The Mosaic fused indexer (``MosaicSelection``: scoring + exact top-k in one Pallas TPU kernel,
here in Pallas' TPU interpreter, which ``run_mosaic`` runs on the CPU: simulated memories,
out-of-bounds reads raising) selects what the XLA selections select, bitwise, and what the numpy
brute force of test_topk_reference.py selects; it lowers for a TPU at realistic sizes (so an
unsupported primitive fails here, not on the chip), refuses other platforms and blocks below
Mosaic's tiles by name; ``AutoSelection`` takes it on a TPU.

Inputs are small integers (every score exact in float32, so the bitwise claim does not rest on
the contraction order): many exact ties (zero scores from the ReLU), packed documents, empty
slots, queries that see nothing, ``k`` above the visible count. Tiny blocks (``query_block`` 4
to 8, ``key_block`` 4 to 8: chunks of that many lanes) give several query blocks, skipped and
ragged key tiles, several output tiles and several kernel calls; one case runs the TPU's own
128-lane chunks (``key_block`` 256: two chunks per tile). Each of the three threshold searches
runs, and the tie search on rows with more ties than room. A randomised sweep (issue 57,
tests/mosaic_sweep.py) runs d = 128 (where ``d^-1/2`` is not a power of two, so the rounding
order of DeepSeek's bf16 scores shows), bf16 inputs and scores, head chunks, key tiles of 8,
16 and the automatic 512, against the numpy model of the scores and the brute-force top-k
(it replaced the hand-picked bf16 cases). The selection family's conformance
suite runs the kernel as a member too (tests/test_conformance_selection.py: rows whose every
score ties, bf16 head weights that bf16 must round, no gradient through the picks, a V4.1
consumer refused and a candidate source streamed, no entries at all).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jaxpr_helpers import gpu_lowering, kernel_dots, tpu_lowering, walk_avals
from mosaic_sweep import SelectionSetting, check_selection, selection_data, sweep_settings
from test_topk_reference import B, S, brute_force, fixed_case, layout_of
from test_triton_selection import problem, selections

import csa_eqx as ce
from csa_eqx import _backend
from csa_eqx._mosaic import MOSAIC_REFUSED
from csa_eqx._selection.auto import candidate_source
from csa_eqx._selection.candidate_source import StreamingCandidates
from csa_eqx._selection.mosaic_topk import NAME, TPU_BLOCKS, TPU_VMEM
from csa_eqx._selection.row_chunks import kernel_row_chunks

DENSE = ce.DenseSelection()  # select_topk over indexer_scores: the XLA reference
STREAMING = ce.StreamingSelection(key_block=3, query_block=5, topk_block=6)
# (k, MosaicSelection fields): every branch of the kernel
BLOCKS = {
    # two key tiles of 8 lanes, three query blocks; interpolated and halved threshold steps
    "tiles": (3, dict(query_block=4, key_block=8, search="secant")),
    # k > T: every visible entry, three output tiles of 8; halvings that stop on a count of k
    "k-above-visible": (20, dict(query_block=8, key_block=8, search="early")),
    # two kernel calls (the second pulled back over the first), tiles of 4, 32 halvings
    "chunked": (2, dict(query_block=4, key_block=4, search="bisect", query_chunk=8)),
}


def brute(q, w, keys, qi, qs, layout, k):
    """``brute_force`` of test_topk_reference.py over a layout."""
    end, seg = np.asarray(layout.end), np.asarray(layout.segment)
    return brute_force(q, w, keys, qi, qs, end, seg, k)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_selection_equals_xla_and_brute_force(name):
    k, fields = BLOCKS[name]
    q, w, keys, qi, qs, end = fixed_case(7)
    layout = layout_of(end, qs)
    args = (q, w, keys, qi, qs, layout)
    reference = STREAMING if name == "tiles" else DENSE
    got, want = selections((ce.MosaicSelection(**fields), reference), k, *args)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, brute(*args, k))
    picks = np.asarray(got)
    assert (picks == -1).all(-1).any()  # queries that see nothing
    assert (picks >= 0).all(-1).any() == (k <= 5) and (picks[..., -1] == -1).any()


def test_full_lane_chunks_on_token_keys():
    """V3.2 token keys (m = 1), causal, the TPU's 128-lane chunks (two per key tile of 256),
    ``k`` = 130 over two output tiles, query blocks of 32 with a ragged end, a second document
    in one row."""
    r = np.random.default_rng(11)
    s, heads, dim, k = 136, 2, 16, 130
    q = r.integers(-1, 2, (B, s, heads, dim))
    w = r.integers(-2, 3, (B, s, heads))
    keys = r.integers(-1, 2, (B, s, dim))
    qs = np.zeros((B, s), np.int32)
    qs[1, 96:] = 1  # a second document in row 1
    qi = np.broadcast_to(np.arange(s, dtype=np.int32), (B, s))
    layout = ce.entry_layout(jnp.asarray(qs), 1)
    args = (q, w, keys, qi, qs, layout)
    kernel = ce.MosaicSelection(query_block=32, key_block=256)
    got, want = selections((kernel, DENSE), k, *args)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, brute(*args, k))
    picks = np.asarray(got)
    assert ((picks >= 0).sum(-1) == k).any() and ((picks >= 0).sum(-1) < k).any()


# --- the randomised sweep (issue 57; tests/mosaic_sweep.py) ----------------------------------

# d = 128 (the released indexer width: d^-1/2 is not a power of two, so the order in which the
# weight, d^-1/2 and the bf16 roundings apply shows in the picks), bf16 scores, head chunks,
# key tiles of 8 and 16 lanes and the automatic 512 over more than 512 entries.
SELECTION_SWEEP = {
    "d128/bf16-scores/head-chunks": SelectionSetting(
        "chunks", ce.MosaicSelection(query_block=8, key_block=16, head_group=2, search="secant"),
        head_chunk=2, score_dtype="bfloat16", k=5,
    ),
    "d128/bf16-inputs-and-scores/k-above-visible": SelectionSetting(
        "bf16", ce.MosaicSelection(query_block=8, key_block=8, search="bisect"),
        dtype="bfloat16", score_dtype="bfloat16", k=12, batch=2,
    ),
    "d128/automatic/512-key-tiles": SelectionSetting(
        "automatic", ce.MosaicSelection(), t=520, score_dtype="bfloat16", k=9,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SELECTION_SWEEP))
@sweep_settings(4)
@given(data=st.data())
def test_randomised_sweep_against_brute_force(name, data):
    """The picks bitwise the brute force's over the numpy scores (DeepSeek's bf16 einsum
    modelled by ``scores_np``), on drawn documents, layouts and tied keys."""
    setting = SELECTION_SWEEP[name]
    check_selection(setting, selection_data(data.draw, setting))


def test_no_score_matrix_in_the_program():
    """The fused selection's program (the kernel's body and scratch included) holds no array
    of ``B x S x T`` elements or more."""
    b, s, t, k = 1, 256, 256, 8
    q, w, keys = jnp.zeros((b, s, 4, 16)), jnp.zeros((b, s, 4)), jnp.zeros((b, t, 16))
    seg = jnp.zeros((b, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    vis = ce.Visibility(qi, seg, ce.entry_layout(seg, 1))
    p = ce.SelectionProblem.from_queries(q, w, keys, vis)
    strategy = ce.MosaicSelection(query_block=16, key_block=128)
    jaxpr = jax.make_jaxpr(lambda: strategy.select(p, k))()
    assert max(np.prod(a.shape, dtype=int) for a in walk_avals(jaxpr.jaxpr) if a.shape) < s * t


def lowering_case(dtype, heads: int, k: int, m: int, s: int, strategy, **problem_fields):
    """A selection at a TPU's sizes (``B = 1``, causal, ``d = 128``) and its abstract inputs."""
    seg = jnp.zeros((1, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))

    def select(q, w, keys):
        vis = ce.Visibility(qi, seg, ce.entry_layout(seg, m))
        return strategy.select(
            ce.SelectionProblem.from_queries(q, w, keys, vis, **problem_fields), k
        )

    sd = jax.ShapeDtypeStruct
    args = (
        sd((1, s, heads, 128), dtype),
        sd((1, s, heads), jnp.float32),
        sd((1, -(-s // m), 128), dtype),
    )
    return select, args


@pytest.mark.parametrize(
    "dtype, heads, k, m, search, fields",
    [
        (jnp.bfloat16, 64, 512, 4, "early", {}),  # the benchmark layer's indexer
        (jnp.bfloat16, 32, 2048, 1, "bisect", {}),  # the reference shape's (V3.2 token keys)
        (jnp.float32, 64, 512, 4, "secant", dict(head_chunk=16, score_dtype="bfloat16")),
    ],
)
def test_lowers_for_a_tpu(dtype, heads, k, m, search, fields):
    """At realistic blocks (the defaults: 256 queries, key tiles of 512, 16 heads per matmul)
    the kernel lowers through Pallas' Mosaic lowering for a TPU (compiling it needs the chip):
    one Mosaic call."""
    strategy = ce.MosaicSelection(search=search)
    select, args = lowering_case(dtype, heads, k, m, 4096, strategy, **fields)
    assert tpu_lowering(select, *args).as_text().count("tpu_custom_call") == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dot_precisions_are_explicit(dtype):
    """Every dot in the kernel names its precision, so a caller's
    ``jax.default_matmul_precision("highest")`` cannot reach it: float32 scores at ``HIGHEST``,
    bfloat16 dots (the scores of bf16 inputs, the compaction's rank) at ``DEFAULT``. Left to
    the context, the bf16 rank dot took ``HIGHEST`` and Mosaic refused the float32 layer on a
    TPU v5e (``Bad lhs type``, 2026-12-06)."""
    select, args = lowering_case(dtype, 16, 512, 4, 1024, ce.MosaicSelection())
    scores = "HIGHEST" if dtype == jnp.float32 else "DEFAULT"
    assert kernel_dots(select, *args) == {("bfloat16", "DEFAULT"), (jnp.dtype(dtype).name, scores)}


def test_refuses_other_platforms_small_blocks_and_too_many_keys():
    """Lowered for a GPU the kernel stops with a message naming it; on a TPU so do blocks
    below Mosaic's tiles (they run in interpret mode only) and keys that cannot stay in VMEM,
    which ``MosaicSelection.fits`` foresees."""
    select, args = lowering_case(jnp.bfloat16, 2, 8, 4, 256, ce.MosaicSelection())
    with pytest.raises(NotImplementedError, match=re.escape(MOSAIC_REFUSED.format(name=NAME)[:60])):
        gpu_lowering(select, *args)
    small = ce.MosaicSelection(key_block=64)
    select, args = lowering_case(jnp.bfloat16, 2, 8, 4, 256, small)
    with pytest.raises(NotImplementedError, match=re.escape(TPU_BLOCKS[:60])):
        tpu_lowering(select, *args)
    assert "key_block >= 128" in TPU_BLOCKS
    # 2^20 token keys of 128 bf16 channels: 256 MiB, resident per batch row
    select, args = lowering_case(jnp.bfloat16, 2, 8, 1, 1 << 20, ce.MosaicSelection())
    with pytest.raises(NotImplementedError, match=re.escape(TPU_VMEM[:60])):
        tpu_lowering(select, *args)
    assert "StreamingSelection" in TPU_VMEM


def choice_at(s: int, m: int, heads: int = 4):
    """``AutoSelection``'s choice for a causal problem of ``s`` bf16 queries over entries of
    ``m`` tokens (traced with shapes only, the TPU's tiles)."""
    seg = jnp.zeros((1, s), jnp.int32)
    qi = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))
    vis = ce.Visibility(qi, seg, ce.entry_layout(seg, m))
    chosen = []

    def choose(q, w, keys):
        p = ce.SelectionProblem.from_queries(q, w, keys, vis, tiles=_backend.TPU_TILES)
        chosen.append(ce.AutoSelection().strategy(p))
        return w

    sd = jax.ShapeDtypeStruct
    q, keys = sd((1, s, heads, 128), jnp.bfloat16), sd((1, -(-s // m), 128), jnp.bfloat16)
    jax.eval_shape(choose, q, sd((1, s, heads), jnp.float32), keys)
    return chosen[0]


def test_auto_selection_takes_the_kernel_on_a_tpu(monkeypatch):
    """On a (faked) TPU backend ``AutoSelection`` takes ``MosaicSelection`` for a plain
    problem (under a compiler-sharded mesh too), not where a V4.1 pre-filter bites, or where the
    keys cannot stay in VMEM (there: the XLA streaming top-k); on a GPU the XLA path."""
    q, w, keys, qi, qs, end = fixed_case(1)
    plain = problem(q, w, keys, qi, qs, layout_of(end, qs))
    filtered = ce.CandidateVisibility.within(plain.visibility, jnp.zeros((B, S, 1), jnp.int32), 4)
    auto = ce.AutoSelection()
    assert isinstance(auto.strategy(plain), ce.DenseSelection)  # CPU: unchanged
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "tpu")
    assert auto.strategy(plain) == ce.MosaicSelection()
    assert choice_at(32768, 4, heads=64) == ce.MosaicSelection()
    assert isinstance(auto.strategy(plain._replace(visibility=filtered)), ce.DenseSelection)
    assert isinstance(choice_at(1 << 20, 1), ce.StreamingSelection)
    # a TPU mesh the compiler shards: the kernel still (per device: csa_eqx._mesh.per_device)
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    tpus = jax.sharding.AbstractMesh((2, 4), ("data", "tensor"), explicit, abstract_device=device)
    with jax.sharding.use_abstract_mesh(tpus):
        assert auto.strategy(plain) == ce.MosaicSelection()
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "gpu")
    assert isinstance(auto.strategy(plain), ce.DenseSelection)


def test_candidates_are_refused_or_streamed():
    """A V4.1 consumer's pre-filtered problem is refused by name; a candidate source's blocks
    come from the streaming candidate source with the kernel's query chunk."""
    q, w, keys, qi, qs, end = fixed_case(1)
    plain = problem(q, w, keys, qi, qs, layout_of(end, qs))
    filtered = ce.CandidateVisibility.within(plain.visibility, jnp.zeros((B, S, 1), jnp.int32), 4)
    with pytest.raises(TypeError, match="MosaicSelection scores a plain Visibility"):
        ce.MosaicSelection().select(plain._replace(visibility=filtered), 3)
    source = candidate_source(ce.MosaicSelection(query_chunk=4), plain)
    assert source == StreamingCandidates(query_block=4)


def test_fields_are_checked():
    for field in ("query_block", "key_block", "head_group"):
        with pytest.raises(ValueError, match=f"MosaicSelection.{field} must be a power of two"):
            ce.MosaicSelection(**{field: 6})
    with pytest.raises(ValueError, match="search"):
        ce.MosaicSelection(search="sort")
    with pytest.raises(ValueError, match="query_chunk"):
        ce.MosaicSelection(query_chunk=-1)
    q, w, keys, qi, qs, end = fixed_case(1)
    with pytest.raises(NotImplementedError, match="float32's exponent range"):
        p = problem(q, w, keys, qi, qs, layout_of(end, qs), score_dtype="float16")
        ce.MosaicSelection().select(p, 3)
    with pytest.raises(ValueError, match="k must be positive"):
        ce.MosaicSelection().select(problem(q, w, keys, qi, qs, layout_of(end, qs)), 0)


@pytest.mark.parametrize("s, query_chunk, chunk", [(40, 24, 20), (40, 40, 40), (37, 16, 16)])
def test_row_chunks_are_balanced_and_cover_every_row_once(s, query_chunk, chunk):
    """The fused kernels' row chunks (``kernel_row_chunks``, shared by ``MosaicSelection`` and
    ``TritonSelection``): a stub kernel that answers each row with its own query index shows
    every row answered by a call covering it, in as few calls as ``query_chunk`` allows, each
    as short as whole blocks of 4 allow (40 rows at most 24 a call: two calls of 20, where a
    chunk of 24 made the second call redo 8 rows; 37 at 16: three of 16), and each row given
    to the kernel to select exactly once (the last call, pulled back to end at ``S``, passes
    the rows an earlier call selected as seeing nothing: query index ``-1``)."""
    seen, selected = [], []

    def stub(q, w, keys, layout, query_index, query_segment):
        seen.append(q.shape[1])
        jax.debug.callback(lambda qi: selected.append(np.asarray(qi)), query_index)
        return jnp.broadcast_to(query_index[..., None], (*query_index.shape, 3))

    seg = jnp.zeros((1, s), jnp.int32)
    qi = jnp.arange(s, dtype=jnp.int32)[None]
    vis = ce.Visibility(qi, seg, ce.entry_layout(seg, 4))
    q = jnp.zeros((1, s, 2, 8))
    p = ce.SelectionProblem.from_queries(q, jnp.ones((1, s, 2)), jnp.zeros((1, -(-s // 4), 8)), vis)
    out = kernel_row_chunks(
        p, 3, stub, "stub", block=4, key_block=4, per_row=0, query_chunk=query_chunk
    )
    assert seen == [chunk]
    np.testing.assert_array_equal(
        np.asarray(out), np.broadcast_to(np.arange(s)[None, :, None], (1, s, 3))
    )
    passed = np.concatenate([qi.ravel() for qi in selected])
    np.testing.assert_array_equal(np.sort(passed[passed >= 0]), np.arange(s))
