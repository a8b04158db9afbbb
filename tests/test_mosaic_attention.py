"""The Mosaic (Pallas TPU) sparse attention kernel (``MosaicAttention``, here in Pallas' TPU
interpret mode) against the reference kernel (``XlaAttention``): outputs, ``lse`` and every
gradient (queries, keys, values, sinks) within 1e-5 in float32 on every kind of ``Reads`` the
layers build (a band with and without ``extend``'s history, gathered rows by row DMAs from HBM
and from a resident table and by masked tiles, dense entries with and without picks, MLA values
of their own and as the keys' first features), both homes of the backward's gradient tables
(VMEM, and HBM tile by tile, where a rows source's backward reads its rows as tiles; a band's:
a VMEM table, and per-block slabs overlap-added), both layouts of the query-side arrays
(unpadded ``[B, S, h * d]`` for few heads, the kernels' padded rows where head blocks split
the heads), ragged query blocks, packed documents, rows that read nothing, the sink alone,
head blocks that split the heads; the automatic configuration; a randomised sweep of the
kernel's settings against the numpy formula (issue 57, tests/mosaic_sweep.py: tiles of 128 and
512, two head blocks with gradients in HBM, bf16 keys wider than 128 with values of their own,
every read kind and their mixes, repeated and tile-boundary picks, an entry closing at a
block's last query, documents, non-finite queries, keys and values); the kernel contract
(non-finite rows poison exactly their readers, the picks' check in blocks against numpy);
bfloat16; V4 CSA and V3.2 layers; the lowering for a TPU at released shapes and the
benchmark layer's (forward and backward), the tiles kernels' one pick
operand (no transposed copy), the few-head kernels' unpadded operands, the automatic choices
(gather, blocks, VMEM, the query block) up to 64k, a clear error where nothing fits, the
refusal on a GPU and ``AutoAttention``'s choice on a TPU.

Tiny sizes: 11 queries in blocks of 8 (64 for the automatic configuration: 3 heads), chunks of
8 gathered rows (6 picks, or 10: two chunks per query), tiles of 128 over 150 entries (two
tiles, the second skipped by the first block).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import mosaic_sweep as sweep
import numpy as np
import pytest
from attention_helpers import assert_close
from hypothesis import given
from hypothesis import strategies as st
from jaxpr_helpers import gpu_lowering, kernel_dots, tpu_lowering, walk_eqns
from mosaic_sweep import AttentionSetting, attention_data, check_attention, sweep_settings

import csa_eqx as ce
from csa_eqx import MosaicAttention, presets
from csa_eqx._attention import mosaic_cost, mosaic_plan
from csa_eqx._attention import mosaic_layout as layout
from csa_eqx._attention.mosaic_layout import BandRead, DenseRead, RowsRead, TilesRead

S, D, W, T, K_PICKS = 11, 8, 4, 150, 10
SEGMENTS = [[0] * 5 + [1] * 6, [0] * 11]


def inputs(seed: int, batch: int, heads: int, dtype=jnp.float32, k: int = K_PICKS):
    """Queries, window token rows (3 history rows first), 150 entries, sinks, segments, each
    query's ``k`` distinct picks (a random number of them ``-1``; query 0 picks nothing)."""
    r = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(r.normal(size=shape), dtype)  # noqa: E731
    picks = np.stack([r.permutation(T)[:k] for _ in range(batch * S)]).reshape(batch, S, k)
    picks = np.where(np.arange(k) < r.integers(0, k + 1, (batch, S, 1)), picks, -1)
    picks[:, 0] = -1
    arrays = dict(
        q=f(batch, S, heads, D), kv=f(batch, S + W - 1, D), entries=f(batch, T, D),
        sinks=f(heads).astype(jnp.float32),
    )  # fmt: skip
    segment = jnp.asarray(SEGMENTS[:batch], jnp.int32)
    return arrays, segment, jnp.asarray(picks, jnp.int32)


def entry_layout(segment):
    """150 entry slots whose windows end at row ``j // 12 - 1`` (the first 12 empty, the last
    ones after every query): the first query block sees only the first tile."""
    end = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // 12 - 1, (segment.shape[0], T))
    seg = jnp.take_along_axis(segment, jnp.clip(end, 0, S - 1), axis=1)
    return ce.EntryLayout(end, seg, end >= 0)


def reads_of(kind: str, arrays, segment, picks) -> ce.Reads:
    kv, entries = arrays["kv"], arrays["entries"]
    b = segment.shape[0]
    index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (b, S))
    band = ce.BandRows(kv[:, W - 1 :], segment, W)
    picked = ce.Reads((ce.GatheredRows(entries, picks),))
    if kind == "band+picks":
        return picked.join(ce.Reads(band=band))
    if kind == "everything":  # every kind of source at once
        dense = ce.DenseKeys(entries, entry_layout(segment), index, segment)
        return ce.Reads((ce.GatheredRows(entries, picks),), band=band, dense=dense)
    if kind == "band+masked-picks":
        dense = ce.DenseKeys(entries, entry_layout(segment), index, segment, None, picks)
        return ce.Reads(band=band, dense=dense)
    if kind == "picks":
        return picked
    if kind == "latent":  # values: the keys' first 5 features (V3.2's MLA)
        return ce.Reads((ce.GatheredRows(entries, picks, value_width=5),))
    # extend: the ring's 3 rows (row 0's first one empty), then the queries' own; MLA values
    assert kind == "extend-mla"
    history = jnp.asarray([[-1, 0, 0], [0, 0, 0]][:b], jnp.int32)
    values = ce.Reads((ce.GatheredRows(entries, picks, entries[..., :5] * 2.0),))
    return values.join(ce.Reads(band=ce.BandRows(kv, segment, W, history, kv[..., 3:] - 1.0)))


# (reads, kernel, batch, heads, picks per query, sinks)
CASES = {
    # rows copied by vector loads from a resident table, forward and backward (VMEM gradients)
    "latent/rows-resident": ("latent", MosaicAttention(8, 0, 8, 128, "rows", True), 1, 3, 6, False),
    "everything/automatic": ("everything", MosaicAttention(), 2, 3, 6, True),
    "band+masked-picks/tiles/hbm-gradients": (
        "band+masked-picks",
        MosaicAttention(8, 0, 8, 128, "tiles", False, "hbm"),
        1,
        3,
        K_PICKS,
        True,
    ),
    "extend-mla/rows-resident/backward-as-tiles": (
        "extend-mla",
        MosaicAttention(8, 0, 8, 128, "rows", True, "hbm"),
        1,
        3,
        K_PICKS,
        True,
    ),
}


