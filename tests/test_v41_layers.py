"""V4.1 layers: what each role traces, the published state, packed documents and run-time
wiring errors (docs/v41.md)."""

from collections import Counter
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import block_top, visible_np
from jaxpr_helpers import walk_eqns
from test_v41_config import SIZES

import csa_eqx as ce
from csa_eqx.presets import tiny_v4

CONFIG = ce.V41AttentionConfig(
    compress_ratios=(0, 2, 2, 1, 1, 1),
    kv_source_layers=(1, 3),
    index_source_layers=(1, 3, 4),
    candidate_source_layer=3,
    candidate_topk_blocks=2,
    candidate_block_size=4,
    **SIZES,
)
# what the indexer's top-k leaves in a jaxpr: the radix select's order keys, its running pick
# counts, and the selection's remat tag
# the stacks run jitted: eagerly, every primitive would be compiled as a program of its own
run_stack = eqx.filter_jit(ce.run_v41_stack)
TOPK_PRIMITIVES = {"bitcast_convert_type", "shift_right_logical", "cumsum", "name"}


def candidate_entries(blocks, block_size: int, entries: int) -> np.ndarray:
    """The bool ``[B, S, T]`` entry mask of candidate block ids ``[B, S, Nb]`` (``-1`` =
    none), in numpy: every slot of a kept block."""
    blocks = np.asarray(blocks)
    slot_block = np.arange(entries) // block_size
    return (blocks[..., None, :] == slot_block[:, None]).any(-1)


def _stack(execution=None):
    keys = jax.random.split(jax.random.key(0), CONFIG.num_layers)
    layers = [ce.V41Attention(CONFIG, i, key=k, execution=execution) for i, k in enumerate(keys)]
    # non-trivial norms and sinks, so that nothing is accidentally symmetric
    return [
        eqx.tree_at(
            lambda m: m.block.sinks, layer, 0.5 * jax.random.normal(k, layer.block.sinks.shape)
        )
        for layer, k in zip(layers, keys, strict=True)
    ]


def test_roles_own_what_they_should():
    layers = _stack()
    owned = [(type(L.compressor).__name__, type(L.indexer).__name__) for L in layers]
    assert owned == [
        ("NoneType", "NoneType"),
        ("V41Compressor", "IndexerHeads"),
        ("NoneType", "NoneType"),
        ("V41Compressor", "IndexerHeads"),
        ("NoneType", "IndexerHeads"),
        ("NoneType", "NoneType"),
    ]
    assert layers[1].compressor.gate_proj is not None  # ratio 2 pools with a gate
    assert layers[3].compressor.gate_proj is None  # ratio 1 does not


def test_reuse_layers_trace_no_topk():
    """A jaxpr count: index sources tag one selection and run the top-k; reuse layers run no
    compressor, indexer or top-k, and trace the sliding layer's loops only."""
    layers = _stack(ce.Execution(save_selection=True))
    x = jax.random.normal(jax.random.key(1), (1, 24, 32))
    _, published = run_stack(layers, x)
    counts = []
    for i, layer in enumerate(layers):
        shared = published[i - 1] if i else None
        jaxpr = jax.make_jaxpr(lambda x, s, layer=layer: layer(x, shared=s))(x, shared).jaxpr
        counts.append(Counter(e.primitive.name for e in walk_eqns(jaxpr)))
    tags = [c["name"] for c in counts]
    assert tags == [0, 1, 0, 1, 1, 0]
    for i in (0, 2, 5):
        assert not TOPK_PRIMITIVES & set(counts[i]), (i, TOPK_PRIMITIVES & set(counts[i]))
        assert counts[i]["scan"] == counts[0]["scan"]
    for i in (1, 3, 4):
        assert set(counts[i]) >= TOPK_PRIMITIVES


