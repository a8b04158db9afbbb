"""V3.2 DSA attention vs transformers' DeepseekV32Attention (float32, random weights).

Parity is elementwise (``rtol=1e-5`` plus ``atol=1e-6·max|HF|``) and covers every execution
path against HF itself: default tiles, small key blocks (streaming top-k), small query
blocks, head-chunked scoring, and picks attended by masked matmul or gathered.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
import torch
from test_v4_parity import assert_close, untied_rows

from csa_eqx import SELECTION_NAME, V32Attention, V32AttentionConfig, indexer_scores
from csa_eqx.hf import load_v32_attention
from csa_eqx.presets import tiny_v32
from csa_eqx.testing import (
    TINY_YARN,
    hf_v32_config,
    random_hf_v32_layer,
    run_hf_v32,
    state_dict_numpy,
)


def with_path(state, hf_cfg, path: dict):
    """Our layer with HF's weights, forced onto an execution path (the one place that knows
    how: ``key_block``, ``query_block``, ``head_chunk`` become the loader's options)."""
    names = dict(
        key_block="indexer_key_block", query_block="query_block", head_chunk="qk_head_chunk_size"
    )
    return load_v32_attention(state, hf_cfg, 0, **{names[k]: v for k, v in path.items()})


def attends_masked_picks(tokens: int, k: int) -> bool:
    """Whether the layer attends to its picks by masked matmul (else it gathers them)."""
    import csa_eqx as ce

    return isinstance(ce.AutoPicks().choose(tokens, k), ce.MaskedPicks)


def _forward(layer, x, **kw):
    return jax.jit(lambda m, x: m(x, return_aux=True, **kw))(layer, x)


def _setup(b, s, topk, yarn, seed=None):
    """HF config, random HF layer and inputs; value, nope and rope head dims all differ."""
    seed = s if seed is None else seed
    arch = tiny_v32(index_topk=topk, v_head_dim=12, rope_scaling=TINY_YARN if yarn else None)
    cfg = hf_v32_config(arch)
    hf_layer = random_hf_v32_layer(cfg, seed=seed)
    x = np.random.default_rng(seed).normal(size=(b, s, cfg.hidden_size)).astype(np.float32)
    return cfg, hf_layer, x


def check_paths(b, s, topk, yarn, paths, seed=None):
    """One HF reference, then our layer on each path: selections (as sets, on rows whose
    top-k boundary is untied) and outputs elementwise."""
    cfg, hf_layer, x = _setup(b, s, topk, yarn, seed)
    want, want_topk, scores = run_hf_v32(hf_layer, cfg, x)
    state = state_dict_numpy(hf_layer)
    rows = untied_rows(scores, min(topk, s), 1, rel_gap=1e-5)
    assert rows.mean() > 0.5, "too few untied rows to be a meaningful test"
    for path in paths:
        got, aux = _forward(with_path(state, cfg, path), x)
        got, sel = np.asarray(got), np.asarray(aux["selection"])
        assert aux["indexer_loss"] is None
        assert sel.shape == (b, s, topk) and sel.dtype == np.int32
        for bi, si in zip(*np.nonzero(rows), strict=True):
            mine, n = sel[bi, si], min(topk, si + 1)
            assert (mine[:n] >= 0).all() and (mine[n:] == -1).all(), (path, bi, si)
            theirs = want_topk[bi, si]
            assert set(mine[mine >= 0]) == set(theirs[theirs <= si]), (path, bi, si)
        try:
            assert_close(got, want, rows)
        except AssertionError as e:
            raise AssertionError(f"path {path}: {e}") from None