def attend(kernel, kind, sinks, arrays, segment, picks):
    """``(out, lse)`` (the reference in one query block: the fastest to compile)."""
    reads = reads_of(kind, arrays, segment, picks)
    sink = arrays["sinks"] if sinks else None
    return kernel.attend(arrays["q"], reads, sink, 0.3, return_lse=True, query_block=16)


@eqx.filter_jit
def outputs_and_grads(kernel, kind, sinks, arrays, segment, picks, cotangent):
    def loss(arrays):
        out, lse = attend(kernel, kind, sinks, arrays, segment, picks)
        seen = jnp.isfinite(lse)
        return jnp.sum(out * cotangent) + 0.1 * jnp.sum(jnp.where(seen, lse, 0.0)), (out, lse)

    return jax.grad(loss, has_aux=True)(arrays)


def run_case(case: str, arrays=None):
    """The kernel's and the reference's ``(grads, (out, lse))`` on a case's inputs (or
    ``arrays``)."""
    kind, kernel, batch, heads, k, sinks = CASES[case]
    given, segment, picks = inputs(0, batch, heads, k=k)
    arrays = given if arrays is None else arrays
    width = 5 if kind in ("latent", "extend-mla") else D
    cotangent = jax.random.normal(jax.random.key(1), (batch, S, heads, width))
    got = outputs_and_grads(kernel, kind, sinks, arrays, segment, picks, cotangent)
    want = outputs_and_grads(ce.XlaAttention(), kind, sinks, arrays, segment, picks, cotangent)
    return got, want, (arrays, segment, picks)


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_equal_the_reference(case):
    kind, _, _, _, _, sinks = CASES[case]
    got, want, (arrays, segment, picks) = run_case(case)
    (grads, (out, lse)), (ref_grads, (ref_out, ref_lse)) = got, want
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")
    assert set(grads) == {"q", "kv", "entries", "sinks"}
    read = (
        {"q", "entries"} | ({"sinks"} if sinks else set()) | ({"kv"} if kind != "latent" else set())
    )
    for name in grads:
        assert_close(grads[name], ref_grads[name], what=f"d{name}")
        assert (float(jnp.max(jnp.abs(ref_grads[name]))) > 0) == (name in read), name
    if kind == "latent":  # query 0 reads nothing (and has no sink): zeros, lse = -inf
        assert (np.asarray(out)[:, 0] == 0).all() and (np.asarray(lse)[:, 0] == -np.inf).all()


# --- the randomised sweep (issue 57; tests/mosaic_sweep.py) ----------------------------------

# One compiled program each; hypothesis draws the data (picks with repeats, a block's largest
# pick on a tile boundary, an entry closing at a block's last query, documents, non-finite
# queries / keys / values). Together they run every setting the kernel chooses for itself
# (tiles of 512 over more than 512 entries, keys of 128 lanes) and the ones it is forced to.
SWEEP = {
    # three tiles of 128 (boundary picks at 0, 128, 256), two head blocks, gradients in HBM
    # (tiles and the band's slabs summed over the head blocks)
    "band+picks/tiles/hbm/two-head-blocks": AttentionSetting(
        "tiles-hbm", MosaicAttention(8, 8, 8, 128, "tiles", False, "hbm"), "band+picks",
        heads=16, t=260,
    ),
    # bf16 keys 136 wide (two feature blocks in one packed word-row) and values of their own
    # 130 wide (two more), row DMAs in chunks of 8 (the backward's VMEM gradient table)
    "band+picks/bf16-wide-own-values/rows": AttentionSetting(
        "bf16-rows", MosaicAttention(8, 16, 8, 128, "rows"), "band+picks", dtype="bfloat16",
        heads=16, d=136, values=130, s=8,
    ),
    # every kind at once over two packed batch rows, resident tables, ragged query blocks
    "band+picks+dense/tiles/resident": AttentionSetting(
        "everything", MosaicAttention(8, 0, 8, 128, "tiles", True), "band+picks+dense",
        batch=2, heads=3, s=11,
    ),
    # rows copied from a resident table over two batch rows (each step's word-rows at its own
    # row's offset in one flat array), the backward's VMEM gradient table
    "band+picks/rows/resident/two-batch-rows": AttentionSetting(
        "rows-resident", MosaicAttention(8, 0, 8, 128, "rows", True), "band+picks",
        batch=2, heads=3, s=11,
    ),
    # a DenseKeys' picks masked by visibility read as row DMAs, values of their own, gradients
    # in HBM (the rows' backward reads them as tiles)
    "band+masked/rows/hbm/own-values": AttentionSetting(
        "masked", MosaicAttention(8, 0, 8, 128, "rows", False, "hbm"), "band+masked",
        heads=3, values=5, s=11,
    ),
    # the automatic configuration: tiles of 512 over 600 entries, keys of 128 lanes
    "band+picks/automatic/512-tiles": AttentionSetting(
        "automatic", MosaicAttention(), "band+picks", heads=3, d=128, t=600,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SWEEP))
@sweep_settings(4)
@given(data=st.data())
def test_randomised_sweep_against_numpy(name, data):
    """Outputs and ``lse`` against the float64 formula, every gradient against its ``jnp``
    autodiff, on drawn data (tests/mosaic_sweep.py)."""
    setting = SWEEP[name]
    check_attention(setting, attention_data(data.draw, setting))


# --- tile skipping (issue 54, item 4) ---------------------------------------------------------

# 5 tiles of 128 over 600 entries; 4 blocks of 8 queries, each block's picks in a few tiles:
# block 1 skips tile 1 and reads tile 2, block 2 reads only the last tile, block 3 tiles 1 and 3
# (a pick at 384, a tile's first row); a block's last tile is its first query's alone
LOCAL_TILES = ((0,), (0, 2), (4,), (1, 3))
SKIPPING = {
    # two tiles sets (gathered picks, a DenseKeys' masked picks), tiles fetched by DMA, the
    # backward's gradient table in VMEM
    "picks+masked/tiles": AttentionSetting(
        "skip-tiles", MosaicAttention(8, 0, 8, 128, "tiles", False, "vmem"), "picks+masked",
        heads=3, s=32, t=600,
    ),
    # rows forward, the backward's tiles from rows (tiles and their gradient rows in HBM)
    "picks/rows/backward-as-tiles": AttentionSetting(
        "skip-rows", MosaicAttention(8, 0, 8, 128, "rows", False, "hbm"), "picks", heads=3,
        s=32, t=600,
    ),
}  # fmt: skip