def test_published_state():
    layers = _stack()
    x = jax.random.normal(jax.random.key(2), (2, 24, 32))
    _, pub = ce.run_v41_stack(layers, x)  # eagerly: what is passed on is the same object
    assert pub[0] == ce.V41Shared()
    assert pub[1].entries.shape == (2, 12, 16) and pub[1].keys.shape == (2, 12, 16)
    assert pub[2] is pub[1]  # a reuse layer publishes nothing
    assert pub[3].entries.shape == (2, 24, 16) and pub[3].candidates.shape == (2, 24, 2)
    assert pub[4].entries is pub[3].entries and pub[4].candidates is pub[3].candidates
    assert pub[4].selection is not pub[3].selection and pub[5] is pub[4]
    # ratio 2: entry j is visible from t = 2j + 1; early rows pad with -1
    sel = np.asarray(pub[1].selection)
    assert (sel[:, 0] == -1).all() and (sel[:, 1] == [0, -1, -1, -1]).all()
    assert (sel < (np.arange(24)[None, :, None] + 1) // 2).all()


def test_packed_documents_match_alone():
    """Windows, groups and the candidate grid restart per document; with documents whose
    lengths are multiples of bc·m entries' tokens, packing changes nothing."""
    layers = _stack()
    x = jax.random.normal(jax.random.key(3), (1, 32, 32))
    seg = jnp.array([[0] * 16 + [1] * 16])
    packed, _ = run_stack(layers, x, segment_ids=seg)
    first, _ = run_stack(layers, x[:, :16])
    second, _ = run_stack(layers, x[:, 16:])
    for i in range(CONFIG.num_layers):
        np.testing.assert_allclose(packed[i][:, :16], first[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(packed[i][:, 16:], second[i], rtol=1e-5, atol=1e-6)


def test_candidate_blocks_rules():
    # one query seeing 10 entries in blocks of 4: [0-3], [4-7], [8-9 (+2 unseen)]
    scores = jnp.array([[[5.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 9, 9]]])
    visible = jnp.arange(12)[None, None] < 10
    blocks = ce.candidate_blocks(scores, visible, 2, 4)
    assert np.asarray(blocks).tolist() == [[[0, 2]]]  # block ids, increasing
    kept = candidate_entries(blocks, 4, 12)[0, 0]
    # the newest block is pinned (its unseen slots too), then the best other block
    assert kept.tolist() == [True] * 4 + [False] * 4 + [True] * 4
    # ties go to the lower block; nothing visible keeps nothing
    tied = candidate_entries(ce.candidate_blocks(jnp.zeros((1, 1, 12)), visible, 2, 4), 4, 12)
    assert tied[0, 0].tolist() == [True] * 4 + [False] * 4 + [True] * 4
    none = ce.candidate_blocks(scores, jnp.zeros((1, 1, 12), bool), 2, 4)
    assert (np.asarray(none) == -1).all()
    # fewer reachable blocks than Nb: the rest is -1
    assert np.asarray(ce.candidate_blocks(scores, visible, 4, 4)).tolist() == [[[0, 1, 2, -1]]]


def test_run_time_wiring_errors():
    layers = _stack()
    x = jnp.ones((1, 8, 32))
    with pytest.raises(ce.V41WiringError, match="layer 2 .* no published entries"):
        layers[2](x)
    with pytest.raises(ce.V41WiringError, match="layers 0..n-1 of one config in order"):
        ce.run_v41_stack(layers[1:], x)
    # one DeepSeekInference reads every family's formats; its blocks must fit the sizes
    v4 = ce.Execution(numerics=ce.DeepSeekInference())
    with pytest.raises(ValueError, match=r"index_head_dim=16 must be a multiple of 32"):
        layers[1].with_execution(v4)
    v41 = ce.Execution(numerics=ce.DeepSeekV41Inference())
    with pytest.raises(ValueError, match=r"head_dim=16 must be a multiple of 32"):
        ce.V41Attention(CONFIG, 1, key=jax.random.key(0), execution=v41)
    with pytest.raises(ValueError, match=r"the numerics of V4.1 layers"):
        ce.V4Attention(tiny_v4("csa"), key=jax.random.key(0), execution=v41)


def test_extend_packed_chunks_equal_forward():
    """Chunks 11 + 1 + 20 with a document boundary inside the first chunk (odd lengths, so a
    ratio-2 group stays open across chunks) equal the packed forward."""
    layers = _stack()
    x = np.asarray(jax.random.normal(jax.random.key(4), (1, 32, 32)))  # numpy slices
    seg = np.array([[3] * 7 + [5] * 25], np.int32)
    full, _ = run_stack(layers, x, segment_ids=seg)
    caches = [layer.init_cache(1, 32) for layer in layers]
    outs = [[] for _ in layers]
    for s0, s1 in [(0, 11), (11, 12), (12, 32)]:
        s = jnp.asarray(seg[:, s0:s1])
        ys, caches, _ = ce.extend_v41_stack(
            layers,
            jnp.asarray(x[:, s0:s1]),
            caches,
            segment_ids=s,
            step=eqx.filter_jit(ce.V41Attention.extend),
        )
        for i, y in enumerate(ys):
            outs[i].append(y)
    for i in range(CONFIG.num_layers):
        got = np.concatenate(outs[i], axis=1)
        np.testing.assert_allclose(got, full[i], rtol=1e-5, atol=1e-6)


def _np_topk(scores, allowed, k):
    """numpy brute force of the exact top-k among ``allowed`` (ties to the lower index)."""
    out = np.full((*scores.shape[:2], k), -1)
    for i, j in np.ndindex(*scores.shape[:2]):
        idx = np.nonzero(allowed[i, j])[0]
        picks = sorted(sorted(idx, key=lambda e: (-scores[i, j, e], e))[:k])
        out[i, j, : len(picks)] = picks
    return out


def candidate_pair(nb: int, bc: int, **sizes) -> ce.V41AttentionConfig:
    """Two ratio-1 layers: a KV source that is the candidate source (``Nb``, ``bc``) and a
    reindex consumer within its candidates; ``SIZES`` with ``sizes`` changed."""
    return ce.V41AttentionConfig(
        compress_ratios=(1, 1),
        kv_source_layers=(0,),
        index_source_layers=(0, 1),
        candidate_source_layer=0,
        candidate_topk_blocks=nb,
        candidate_block_size=bc,
        **{**SIZES, **sizes},
    )


def _consumer_case(nb: int, bc: int, k: int, selection: ce.AbstractSelection, s: int = 23):
    """A ratio-1 candidate source (layer 0) and its reindex consumer (layer 1) over ``s``
    tokens: the consumer's selection, and a numpy top-k within the published candidates' mask
    over the scores of the consumer's own queries against the published keys."""
    config = candidate_pair(nb, bc, index_topk=k)
    execution = ce.Execution(selection=selection)
    layers = [
        ce.V41Attention(config, i, key=jax.random.key(i), execution=execution) for i in (0, 1)
    ]
    x = jax.random.normal(jax.random.key(7), (2, s, SIZES["hidden_size"]))
    _, published, auxes = run_stack(layers, x, return_aux=True)
    consumer, source = layers[1], published[0]
    positions = jnp.broadcast_to(jnp.arange(s), (2, s))
    qr = consumer.block.project_qkv(x, positions)[0]
    q, w = consumer.indexer.queries(qr, positions), consumer.indexer.head_weights(x)
    scores = np.asarray(ce.indexer_scores(q, w, source.keys))
    visible = np.asarray(
        ce.entry_visibility(positions, jnp.zeros((2, s), jnp.int32), source.layout)
    )
    allowed = visible & candidate_entries(source.candidates, bc, s)
    return np.asarray(auxes[1]["selection"]), _np_topk(scores, allowed, k), allowed


@pytest.mark.parametrize(
    "selection",
    [
        ce.DenseSelection(),
        ce.StreamingSelection(key_block=3, query_block=5),
        ce.GatheredSelection(5),
    ],
    ids=["dense", "streaming", "gathered"],
)
def test_consumer_within_a_partial_last_candidate_block(selection):
    """23 entries in blocks of 4 (the last block holds 3), Nb·bc = 8 of them kept: each forced
    strategy's consumer selection equals a numpy top-k within the candidates, on queries whose
    kept blocks include the partial one and on queries that see more than Nb·bc entries."""
    got, want, allowed = _consumer_case(2, 4, 4, selection)
    np.testing.assert_array_equal(got, want)
    assert (allowed[:, 20:, 20:].any(-1)).all()  # the late queries keep the partial block
    assert (allowed.sum(-1) < np.arange(1, 24)).any()  # the filter drops visible entries


def test_capacity_at_its_boundary():
    """``Nb·bc == index_topk`` builds and runs: a query that sees more than ``k`` entries picks
    exactly its kept candidates (all of them); one slot less is refused when built."""
    got, want, allowed = _consumer_case(2, 2, 4, ce.AutoSelection())
    np.testing.assert_array_equal(got, want)
    # from the 9th query on each sees more entries than Nb·bc; its kept blocks hold at most k
    # visible ones (the pinned block's may end at the query), and it picks every one of them
    late, picks = allowed[:, 8:], got[:, 8:]
    assert (late.sum(-1) <= 4).all() and (late.sum(-1) < np.arange(9, 24)).all()
    assert ((picks >= 0).sum(-1) == late.sum(-1)).all()
    rows = np.indices(picks.shape)
    assert late[rows[0], rows[1], np.maximum(picks, 0)][picks >= 0].all()
    with pytest.raises(ValueError, match="at least index_topk=4"):
        candidate_pair(3, 1)


def test_a_mixed_stack_runs_through_one_protocol():
    """``run_stack`` runs any layers in order: a V4 CSA layer and a V3.2 layer between V4.1
    layers pass the published state on untouched, and each layer gives what it gives alone."""
    v4 = ce.V4Attention(tiny_v4("csa", hidden_size=32), key=jax.random.key(3))
    layers = _stack()
    x = jax.random.normal(jax.random.key(5), (1, 24, 32))

    @eqx.filter_jit
    def run(layers, v4, x):
        ys, published = ce.run_stack([layers[0], layers[1], v4, layers[2]], x)
        return ys, published, v4(x), layers[2](x, shared=published[1])[0]

    ys, published, y_v4, y_reuse = run(layers, v4, x)
    np.testing.assert_array_equal(np.asarray(ys[2]), np.asarray(y_v4))
    same = jax.tree.map(lambda a, b: bool((a == b).all()), published[2], published[1])
    assert jax.tree.all(same)  # the V4 layer publishes nothing
    np.testing.assert_allclose(np.asarray(ys[3]), np.asarray(y_reuse), rtol=1e-6, atol=1e-7)


class Published(NamedTuple):
    """A stand-in stack state: the layer that published last, what the hook handed on."""

    selection: int | None = None
    candidates: int | None = None


def test_extend_stack_hook_sees_the_caches_so_far():
    """``extend_stack``'s documented hook: ``before(i, x, caches, shared)`` runs before layer
    ``i`` on the caches so far (the earlier layers' already past this chunk, the later ones'
    still before it) and the state the earlier layers published (before the first layer:
    ``StackState()``, nothing); layer ``i`` gets what it returns. Pinned with stand-in layers,
    a stand-in state and a stand-in ``step`` that advance and publish values."""
    cache = ce.V4Attention(tiny_v4("sliding"), key=jax.random.key(0)).init_cache(1, 8)
    caches = [eqx.tree_at(lambda c: c.position, cache, jnp.full((1,), 10 * i)) for i in range(3)]
    x = jnp.zeros((1, 2, 64))
    seen, stepped = [], []

    def before(i, x, caches_now, shared):
        seen.append((i, [int(c.position[0]) for c in caches_now], shared))
        state = shared if isinstance(shared, Published) else Published()
        return state._replace(candidates=100 + i)

    def step(layer, x, cache, lengths, segment_ids, shared):
        stepped.append((layer, shared.candidates))
        advanced = eqx.tree_at(lambda c: c.position, cache, cache.position + x.shape[1])
        return x + 1, advanced, shared._replace(selection=layer)

    ys, new, published = ce.extend_stack([0, 1, 2], x, caches, step=step, before=before)
    assert [s[1] for s in seen] == [[0, 10, 20], [2, 10, 20], [2, 12, 20]]
    assert type(seen[0][2]) is ce.StackState
    assert [s[2].selection for s in seen[1:]] == [0, 1]
    assert stepped == [(0, 100), (1, 101), (2, 102)]
    assert [int(c.position[0]) for c in new] == [2, 12, 22]
    assert [p.selection for p in published] == [0, 1, 2]


def test_stale_index_keys_by_value():
    """``stale_index_keys`` hands each index source on a call that closes none of its groups
    the keys of the layer DeepSeek's ``index_k`` last pointed to (the last KV source that
    closed a group, in layer order), as that layer's cache holds them when the source runs,
    cut or zero-padded at the end to the source's slots: a ratio-2 and a ratio-4 KV source,
    one token a call from the start, the pointer at the ratio-4 one before the first (the
    ratio-4 one then scores the ratio-2 one's keys, cut to its slots, and the ratio-2 one the
    ratio-4 one's, padded). Checked value by value against that rule written out here, with
    the pointer passed on after each call."""
    config = ce.V41AttentionConfig(
        compress_ratios=(2, 4), kv_source_layers=(0, 1), index_source_layers=(0, 1), **SIZES
    )
    keys = jax.random.split(jax.random.key(8), 2)
    layers = [ce.V41Attention(config, i, key=k) for i, k in enumerate(keys)]
    x = np.asarray(jax.random.normal(jax.random.key(9), (1, 6, 32)))
    extend = eqx.filter_jit(ce.V41Attention.extend)
    latest = {i: layer.init_cache(1, 8) for i, layer in enumerate(layers)}
    rule = {"pointer": 1, "position": 0}
    checked = []

    def step(layer, x, cache, lengths, segment_ids, shared):
        i, m, position = layer.layer, config.compress_ratios[layer.layer], rule["position"]
        if (position + x.shape[1]) // m > position // m:  # closes a group: publishes its keys
            rule["pointer"], want = i, None
        else:  # the last closer's keys as its cache holds them now, fitted to this one's slots
            held = np.asarray(latest[rule["pointer"]].compressor.entries)[..., SIZES["head_dim"] :]
            slots = cache.compressor.entries.shape[1]
            want = np.zeros((1, slots, held.shape[-1]), np.float32)
            want[:, : min(slots, held.shape[1])] = held[:, :slots]
        got = getattr(shared, "stale_keys", None)  # the first layer's state: StackState()
        checked.append((i, held.shape[1] if want is not None else 0, want, got))
        out = extend(layer, x, cache, lengths, segment_ids, shared=shared)
        latest[i] = out[1]
        return out

    caches, pointer = list(latest.values()), 1
    for s0, s1 in [(t, t + 1) for t in range(6)]:
        chunk = jnp.asarray(x[:, s0:s1])
        _, caches, _, pointer = ce.extend_v41_stack(
            layers, chunk, caches, step=step, stale_index_keys=pointer
        )
        rule["position"] = s1
        assert pointer == rule["pointer"], s1
    for i, _, want, got in checked:
        assert (got is None) == (want is None), i
        if want is not None:
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(i))
    slots = {i: latest[i].compressor.entries.shape[1] for i in (0, 1)}
    cut = [held for i, held, want, _ in checked if want is not None and held > slots[i]]
    pads = [w for i, held, w, _ in checked if w is not None and 0 < held < slots[i]]
    assert cut and pads and any(w[:, : slots[1]].any() for w in pads)


def test_candidate_geometry_by_values():
    """What ``CandidateVisibility`` answers a strategy, value by value against numpy: 13 entry
    slots in blocks of 4 (the last holds 1), kept block ids with ``-1`` holes, packed
    documents and empty slots; ``mask``, ``tile`` at aligned and unaligned starts (tiles that
    cut blocks, the partial last block), ``slots`` (block by block, ``-1`` where not visible
    or past the last slot), ``rows`` / ``pad_rows``; and ``block_top`` (a row buffer's best
    blocks) on buffers that start at a later block and end in a partial one."""
    b, s, t, bc, nb = 2, 9, 13, 4, 3
    r = np.random.default_rng(11)
    seg = np.zeros((b, s), np.int32)
    seg[0, 4:] = 1
    end = np.sort(r.integers(0, s, (b, t)), axis=1).astype(np.int32)
    end[:, ::5] = -1
    eseg = np.where(end >= 0, np.take_along_axis(seg, np.maximum(end, 0), 1), -1).astype(np.int32)
    blocks = np.full((b, s, nb), -1, np.int32)
    for i, j in np.ndindex(b, s):
        kept = np.sort(r.choice(4, r.integers(0, nb + 1), replace=False))
        blocks[i, j, : len(kept)] = kept
    qi = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    layout = ce.EntryLayout(jnp.asarray(end), jnp.asarray(eseg), jnp.asarray(end >= 0))
    base = ce.Visibility(jnp.asarray(qi), jnp.asarray(seg), layout)
    vis = ce.CandidateVisibility.within(base, jnp.asarray(blocks), bc)
    visible = visible_np(qi, seg, end, eseg)
    kept = (blocks[..., None, :] == (np.arange(t) // bc)[:, None]).any(-1)
    want = visible & kept
    assert want.any() and (visible & ~kept).any() and (blocks == 3).any()
    tiles = [(0, t), (0, 4), (1, 3), (2, 7), (5, 8), (10, 3), (12, 1)]
    scores = r.integers(-3, 4, (b, s, t)).astype(np.float32)
    newest = np.where(visible.any(-1), t - 1 - np.argmax(visible[..., ::-1], -1), -1)

    @eqx.filter_jit
    def answers(vis, scores, visible, newest):
        # block_top: a row buffer of slots 4 .. 12 (blocks 1, 2 and the partial 3)
        top = block_top(scores[..., 4:], visible[..., 4:], newest, 4, 2, bc)
        tile = [vis.tile(start, width) for start, width in tiles]
        return vis.mask(), tile, vis.slots(), vis.rows(3, 4).pad_rows(2).mask(), top

    mask, tile, got_slots, rows, (values, ids) = jax.device_get(
        answers(vis, *(jnp.asarray(a) for a in (scores, visible, newest)))
    )
    np.testing.assert_array_equal(mask, want)
    for (start, width), got in zip(tiles, tile, strict=True):
        np.testing.assert_array_equal(got, want[..., start : start + width], f"{start}+{width}")
    slots = np.where((blocks >= 0)[..., None], blocks[..., None] * bc + np.arange(bc), -1)
    slots = slots.reshape(b, s, nb * bc)
    seen = np.take_along_axis(want, np.clip(slots, 0, t - 1), -1) & (slots >= 0) & (slots < t)
    np.testing.assert_array_equal(got_slots, np.where(seen, slots, -1))
    np.testing.assert_array_equal(rows, np.pad(want[:, 3:7], [(0, 0), (0, 2), (0, 0)]))
    for i, j in np.ndindex(b, s):
        best = {}
        for blk in (1, 2, 3):
            seen_here = visible[i, j, blk * bc : (blk + 1) * bc]
            if seen_here.any():
                best[blk] = scores[i, j, blk * bc : (blk + 1) * bc][seen_here].max()
        if newest[i, j] >= 4:
            best[newest[i, j] // bc] = np.inf
        top = sorted(sorted(best, key=lambda k: (-best[k], k))[:2])
        want_ids = top + [-1] * (2 - len(top))
        np.testing.assert_array_equal(ids[i, j], want_ids, f"{i} {j}")
        np.testing.assert_array_equal(values[i, j], [best.get(k, -np.inf) for k in want_ids])