CASES = [
    # batch, seq, topk, yarn
    (2, 13, 5, False),  # S above index_topk
    (2, 4, 6, False),  # S below index_topk: every earlier token is picked
    (3, 7, 7, False),  # S == index_topk
    (1, 30, 6, True),  # YaRN (attention factor != 1, mscale_all_dim set)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-s{c[1]}-k{c[2]}-yarn{c[3]}")
def test_matches_hf(case):
    check_paths(*case, paths=[{}])


# S = 300 tokens: k = 64 gathers the picks (300 > 4·64), k = 80 attends to them by a masked
# matmul (300 <= 4·80).
PATH_CASES = [
    # topk, masked picks, paths
    (64, False, [{}, dict(key_block=16, query_block=32, head_chunk=2)]),
    (80, True, [{}, dict(key_block=7, query_block=5, head_chunk=1)]),
]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"s300-k{c[0]}-masked{c[1]}")
def test_every_path_matches_hf(case):
    topk, masked, paths = case
    assert attends_masked_picks(300, topk) == masked
    check_paths(1, 300, topk, False, paths, seed=12)


def test_indexer_scores_match_hf():
    """The indexer's float32 scores equal HF's on every causal entry (no tie caveat)."""
    cfg, hf_layer, x = _setup(2, 11, 4, True)
    _, _, want = run_hf_v32(hf_layer, cfg, x)
    idx = load_v32_attention(state_dict_numpy(hf_layer), cfg, 0).indexer
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    qr = jnp.asarray(hf_layer.q_a_layernorm(hf_layer.q_a_proj(torch.tensor(x))).detach().numpy())
    x = jnp.asarray(x)
    got = np.asarray(indexer_scores(idx.queries(qr, pos), idx.head_weights(x), idx.keys(x, pos)))
    causal = np.tril(np.ones((11, 11), bool))[None].repeat(2, 0)
    err = np.abs(got[causal] - want[causal]).max() / np.abs(want[causal]).max()
    assert err <= 1e-5, err


def _random_layer(topk=6, seed=0, **options):
    cfg, hf_layer, _ = _setup(1, 1, topk, False, seed=seed)
    return load_v32_attention(state_dict_numpy(hf_layer), cfg, 0, **options)


def test_head_chunking_is_exact():
    x = np.random.default_rng(1).normal(size=(2, 12, 64)).astype(np.float32)
    ref_y, ref = _forward(_random_layer(), x)
    for chunk in (1, 2, 4):
        y, aux = _forward(_random_layer(qk_head_chunk_size=chunk), x)
        np.testing.assert_array_equal(np.asarray(aux["selection"]), np.asarray(ref["selection"]))
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-6)


def test_streaming_and_sharded_selection_are_exact():
    """Streaming top-k (key/query blocks), row-sharded top-k and head-sharded indexer
    activations give the plain layer's selection and output."""
    x = np.random.default_rng(4).normal(size=(2, 14, 64)).astype(np.float32)
    seg = np.repeat([[0, 1]], [6, 8], axis=1).repeat(2, 0).astype(np.int32)
    run = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))
    ref_y, ref = run(_random_layer(), x, seg)
    variants = [dict(indexer_key_block=3, query_block=5, qk_head_chunk_size=2)]
    variants += [dict(indexer_sharded_topk=True), dict(shard_indexer_acts=True)]
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "tensor"))):
        for options in variants:
            layer = _random_layer(**options)
            if options.get("indexer_sharded_topk"):
                assert "shard_map" in str(
                    jax.make_jaxpr(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg)
                )
            y, aux = run(layer, x, seg)
            sel = np.asarray(aux["selection"])
            np.testing.assert_array_equal(sel, np.asarray(ref["selection"]), err_msg=str(options))
            np.testing.assert_allclose(np.asarray(y), np.asarray(ref_y), rtol=1e-5, atol=1e-6)