def local_data(c: AttentionSetting) -> dict:
    """``attention_data``'s arrays with local picks (``LOCAL_TILES``, distinct; query 0 picks
    nothing), two documents, entries closing in order (entry ``j`` at query ``j * 32 // 600 -
    1``: some picks unseen)."""
    r = np.random.default_rng(7)
    b, s, t, k = c.batch, c.s, c.t, c.k
    # a block's first query picks from its last tile alone, the others from its first tile
    tiles = np.asarray([LOCAL_TILES[q // 8][-1 if q % 8 == 0 else 0] for q in range(s)])
    rows = np.stack([r.permutation(127)[:k] + 1 for _ in range(s)])  # distinct, not row 0
    picks = np.minimum(tiles[:, None] * 128 + rows, t - 1)
    picks = np.where(np.arange(k) < r.integers(1, k + 1, (s, 1)), picks, -1)
    picks[0], picks[24, 0] = -1, 384
    segment = (np.arange(s) >= 20).astype(np.int32)[None].repeat(b, 0)
    end = np.broadcast_to(np.arange(t) * s // t - 1, (b, t)).astype(np.int32)
    data = dict(
        q=r.normal(size=(b, s, c.heads, c.d)), kv=r.normal(size=(b, s, c.d)),
        entries=r.normal(size=(b, t, c.d)), sinks=r.normal(size=c.heads), segment=segment,
        end=end, entry_segment=np.take_along_axis(segment, np.clip(end, 0, s - 1), axis=1),
        picks=np.broadcast_to(picks, (b, s, k)).astype(np.int32),
        cotangent=r.normal(size=(b, s, c.heads, c.width)),
    )  # fmt: skip
    return {key: v.astype(np.float32) if v.dtype == np.float64 else v for key, v in data.items()}


def test_picked_tiles_against_brute_force():
    """Each block's picked tiles (``mosaic_layout.picked_tiles``: OR-reduced bit words, 70
    tiles in three words, tiles 31, 32, 63 and 64 at the words' edges) against a numpy loop;
    ``tiles_ints``' visit lists (the picked tiles in order first) and counts; the SMEM bound
    (``MAX_SKIP_TILES``) and what the released sizes skip."""
    r = np.random.default_rng(11)
    b, nq, qb, width, tile, tiles = 2, 3, 4, 5, 2, 70
    idx = r.integers(-1, tiles * tile, (b, nq * qb, width)).astype(np.int32)
    idx[0, :qb] = -1  # block 0 of row 0: the four word-edge tiles only
    idx[0, 0, :4] = [31 * tile, 32 * tile + 1, 63 * tile, 64 * tile + 1]
    idx[1, qb : 2 * qb] = -1  # block 1 of row 1 picks nothing
    want = np.zeros((b, nq, tiles), bool)
    for i, q, j in zip(*np.nonzero(idx >= 0), strict=True):
        want[i, q // qb, idx[i, q, j] // tile] = True
    got = layout.picked_tiles(jnp.asarray(idx), nq, qb, tile, tiles)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.nonzero(want[0, 0])[0].tolist() == [31, 32, 63, 64]
    (_, visits), counts = layout.tiles_ints(jnp.asarray(idx), nq, qb, tile, tiles)
    np.testing.assert_array_equal(np.asarray(counts), want.sum(-1))
    visits = np.asarray(visits).reshape(b, nq, 128)  # each block's padded to 128
    for i in range(b):
        for q in range(nq):
            assert sorted(visits[i, q, :tiles].tolist()) == list(range(tiles))
            assert visits[i, q, : want[i, q].sum()].tolist() == np.nonzero(want[i, q])[0].tolist()
    assert mosaic_plan.skips(True, 256 * 512, 512) and not mosaic_plan.skips(True, 257 * 512, 1)
    assert not mosaic_plan.skips(True, 256 * 512 + 1, 512) and not mosaic_plan.skips(False, 1, 1)
    # V3.2 at 32k: the backward's tiles (64 of 512) skip
    assert configs("v32", MosaicAttention(), 32768)[1].sources[0].skip


@pytest.mark.parametrize("name", list(SKIPPING))
def test_tile_skipping_with_local_picks(name):
    """Local picks (``LOCAL_TILES``: blocks that leave tiles unpicked, one in the middle of
    those they read): the plan skips (``TilesRead.skip``; its visit counts below the tiles up
    to each block's largest pick); outputs, ``lse`` and every gradient bitwise those of the
    same kernel visiting every tile (``skip_tiles=False``) and within 1e-5 of the numpy
    formula (``mosaic_sweep.check_attention``)."""
    c = SKIPPING[name]
    data = local_data(c)
    a = {key: jnp.asarray(data[key]) for key in ("q", "kv", "entries", "sinks")}
    ints = {key: jnp.asarray(data[key]) for key in ("segment", "end", "entry_segment", "picks")}
    cotangent = jnp.asarray(data["cotangent"])
    plan = mosaic_plan.plan(c.kernel, a["q"], sweep._reads(c, a, ints), True, 0.3)
    static = plan.static
    tiles = [s for s in (*static.config.sources, *static.backward.sources)
             if isinstance(s, TilesRead)]  # fmt: skip
    assert tiles and all(s.skip for s in tiles)
    if isinstance(static.config.sources[0], TilesRead):  # the gathered picks' visits a block
        visits = np.asarray(plan.ints.ntiles).reshape(len(static.config.sources), -1)
        np.testing.assert_array_equal(visits[0], [len(t) for t in LOCAL_TILES])
    check_attention(c, data)  # (first: the independent reference)
    got = sweep.kernel_outputs(c, a, ints, cotangent)
    dense = dataclasses.replace(c, kernel=dataclasses.replace(c.kernel, skip_tiles=False))
    want = sweep.kernel_outputs(dense, a, ints, cotangent)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_nonfinite_rows_reach_only_their_readers():
    """A NaN window row, an Inf entry row (read densely by some queries, picked by others), a
    picked NaN entry and a NaN query, through the automatic configuration: exactly the queries
    that read them (or own them) return NaN, where the reference's do; the others' outputs and
    every gradient agree with it. Whatever the reference: every gradient is finite, and the
    poisoned queries' output cotangents reach none of them (NaN ones give the same gradients
    bitwise)."""
    arrays, segment, picks = inputs(0, 2, 3, k=6)
    arrays["kv"] = arrays["kv"].at[0, 6].set(jnp.nan)  # token 3 of row 0
    arrays["entries"] = arrays["entries"].at[1, 40, 1].set(jnp.inf)  # visible from query 2
    picked = int(np.asarray(picks)[0, 5][np.asarray(picks)[0, 5] >= 0][0])  # (never visible)
    arrays["entries"] = arrays["entries"].at[0, picked].set(jnp.nan)
    arrays["q"] = arrays["q"].at[1, 9, 0, 0].set(jnp.nan)
    got, want, _ = run_case("everything/automatic", arrays)
    (grads, (out, lse)), (ref_grads, (ref_out, ref_lse)) = got, want
    bad = np.isnan(np.asarray(ref_out)).any(axis=(2, 3))
    assert bad.any() and not bad.all() and bad[0, 5]
    np.testing.assert_array_equal(np.isnan(np.asarray(out)).all(axis=(2, 3)), bad)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse)
    for name in grads:
        assert_close(grads[name], ref_grads[name], what=f"d{name}")
        assert np.isfinite(np.asarray(grads[name])).all(), name
    kind, kernel, _, _, _, sinks = CASES["everything/automatic"]
    cotangent = jax.random.normal(jax.random.key(1), (2, S, 3, D))  # run_case's
    cotangent = jnp.where(jnp.asarray(bad)[:, :, None, None], jnp.nan, cotangent)
    again, _ = outputs_and_grads(kernel, kind, sinks, arrays, segment, picks, cotangent)
    for name in grads:
        np.testing.assert_array_equal(np.asarray(again[name]), np.asarray(grads[name]), name)


def test_bf16_and_the_sink_alone():
    """bfloat16 (two features per word) within bf16 rounding of the reference; query 0 reads
    nothing but the sink: zeros, ``lse`` = the sink exactly."""
    arrays, segment, picks = inputs(2, 1, 3, jnp.bfloat16, k=6)
    run = eqx.filter_jit(attend)
    out, lse = run(MosaicAttention(8, 16, 8, 128, "rows"), "picks", True, arrays, segment, picks)
    ref_out, ref_lse = run(ce.XlaAttention(), "picks", True, arrays, segment, picks)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert_close(out, ref_out, rtol=2e-2, what="out")
    assert_close(lse, ref_lse, rtol=1e-2, what="lse")
    assert (np.asarray(out)[:, 0] == 0).all()
    np.testing.assert_array_equal(np.asarray(lse)[0, 0], np.asarray(arrays["sinks"]))


def test_replay_differentiates_as_the_kernel_without_its_forward():
    """``MosaicAttention.replay`` on ``attend``'s own ``(out, lse)`` (the same inputs as
    ``test_nonfinite_rows_reach_only_their_readers``: poisoned queries, whose ``lse`` is NaN,
    and a non-finite query; sinks): the same outputs, every gradient (the ``lse``'s too)
    bitwise ``attend``'s, and no forward kernel in its gradient's program."""
    arrays, segment, picks = inputs(0, 2, 3, k=6)
    arrays["kv"] = arrays["kv"].at[0, 6].set(jnp.nan)
    arrays["entries"] = arrays["entries"].at[1, 40, 1].set(jnp.inf)
    arrays["q"] = arrays["q"].at[1, 9, 0, 0].set(jnp.nan)
    kind, kernel, _, _, _, _ = CASES["everything/automatic"]
    reads_at = lambda a: reads_of(kind, a, segment, picks)  # noqa: E731
    out, lse = kernel.attend(arrays["q"], reads_at(arrays), arrays["sinks"], 0.3, return_lse=True,
                             query_block=16)  # fmt: skip
    assert np.isnan(np.asarray(lse)).any()
    cotangent = jax.random.normal(jax.random.key(1), out.shape)

    def loss(arrays, replayed: bool):
        reads, sinks = reads_at(arrays), arrays["sinks"]
        if replayed:
            o, ls = kernel.replay(arrays["q"], reads, sinks, 0.3, out, lse)
        else:
            o, ls = kernel.attend(arrays["q"], reads, sinks, 0.3, return_lse=True, query_block=16)
        seen = jnp.isfinite(ls)
        return jnp.sum(jnp.where(jnp.isnan(o), 0, o) * cotangent) + 0.1 * jnp.sum(
            jnp.where(seen, ls, 0.0)
        ), (o, ls)

    grad = jax.grad(loss, has_aux=True)
    got, (o, ls) = jax.jit(grad, static_argnums=1)(arrays, True)
    want, _ = jax.jit(grad, static_argnums=1)(arrays, False)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(ls), np.asarray(lse))
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)
    calls = kernel_calls(jax.make_jaxpr(grad, static_argnums=1)(arrays, True).jaxpr)
    assert "mosaic_sparse_attention" not in calls and calls["mosaic_sparse_attention_bwd"] > 0


def test_a_v32_layer_with_the_kernel():
    """A V3.2 layer (packed documents) with ``MosaicAttention``, its latent read once as keys
    and values (``value_width``, through ``latent``): outputs and every parameter's gradient
    within 1e-5 of ``XlaAttention``'s (the V4 layers' reads are the cases above)."""
    base = ce.V32Attention(presets.tiny_v32(), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (2, 24, base.config.hidden_size))
    seg = jnp.asarray([[0] * 9 + [1] * 15, [0] * 24], jnp.int32)

    def loss(model):
        y = model(x, segment_ids=seg)
        return jnp.sum(jnp.sin(y)), y

    run = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))
    kernel = MosaicAttention(8, 0, 8, 128, "tiles")
    got = run(base.with_execution(ce.Execution(attention=kernel)))
    want = run(base.with_execution(ce.Execution(attention=ce.XlaAttention())))
    assert_close(got[1], want[1], what="y")
    for g, r in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        assert_close(g, r, what="grad")


def kernel_calls(jaxpr) -> dict[str, int]:
    """The Mosaic attention kernels' ``pallas_call`` equations in ``jaxpr`` by name (each
    call site once, however often a loop runs it; ``run_mosaic`` may hold more than one
    ``pallas_call`` per call site, one per platform, the same for every kernel)."""
    calls: dict[str, int] = {}
    for eqn in walk_eqns(jaxpr):
        if eqn.primitive.name == "pallas_call":
            name = str(getattr(eqn.params.get("name_and_src_info"), "name", eqn.params.get("name")))
            calls[name] = calls.get(name, 0) + 1
    return calls


@pytest.mark.parametrize("split", ["heads", "queries"])
def test_v32_head_groups_keep_the_kernel_outputs(monkeypatch, split):
    """V3.2 split (forced: 2 groups of 2 heads, or 2 chunks of 12 queries with every head;
    documents packed) with ``MosaicAttention``: the parts that fit ``KEEP`` keep their kernel's
    latent output and ``lse`` for the backward (``MosaicAttention.replay``), so the gradient's
    program runs the forward kernel once per part call site, not twice (the recomputed forward
    of before: ``replaying`` patched to ``None``); with one part of two kept, the kept part's
    call sites run it once, the other's twice. Outputs and every gradient bitwise those of the
    recompute (the shared gradients summed in the same part order), and within 1e-5 of
    ``XlaAttention``'s in one call."""
    from csa_eqx._layers import v32

    base = ce.V32Attention(presets.tiny_v32(), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (2, 24, base.config.hidden_size))
    seg = jnp.asarray([[0] * 9 + [1] * 15, [0] * 24], jnp.int32)
    layer = base.with_execution(ce.Execution(attention=MosaicAttention(8, 0, 8, 128, "tiles")))

    def loss(model):
        y = model(x, segment_ids=seg)
        return jnp.sum(jnp.sin(y)), y

    grad = eqx.filter_grad(loss, has_aux=True)
    want = eqx.filter_jit(grad)(base.with_execution(ce.Execution(attention=ce.XlaAttention())))
    monkeypatch.setattr(v32, "SPLIT", split)
    monkeypatch.setattr(v32, "head_groups" if split == "heads" else "query_chunks", lambda *a: 2)
    monkeypatch.setattr(v32, "KEEP", 2 * (2 * 24 * 2 * 32))  # both parts' [2, 24, 2, 32] (heads)
    kept = kernel_calls(eqx.filter_make_jaxpr(grad)(layer)[0].jaxpr)
    got = eqx.filter_jit(grad)(layer)
    with monkeypatch.context() as m:
        m.setattr(v32, "KEEP", 2 * (2 * 24 * 2 * 32) - 1)  # the first part's only
        one_kept = kernel_calls(eqx.filter_make_jaxpr(grad)(layer)[0].jaxpr)
        partly = eqx.filter_jit(grad)(layer)
    with monkeypatch.context() as m:
        m.setattr(v32, "replaying", lambda *a: None)
        recomputed = kernel_calls(eqx.filter_make_jaxpr(grad)(layer)[0].jaxpr)
        before = eqx.filter_jit(grad)(layer)
    fwd, bwd = "mosaic_sparse_attention", "mosaic_sparse_attention_bwd"
    assert recomputed[fwd] == 2 * recomputed[bwd] > 0, recomputed
    assert kept[fwd] == kept[bwd] == recomputed[bwd], kept
    # two call sites of each (the kept groups' and the recomputed groups'), one recomputing
    assert one_kept[fwd] == 3 * one_kept[bwd] // 2 == 3 * recomputed[bwd], one_kept
    for run in (got, partly):
        for g, r in zip(jax.tree.leaves(run), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    assert_close(got[1], want[1], what="y")
    for g, r in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        assert_close(g, r, what="grad")


def released(kind: str, kernel: MosaicAttention, s: int = 256, entries: int = 0, b: int = 1):
    """A loss over the kernel's attention with released-size reads (bf16), and its abstract
    arguments: V4-Flash CSA (64 heads x 512, 512 picks of ``s / 4`` entries, window 128, sinks)
    or V3.2 DSA (128 heads, 576-wide latents whose first 512 features are the values, 2048
    picks of the ``s`` tokens); ``entries`` other than the prefill's: decoding. ``"few"``: the
    benchmark layer's reads (V4 CSA's with 4 heads x 64). ``b``: batch rows."""
    sd = jax.ShapeDtypeStruct
    seg = jnp.zeros((b, s), jnp.int32)
    if kind == "v4":
        heads, width, rows, k = 64, 512, entries or s // 4, 512
    elif kind == "few":
        heads, width, rows, k = 4, 64, entries or s // 4, 512
    else:
        heads, width, rows, k = 128, 576, entries or s, 2048

    def loss(q, kv, entries, sinks, picks):
        if kind != "v32":
            reads = ce.Reads((ce.GatheredRows(entries, picks),), band=ce.BandRows(kv, seg, 128))
        else:
            reads = ce.Reads((ce.GatheredRows(entries, picks, value_width=512),))
            sinks = None
        out = kernel.attend(q, reads, sinks, 0.05, query_block=16)
        return out.astype(jnp.float32).sum()

    args = (
        sd((b, s, heads, width), jnp.bfloat16), sd((b, s, width), jnp.bfloat16),
        sd((b, rows, width), jnp.bfloat16), sd((heads,), jnp.float32), sd((b, s, k), jnp.int32),
    )  # fmt: skip
    return loss, args


@pytest.mark.parametrize("kind", ["v4", "v32", "few"])
def test_forward_and_backward_lower_for_a_tpu(kind):
    """At the released shapes (bf16) and the benchmark layer's (4 heads x 64: unpadded
    query-side arrays) the forward and the backward lower through Pallas' Mosaic backend for a
    TPU (one kernel each): the automatic configuration (prefill: tiles; decoding: row DMAs),
    rows from HBM and from a resident table (the design whose squeezed batch dimension
    Mosaic's verifier rejected on the chip: the same verifier runs here; and with two batch
    rows, whose flat word-rows Pallas' block rule rejected), tiles with the gradients in HBM,
    head blocks that split the heads, a rows backward read as tiles."""
    kernels = (
        (MosaicAttention(), 256, 0, 1),
        (MosaicAttention(), 1, 8192, 1),
        (MosaicAttention(gather="rows"), 256, 0, 1),
        (MosaicAttention(gather="rows", resident=True), 256, 0, 1),
        (MosaicAttention(gather="rows", resident=True), 256, 0, 2),
        (MosaicAttention(8, 32, 128, 512, "tiles", False, "hbm"), 256, 0, 1),
        (MosaicAttention(gather="rows", gradients="hbm"), 256, 0, 1),
    )
    for kernel, s, entries, b in kernels:
        loss, args = released(kind, kernel, s, entries, b)
        forward = tpu_lowering(loss, *args).as_text()
        backward = tpu_lowering(jax.grad(loss, argnums=(0, 1, 2)), *args).as_text()
        assert forward.count("tpu_custom_call") == 1
        assert backward.count("tpu_custom_call") == 2


def test_dot_precisions_are_explicit():
    """Every dot of the forward and backward kernels names its precision, so a caller's
    ``jax.default_matmul_precision("highest")`` cannot reach it: bfloat16 operands (the
    released shapes' tables, the tiles pass's pick counts) at ``DEFAULT``, where ``HIGHEST``
    makes Mosaic refuse the kernel on a TPU (``Bad lhs type``); float32 ones at ``HIGHEST``."""
    loss, args = released("v4", MosaicAttention(), 256)
    assert kernel_dots(jax.grad(loss, argnums=(0, 1, 2)), *args) == {("bfloat16", "DEFAULT")}
    wide = [
        jax.ShapeDtypeStruct(a.shape, jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args
    ]
    dots = kernel_dots(jax.grad(loss, argnums=(0, 1, 2)), *wide)
    assert dots == {("bfloat16", "DEFAULT"), ("float32", "HIGHEST")}


def test_tiles_kernels_take_the_picks_once():
    """The tiles kernels (forward and backward, at a released V4 shape: 16 blocks of 16
    queries, 512 picks) read the picks ``[B, S, k]`` as their only pick operand: no transposed
    copy per query block ``[B, n_q, k, Qb]`` (16 queries on 128 lanes: 8x padded in HBM) is
    built for them; each grid step transposes its own block."""
    loss, args = released("v4", MosaicAttention(), 256)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
    calls = [eqn for eqn in walk_eqns(jaxpr) if eqn.primitive.name == "pallas_call"]
    assert calls
    for eqn in calls:
        ints = [v.aval.shape for v in eqn.invars if v.aval.dtype == jnp.int32]
        assert ints.count((1, 256, 512)) == 1, ints
        assert not [shape for shape in ints if shape[-2:] == (512, 16)], ints


def configs(kind: str, kernel: MosaicAttention, s: int, entries: int = 0):
    """The forward's and the backward's kernel configurations of a released-size call (traced
    abstractly: nothing runs)."""
    seen = []
    plan = mosaic_plan.plan

    def spy(*args):
        seen.append(plan(*args))
        return seen[-1]

    loss, args = released(kind, kernel, s, entries)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mosaic_plan, "plan", spy)
        jax.eval_shape(jax.grad(loss, argnums=(0, 2)), *args)
    return seen[0].static.config, seen[0].static.backward


KINDS = {RowsRead: "rows", TilesRead: "tiles", DenseRead: "dense", BandRead: "band"}
# (kind, queries, entries) -> gather, head block, resident table, HBM gradients (backward),
# query block, narrow query-side arrays
AUTOMATIC = {
    ("v4", 8192, 0): ("tiles", 64, True, False, 16, False),
    ("v4", 32768, 0): ("rows", 64, True, False, 16, False),  # copies from a resident table
    ("v4", 65536, 0): ("rows", 64, True, False, 16, False),
    ("v4", 1, 8192): ("rows", 64, False, False, 16, False),  # decoding one token at 32k: DMAs
    ("v32", 8192, 0): ("tiles", 64, True, False, 16, False),
    # V3.2 from 16k: rows copied from a resident table forward; their gradients (40 MiB at
    # 16k, 80 at 32k) fit beside it at 16k only under the raised 124 MiB limit; at 32k the
    # backward reads tiles, gradients in HBM
    ("v32", 16384, 0): ("rows", 128, True, False, 16, False),
    ("v32", 32768, 0): ("rows", 128, True, True, 16, False),
    ("v32", 65536, 0): ("rows", 128, False, True, 16, False),  # rows beat tiles; bwd: tiles
    ("few", 32768, 0): ("tiles", 16, True, False, 64, True),
    ("few", 65536, 0): ("tiles", 16, True, False, 64, True),
    ("few", 1, 8192): ("rows", 16, True, False, 64, True),  # its 4 MiB table loads first
}

# the band's gradient: slabs in HBM (True) or a VMEM table (False; where it fits)
BAND_SLABS = {
    ("v4", 8192, 0): [False],
    ("v4", 32768, 0): [True],
    ("v4", 65536, 0): [True],  # its 128 MiB gradient table does not fit
    ("v4", 1, 8192): [False],
    ("few", 32768, 0): [False],
    ("few", 65536, 0): [False],
    ("few", 1, 8192): [False],
}


def test_automatic_choices_fit_vmem_at_released_sizes():
    """The automatic configuration at released sizes and the benchmark layer's up to 64k (the
    cost model): tiles for short prefill; rows copied from a resident table for V4-Flash
    prefill from 32k (and the few-head layer's decoding), where V3.2's tables do not fit; row
    DMAs for V4-Flash decoding and for V3.2 at 64k; 1024
    softmax rows a step for tiles (16 queries x 64 heads at released sizes, 64 queries x 16
    padded heads for 4 heads), resident tables and VMEM gradient tables where the estimate
    fits, a band's gradient table in VMEM where it fits (else per-block slabs in HBM), the
    query-side arrays unpadded (``narrow``) where one head block takes every head and pads
    them, each kernel's estimated VMEM within 80 % of the limit: 100 MiB, raised to 124 for
    V3.2 at 16k, whose rows backward keeps its gradients in VMEM only under it."""
    for (kind, s, entries), want in AUTOMATIC.items():
        forward, backward = configs(kind, MosaicAttention(), s, entries)
        gathered = forward.sources[0]
        got = (KINDS[type(gathered)], forward.head_block, forward.tables[gathered.table].resident,
               backward.tables[backward.sources[0].table].hbm_grads, forward.query_block,
               bool(forward.narrow))  # fmt: skip
        assert got == want, (kind, s, entries)
        assert backward.narrow == forward.narrow == ((4, 64, 64) if want[5] else ())
        bands = [backward.tables[s.table] for s in backward.sources if isinstance(s, BandRead)]
        assert [t.hbm_grads for t in bands] == BAND_SLABS.get((kind, s, entries), []), kind
        assert KINDS[type(backward.sources[0])] == ("tiles" if want[3] else want[0])
        limit = (124 if (kind, s) == ("v32", 16384) else 100) * 2**20  # the raised one
        for config, is_backward in ((forward, False), (backward, True)):
            assert config.vmem_limit == limit, (kind, s, entries)
            assert mosaic_plan.vmem_bytes(config, is_backward) <= 0.8 * config.vmem_limit
    # the configuration the chip measured V3.2's layer with (benchmarks/layer_ab.py's
    # rows-forward), resolved by the automatic one exactly
    forced = MosaicAttention(gather="rows", resident=True, gradients="hbm")
    assert configs("v32", forced, 32768) == configs("v32", MosaicAttention(), 32768)
    # and at 16k its rows-124 (rows both ways, gradients in VMEM under 124 MiB)
    forced = MosaicAttention(gather="rows", resident=True, vmem_limit_bytes=124 * 2**20)
    assert configs("v32", forced, 16384) == configs("v32", MosaicAttention(), 16384)


def test_the_automatic_query_block():
    """``STEP_ROWS`` = 1024 softmax rows over the heads padded to 16, within 16..64 queries."""
    got = [mosaic_plan.auto_query_block(h) for h in (1, 4, 16, 17, 32, 48, 64, 128)]
    assert got == [64, 64, 64, 32, 32, 16, 16, 16]
    assert MosaicAttention().query_block_for(1, 4, None, None) == 64
    assert MosaicAttention(query_block=8).query_block_for(1, 4, None, None) == 8


def test_the_automatic_rows_chunk():
    """The fewest chunks of at most 512 rows, each a whole number of 128 (V4-Flash's 512
    picks: one chunk; V3.2's 2048: four); a call's kernels take it, or the field's."""
    got = [mosaic_plan.auto_key_block(w) for w in (1, 6, 128, 129, 512, 513, 640, 2048)]
    assert got == [128, 128, 128, 256, 512, 384, 384, 512]
    q = jnp.zeros((1, 8, 16, 128), jnp.bfloat16)
    reads = ce.Reads(
        (ce.GatheredRows(jnp.zeros((1, 700, 128)), jnp.zeros((1, 8, 640), jnp.int32)),)
    )
    for kernel, chunk in ((MosaicAttention(gather="rows"), 384),
                          (MosaicAttention(gather="rows", key_block=256), 256)):  # fmt: skip
        config = mosaic_plan.plan(kernel, q, reads, False, 1.0).static.config
        assert (config.chunk, config.sources[0].width) == (chunk, 768)


def test_few_heads_keep_the_query_side_arrays_unpadded():
    """The benchmark layer's reads (4 heads x 64, bf16): the kernels take the queries and the
    output's cotangent and return the output and ``dq`` as ``[B, S, 4 * 64]`` (the queries
    padded to the 64-query block only), not padded to 16 heads x 128 features (8x): no kernel
    operand or result is as large as that padding (each kernel's ``q`` / ``do`` is padded to
    the step's 1024 softmax rows in VMEM; its numerics: the cases above)."""
    s = 200
    loss, args = released("few", MosaicAttention(), s)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
    calls = [eqn for eqn in walk_eqns(jaxpr) if eqn.primitive.name == "pallas_call"]
    unpadded = []
    for eqn in calls:
        floats = [v.aval for v in (*eqn.invars, *eqn.outvars) if v.aval.dtype == jnp.bfloat16]
        unpadded.append([a.shape for a in floats].count((1, 256, 256)))
        assert max(a.size for a in floats) < 256 * 16 * 128, floats
    assert set(unpadded) == {2, 3}  # forward: q, out; backward: q, do, dq


def test_an_unseen_nonfinite_pick_poisons_nothing():
    """Masked picks (a ``DenseKeys``' picks, read as a tiles source the kernel masks by
    visibility): a NaN entry a query picked but cannot see leaves that query finite, as in the
    reference; the NaN pattern and the finite outputs are the reference's."""
    case = "band+masked-picks/tiles/hbm-gradients"
    arrays, segment, picks = inputs(0, 1, 3, k=K_PICKS)
    end = np.asarray(entry_layout(segment).end)[0]
    unseen = [(t, j) for t in range(S) for j in np.asarray(picks)[0, t] if j >= 0 and end[j] > t]
    t, j = unseen[0]
    arrays["entries"] = arrays["entries"].at[0, j].set(jnp.nan)
    (_, (out, _)), (_, (ref_out, _)), _ = run_case(case, arrays)
    bad = np.isnan(np.asarray(ref_out)).any(axis=(2, 3))
    assert not bad[0, t]
    np.testing.assert_array_equal(np.isnan(np.asarray(out)).any(axis=(2, 3)), bad)
    assert_close(
        jnp.where(bad[..., None, None], 0, out), jnp.where(bad[..., None, None], 0, ref_out)
    )


def test_the_picks_check_in_blocks(monkeypatch):
    """The non-finite check of gathered rows (which queries picked a flagged row), in blocks
    of 5 queries (the last one overlapping the one before) and in one block: a numpy loop's
    answer, on picks with ``-1`` (which reads nothing, not row 0)."""
    r = np.random.default_rng(3)
    idx = r.integers(-1, 30, (2, 13, 4)).astype(np.int32)
    bad = r.random((2, 30)) < 0.1
    bad[:, 0] = True  # row 0: what a -1 would read were it not masked
    want = np.array(
        [[any(bad[b, i] for i in idx[b, t] if i >= 0) for t in range(13)] for b in range(2)]
    )
    assert want.any() and not want.all()
    for elements in (2 * 4 * 5, 2**20):
        monkeypatch.setattr(mosaic_plan, "POISON_ELEMENTS", elements)
        got = mosaic_plan.picks_poison(jnp.asarray(bad), jnp.asarray(idx))
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_visible_picks_check_in_blocks(monkeypatch):
    """With a ``DenseKeys``' picks (read as a tiles source the kernel masks by visibility), the
    non-finite check counts only the picks each query sees: a numpy loop's answer over the
    visibility rule, in blocks of 5 queries and in one block."""
    r = np.random.default_rng(5)
    b, s, t, k = 2, 13, 30, 4
    idx = r.integers(-1, t, (b, s, k)).astype(np.int32)
    end = np.sort(r.integers(-1, s, (b, t)), axis=1).astype(np.int32)
    seg, qseg = r.integers(0, 2, (b, t)).astype(np.int32), r.integers(0, 2, (b, s)).astype(np.int32)
    qidx = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    bad = r.random((b, t)) < 0.3

    def seen(row, query, i):
        return 0 <= end[row, i] <= qidx[row, query] and seg[row, i] == qseg[row, query]

    def flagged(visible_only):
        return np.array([[any(bad[row, i] and (seen(row, q, i) or not visible_only)
                              for i in idx[row, q] if i >= 0) for q in range(s)]
                         for row in range(b)])  # fmt: skip

    want = flagged(True)
    assert want.any() and (flagged(False) & ~want).any()  # some flagged picks are not seen
    layout = ce.EntryLayout(jnp.asarray(end), jnp.asarray(seg), None)
    dense = ce.DenseKeys(jnp.zeros((b, t, 8)), layout, jnp.asarray(qidx), jnp.asarray(qseg),
                         None, jnp.asarray(idx))  # fmt: skip
    for elements in (b * k * 5, 2**20):
        monkeypatch.setattr(mosaic_plan, "POISON_ELEMENTS", elements)
        got = mosaic_plan.picks_poison(jnp.asarray(bad), jnp.asarray(idx), dense)
        np.testing.assert_array_equal(np.asarray(got), want)


def test_what_cannot_fit_vmem_is_refused_clearly():
    """A V3.2 table forced resident at 64k (96 MiB) and its gradients forced into VMEM (160
    MiB): ``ValueError`` naming the VMEM needed and what to change, not Mosaic's error."""
    with pytest.raises(ValueError, match=r"forward kernel needs about \d+ MiB of VMEM"):
        configs("v32", MosaicAttention(resident=True), 65536)
    with pytest.raises(ValueError, match=r"backward kernel needs .* gradients='hbm'"):
        configs("v32", MosaicAttention(gather="tiles", gradients="vmem"), 65536)


def test_cost_model_of_the_gather():
    """The measured cost model (20.5 ns a row DMA, 136 TFLOP/s of tiles work; rows copied from
    a resident table at 2.3 ns each and 96 TFLOP/s of their arithmetic) reproduces the chip's
    V4-Flash CSA forward timings within 2x (8k: tiles 17.7 ms, rows 84.1 ms; 32k: 141.6 /
    332 ms, resident rows 71.4 ms with the band's ~10) and their order; decoding one token at
    32k, the resident table's load (16 MiB) costs more than its 512 row DMAs."""
    v4 = dict(sets=[(8192 // 4, 512)], heads=64, width=1024, tile=512, qb=16)
    ways = ("tiles", "rows", "resident")
    for s, want in ((8192, (17.7e-3, 84.1e-3, None)), (32768, (141.6e-3, 332e-3, 71.4e-3))):
        v4["sets"] = [(s // 4, 512)]
        got = {way: mosaic_cost.gather_seconds(way, s, **v4) for way in ways}
        for way, seconds in zip(ways, want, strict=True):
            assert seconds is None or seconds / 2 < got[way] < 2 * seconds, (s, way)
        order = ["tiles", "resident", "rows"] if s == 8192 else ["resident", "tiles", "rows"]
        assert sorted(ways, key=got.get) == order, (s, got)
    v4["sets"] = [(8192, 512)]
    assert mosaic_cost.gather_seconds("rows", 1, **v4) < mosaic_cost.gather_seconds(
        "resident", 1, **v4
    )


def test_resident_rows_are_offered_for_gathered_sets_only():
    """At 16k (V4-Flash's 512 picks of 4096 entries) the cost model takes rows copied from a
    resident table for gathered rows, but not for a ``DenseKeys``' masked picks (read as rows
    they would take XLA's gathers of their entries' ends first: tiles) nor where the kernel
    says ``resident=False`` (row DMAs cost more than tiles there)."""
    s, t = 16384, 4096
    q = jax.ShapeDtypeStruct((1, s, 64, 512), jnp.bfloat16)  # only its shape is read
    ints = jnp.zeros((1, s), jnp.int32)
    keys, picks = jnp.zeros((1, t, 512), jnp.bfloat16), jnp.zeros((1, s, 512), jnp.int32)
    layout = ce.entry_layout(ints, 4)
    masked = ce.Reads(dense=ce.DenseKeys(keys, layout, ints, ints, None, picks))
    gathered = ce.Reads((ce.GatheredRows(keys, picks),))
    cases = ((MosaicAttention(), gathered, ("rows", True)),
             (MosaicAttention(), masked, ("tiles", False)),
             (MosaicAttention(resident=False), gathered, ("tiles", False)))  # fmt: skip
    for kernel, reads, want in cases:
        sizes = mosaic_plan.block_sizes(kernel, q, reads)
        assert (sizes.gather, sizes.resident) == want


def test_a_gpu_is_refused_by_name():
    loss, args = released("v4", MosaicAttention(), s=64)
    with pytest.raises(NotImplementedError, match="'mosaic_sparse_attention' is a Mosaic"):
        gpu_lowering(loss, *args)


def test_auto_attention_takes_it_on_a_tpu(monkeypatch):
    """On a TPU (the backend faked as the other choosers' tests do) ``AutoAttention`` picks
    ``MosaicAttention()`` under exact-softmax numerics, ``XlaAttention`` under numerics that
    round the attention and ``ExpandedAttention`` for DeepSeek's expanded MLA."""
    from csa_eqx import _backend
    from csa_eqx._attention.base import LatentUp

    up = LatentUp(jnp.zeros((4, 2)), 1, 1, expanded=True)
    monkeypatch.setattr(_backend.jax, "default_backend", lambda: "tpu")
    assert ce.AutoAttention().choose() == MosaicAttention()
    assert ce.AutoAttention().choose(ce.ExactNumerics()) == MosaicAttention()
    assert ce.AutoAttention().choose(ce.DeepSeekInference()) == ce.XlaAttention()
    assert ce.AutoAttention().choose(ce.DeepSeekInference(), up) == ce.ExpandedAttention()


def test_fields_and_numerics_are_checked():
    with pytest.raises(ValueError, match="key_block must be an int >= 0"):
        MosaicAttention(key_block=-8)
    with pytest.raises(ValueError, match="key_block must be a multiple of 8"):
        MosaicAttention(key_block=12)
    with pytest.raises(ValueError, match="query_block must be 0 or a multiple of 8"):
        MosaicAttention(query_block=12)
    with pytest.raises(ValueError, match="tile_block must be a multiple of 128"):
        MosaicAttention(tile_block=64)
    with pytest.raises(ValueError, match="head_block must be 0 or a multiple of 8"):
        MosaicAttention(head_block=4)
    with pytest.raises(ValueError, match="gather must be one of"):
        MosaicAttention(gather="dense")
    with pytest.raises(ValueError, match="gradients must be one of"):
        MosaicAttention(gradients="smem")
    with pytest.raises(ValueError, match="vmem_limit_bytes must be an int >= 1 or None"):
        MosaicAttention(vmem_limit_bytes=0)
    with pytest.raises((TypeError, ValueError), match="skip_tiles"):  # (or jaxtyping's check)
        MosaicAttention(skip_tiles=1)
    q = jnp.zeros((1, 5, 2, 4))
    with pytest.raises(ValueError, match="at least one key set"):
        MosaicAttention().attend(q, ce.Reads(), None, 1.0, query_block=4)
    with pytest.raises(ValueError, match="MosaicAttention computes the exact softmax"):
        MosaicAttention().attend(q, ce.Reads(), None, 1.0, query_block=4,
                                 numerics=ce.DeepSeekInference())  # fmt: skip
    with pytest.raises(ValueError, match="MosaicAttention computes the exact softmax"):
        ce.Execution(attention=MosaicAttention(), numerics=ce.DeepSeekInference())
    reads = ce.Reads((ce.GatheredRows(jnp.zeros((1, 3, 4)), jnp.zeros((1, 5, 2), jnp.int32)),))
    with pytest.raises(ValueError, match="head_block must be a multiple of 16 for bfloat16"):
        MosaicAttention(head_block=8).attend(q.astype(jnp.bfloat16), reads, None, 1.0,
                                             query_block=4)  # fmt: skip