def test_packed_equals_documents_alone():
    layer = _random_layer(topk=5)
    lengths = (11, 14)
    x = np.random.default_rng(2).normal(size=(1, sum(lengths), 64)).astype(np.float32)
    seg = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
    y, aux = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))(layer, x, seg)
    y, sel = np.asarray(y), np.asarray(aux["selection"])
    start = 0
    for n in lengths:
        y_doc, aux_doc = _forward(layer, x[:, start : start + n])
        sel_doc = np.asarray(aux_doc["selection"])
        want_sel = np.where(sel_doc >= 0, sel_doc + start, -1)
        np.testing.assert_array_equal(sel[:, start : start + n], want_sel)
        np.testing.assert_allclose(y[:, start : start + n], np.asarray(y_doc), rtol=1e-5, atol=1e-6)
        start += n


def test_singleton_segments_attend_to_themselves_only():
    """Every token alone in its segment: one pick (itself), finite output, no NaN."""
    layer = _random_layer(topk=3)
    x = np.random.default_rng(3).normal(size=(2, 6, 64)).astype(np.float32)
    seg = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))
    y, aux = jax.jit(lambda m, x, s: m(x, segment_ids=s, return_aux=True))(layer, x, seg)
    sel = np.asarray(aux["selection"])
    np.testing.assert_array_equal(sel[..., 0], np.broadcast_to(np.arange(6), (2, 6)))
    assert (sel[..., 1:] == -1).all()
    assert np.isfinite(np.asarray(y)).all()
    # a lone token at position 0 gives the same output wherever it sits
    alone = np.asarray(_forward(layer, x[:, :1])[0])
    np.testing.assert_allclose(np.asarray(y)[:, :1], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", ["heads", "queries"])
def test_attention_in_head_groups_matches_hf(monkeypatch, split):
    """A long sequence's MLA split (forced here by small budgets on a 32-head layer): in head
    groups (``head_groups``: two groups of 16) or in query chunks (``SPLIT = "queries"``,
    ``query_chunks``: four chunks of 5 queries, every head). The output matches HF's; it and
    the gradients (the keys' and, for chunks, ``kv_b_proj``'s summed over the parts in float32)
    are within float32 rounding of the one call's (the head groups' output bitwise)."""
    from csa_eqx._layers import v32

    assert [v32.head_groups((1, s, 128, 128), 576) for s in (16384, 32768, 65536)] == [1, 4, 8]
    assert [v32.query_chunks((1, s, 128, 128), 576) for s in (16384, 32768, 65536)] == [1, 4, 8]
    arch = tiny_v32(index_topk=6, v_head_dim=12, num_heads=32)
    cfg = hf_v32_config(arch)
    hf_layer = random_hf_v32_layer(cfg, seed=3)
    x = np.random.default_rng(3).normal(size=(2, 20, cfg.hidden_size)).astype(np.float32)
    want, _, scores = run_hf_v32(hf_layer, cfg, x)
    layer = load_v32_attention(state_dict_numpy(hf_layer), cfg, 0)

    def run():
        loss = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
        return jax.jit(lambda m, x: (m(x), jax.grad(loss, argnums=(0, 1))(m, x)))(layer, x)

    one_y, one_grads = run()
    monkeypatch.setattr(v32, "ONE_CALL", 0)
    monkeypatch.setattr(v32, "GROUP", 16 * 20 * 40)  # 16 heads of 20 queries x 40 wide
    monkeypatch.setattr(v32, "SPLIT", split)
    assert v32.head_groups((2, 20, 32, 16), 40) == 2 and v32.query_chunks((2, 20, 32, 16), 40) == 4
    assert v32.split_of((2, 20, 32, 16), 40) == (split, 2 if split == "heads" else 4)
    # 18 queries do not split into chunks of at most 5 x 32 heads (9 is odd): head groups
    assert v32.query_chunks((2, 18, 32, 16), 40) == 0
    assert v32.split_of((2, 18, 32, 16), 40) == ("heads", 2)
    y, grads = run()
    assert_close(np.asarray(y), want, untied_rows(scores, 6, 1, rel_gap=1e-5))
    # the head groups' per-head arithmetic is the one call's; the chunks' matmuls take fewer
    # query rows (XLA's CPU blocking: float32 rounding)
    if split == "heads":
        np.testing.assert_array_equal(np.asarray(y), np.asarray(one_y))
    for got, ref in zip(
        jax.tree.leaves((y, grads)), jax.tree.leaves((one_y, one_grads)), strict=True
    ):
        scale = np.abs(np.asarray(ref)).max()
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6 * scale)


def test_selection_is_tagged_for_remat():
    layer = _random_layer(indexer_save_selection=True)
    x = jnp.zeros((1, 5, 64))
    assert SELECTION_NAME in str(jax.make_jaxpr(lambda m, x: m(x))(layer, x))
    assert SELECTION_NAME not in str(jax.make_jaxpr(lambda m, x: m(x))(_random_layer(), x))


def test_bad_config_names_the_field():
    with pytest.raises(TypeError, match="qk_head_chunk_size"):  # execution, not architecture
        V32AttentionConfig(index_n_heads=4, qk_head_chunk_size=3)
    with pytest.raises(ValueError, match="index_topk"):
        V32AttentionConfig(index_topk=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        V32AttentionConfig(qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="qk_head_chunk_size"):
        _random_layer(qk_head_chunk_size=3)


def test_bad_state_dict_names_the_tensor():
    cfg, hf_layer, _ = _setup(1, 1, 4, False)
    sd = state_dict_numpy(hf_layer)
    missing = {k: v for k, v in sd.items() if k != "indexer.k_norm.bias"}
    with pytest.raises(ValueError, match=r"indexer\.k_norm\.bias"):
        load_v32_attention(missing, cfg, 0)
    wrong = dict(sd, **{"kv_b_proj.weight": sd["kv_b_proj.weight"][:-1]})
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight"):
        load_v32_attention(wrong, cfg, 0)


def test_wrong_input_shape_is_a_jaxtyping_error():
    config = tiny_v32()
    layer = V32Attention(config, key=jax.random.key(0))
    with pytest.raises(jaxtyping.TypeCheckError):  # ([S, hidden] is one sequence: issue 53)
        layer(jnp.zeros((1, 1, 5, config.hidden_size)))
    with pytest.raises(jaxtyping.TypeCheckError):
        layer(jnp.zeros((1, 5, config.hidden_size)), positions=jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize("split", ["heads", "queries"])
def test_split_attention_inside_a_users_shard_map(monkeypatch, split):
    """The MLA split into parts (forced: 2 head groups or 2 query chunks) inside a user's
    ``shard_map`` with ``check_vma`` (the batch over two devices, the weights replicated):
    the summed loss and every gradient equal the one call's without a mesh (before, the
    backward's float32 carry of the shared gradients was typed invariant, a scan type error;
    a replicated ``kv_b_proj``'s chunk gradients must be summed over the devices once)."""
    from csa_eqx._layers import v32

    layer = V32Attention(tiny_v32(), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (2, 16, layer.config.hidden_size))
    params, static = eqx.partition(layer, eqx.is_array)

    def loss(p, x):
        return jnp.sum(eqx.combine(p, static)(x) ** 2)

    want_value, want_grads = jax.jit(jax.value_and_grad(loss))(params, x)
    monkeypatch.setattr(v32, "ONE_CALL", 0)
    monkeypatch.setattr(v32, "SPLIT", split)
    monkeypatch.setattr(v32, "head_groups" if split == "heads" else "query_chunks", lambda *a: 2)
    mesh = jax.make_mesh((2,), ("data",))

    def local(p, x):
        return jax.value_and_grad(lambda p, x: jax.lax.psum(loss(p, x), "data"))(p, x)

    specs = dict(in_specs=(jax.P(), jax.P("data")), out_specs=jax.P(), axis_names={"data"})
    with jax.set_mesh(mesh):
        run = jax.jit(jax.shard_map(local, mesh=mesh, **specs))
        value, grads = run(jax.device_put(params, jax.P()), jax.device_put(x, jax.P("data")))
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        scale = np.abs(np.asarray(ref)).max()
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6 * scale)
