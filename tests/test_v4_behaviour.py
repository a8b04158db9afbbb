"""V4 layer behaviour: packing, NaN safety, gradients, jit vs eager, input errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import csa_eqx as ce
from csa_eqx.hf._flags import OPTIONS
from csa_eqx.presets import tiny_v4


def tiny(kind: str, **over) -> ce.V4AttentionConfig:
    """The tiny preset, narrower still: hidden 32, 4 heads x 16, window 5, k = 3."""
    fields = dict(
        hidden_size=32, head_dim=16, q_lora_rank=16, o_lora_rank=8, sliding_window=5, index_topk=3
    )
    return tiny_v4(kind, **{**fields, **over})


def randomise(layer, seed=0):
    """Give every leaf (norms, biases, sinks included) non-trivial random values."""
    leaves, tree = jax.tree.flatten(layer)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        0.3 * jax.random.normal(k, leaf.shape, leaf.dtype) + (leaf.ndim == 1)
        for k, leaf in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(tree, new)


call = eqx.filter_jit(lambda m, x, **kw: m(x, **kw))


def execution_options(over: dict) -> tuple[dict, ce.Execution]:
    """Split keyword overrides into architecture fields and an ``Execution`` (from the
    loaders' execution keywords)."""
    names = OPTIONS
    options = {k: v for k, v in over.items() if k in names}
    return {k: v for k, v in over.items() if k not in names}, ce.Execution.from_options(**options)


def make(kind, seed=0, **over):
    arch, execution = execution_options(over)
    layer = ce.V4Attention(tiny(kind, **arch), key=jax.random.key(seed), execution=execution)
    return randomise(layer, seed)


KINDS = ["sliding", "csa", "hca"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("len_a", [11, 8, 3])
def test_packed_equals_separate(kind, len_a):
    """Two documents in one row give each document's stand-alone outputs and selections."""
    layer = make(kind)
    len_b = 25 - len_a
    x = jax.random.normal(jax.random.key(1), (1, 25, 32))
    seg = jnp.array([[0] * len_a + [1] * len_b])
    packed, aux = call(layer, x, segment_ids=seg, return_aux=True)
    alone_a, aux_a = call(layer, x[:, :len_a], return_aux=True)
    alone_b, aux_b = call(layer, x[:, len_a:], return_aux=True)
    np.testing.assert_allclose(packed[:, :len_a], alone_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, len_a:], alone_b, rtol=1e-5, atol=1e-5)
    if kind == "csa":
        m = 4
        sel = np.asarray(aux["selection"])[0]
        # doc A's slots coincide; doc B's packed slot j closes at row end_j, alone at end_j - len_a
        np.testing.assert_array_equal(sel[:len_a], np.asarray(aux_a["selection"])[0])
        layout = ce.entry_layout(seg, m)
        end = np.asarray(layout.end)[0]
        mapped = np.where(sel[len_a:] >= 0, (end[sel[len_a:]] - len_a) // m, -1)
        np.testing.assert_array_equal(mapped, np.asarray(aux_b["selection"])[0])


def test_packed_entry_never_straddles():
    """An entry whose window would straddle a boundary does not exist; slots follow segments."""
    seg = jnp.array([[0] * 6 + [1] * 10])
    layout = ce.entry_layout(seg, 4)
    # doc 0 closes one window at row 3; doc 1 (starting at row 6) closes at rows 9 and 13
    np.testing.assert_array_equal(layout.end[0], [3, -1, 9, 13])
    np.testing.assert_array_equal(layout.has_prior[0], [False, False, False, True])


@pytest.mark.parametrize("kind", KINDS)
def test_no_nan_and_first_tokens(kind):
    layer = make(kind)
    x = 10.0 * jax.random.normal(jax.random.key(2), (2, 9, 32))
    y, aux = call(layer, x, return_aux=True)
    assert np.isfinite(np.asarray(y)).all()
    grads = eqx.filter_jit(jax.grad(lambda lyr: jnp.sum(lyr(x) ** 2)))(layer)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    if kind == "csa":
        sel = np.asarray(aux["selection"])
        assert (sel[:, :3] == -1).all()  # no entry has closed before token 3


def test_selection_respects_visibility_and_ties():
    """Selections only name visible slots, and an all-tied row picks the lowest indices."""
    layer = make("csa", index_topk=4)
    x = jax.random.normal(jax.random.key(3), (2, 30, 32))
    sel = np.asarray(call(layer, x, return_aux=True)[1]["selection"])
    t = np.arange(30)[None, :, None]
    assert ((sel == -1) | (sel < (t + 1) // 4)).all()
    scores = jnp.zeros((1, 2, 6))
    vis = jnp.array([[[True] * 6, [False, True, True, False, True, True]]])
    np.testing.assert_array_equal(ce.select_topk(-scores, vis, 3), [[[0, 1, 2], [1, 2, 4]]])


@pytest.mark.parametrize("kind", KINDS)
def test_jit_matches_eager(kind):
    layer = make(kind)
    x = jax.random.normal(jax.random.key(4), (2, 14, 32))
    eager = layer(x)
    jitted = call(layer, x)
    np.testing.assert_allclose(eager, jitted, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_check_grads(kind):
    with jax.enable_x64(True):
        layer = jax.tree.map(lambda a: a.astype(jnp.float64), make(kind))
        x = jax.random.normal(jax.random.key(5), (1, 10, 32), jnp.float64)
        params, static = eqx.partition(layer, eqx.is_array)

        def f(p, x):
            return eqx.combine(p, static)(x)

        check_grads(jax.jit(f), (params, x), order=1, modes=["rev"], atol=1e-4, rtol=1e-4)


def test_wrong_shape_names_dimension():
    layer = make("csa")
    with pytest.raises(Exception, match="hidden"):
        layer(jnp.zeros((1, 8, 31)))
    with pytest.raises(Exception, match="seq"):
        layer(jnp.zeros((1, 8, 32)), positions=jnp.zeros((1, 7), jnp.int32))


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", 0),
        ("num_heads", -1),
        ("head_dim", 0),
        ("rope_dim", 7),
        ("rope_dim", 64),
        ("q_lora_rank", 0),
        ("o_groups", 3),
        ("o_lora_rank", 0),
        ("sliding_window", 0),
        ("compress_rate", 2),
        ("index_n_heads", 0),
        ("index_head_dim", 0),
        ("index_topk", 0),
        ("rope_theta", 0.0),
        ("compress_rope_theta", -1.0),
        ("rms_norm_eps", 0.0),
    ],
)
def test_invalid_config_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        tiny("csa", **{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("qk_head_chunk_size", 3),
        ("qk_head_chunk_size", -1),
        ("indexer_key_block", -1),
        ("query_block", -2),
        ("indexer_loss", "warm"),
        ("tensor_axis", ""),
        ("data_axis", ""),
    ],
)
def test_invalid_execution_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        make("csa", **{field: value})


def test_stage_per_call_is_checked():
    """The training stage is chosen per call and validated like the execution's default."""
    layer = make("csa")
    x = jnp.zeros((1, 8, 32))
    with pytest.raises(ValueError, match="indexer_loss"):
        layer(x, return_aux=True, indexer_loss="warm")
    with pytest.raises(ValueError, match="qk_head_chunk_size"):
        make("csa", num_heads=6, o_groups=2, index_n_heads=4, qk_head_chunk_size=4)(
            x, return_aux=True, indexer_loss="sparse"
        )


def test_invalid_yarn():
    with pytest.raises(ValueError, match="factor"):
        ce.YaRNScaling(factor=0.5, original_max_position_embeddings=64)


@pytest.mark.parametrize("query_block", [0, 4])
def test_dense_keys_equal_gathered_keys(query_block):
    """Entries attended by matmul (DenseKeys) == the same entries gathered per query."""
    from test_streaming import window_indices

    from csa_eqx import DenseKeys, sparse_attention

    b, s, h, d = 2, 23, 3, 8
    q = jax.random.normal(jax.random.key(0), (b, s, h, d))
    kv = jax.random.normal(jax.random.key(1), (b, s, d))
    seg = jnp.array([[0] * 9 + [1] * 14, [0] * 23])
    qi = jnp.broadcast_to(jnp.arange(s), (b, s))
    layout = ce.entry_layout(seg, 4)
    entries = jax.random.normal(jax.random.key(2), (b, layout.end.shape[1], d))
    win = window_indices(qi, seg, 5)
    vis = ce.entry_visibility(qi, seg, layout)
    picked = jnp.where(vis, jnp.arange(entries.shape[1]) + s, -1)
    sinks = jnp.array([0.3, -1.0, 2.0])

    @jax.jit  # one program each, not one per primitive
    def both(q, kv, entries):
        gathered = sparse_attention(
            q,
            jnp.concatenate([kv, entries], 1),
            jnp.concatenate([win, picked], -1),
            sinks,
            0.4,
            return_lse=True,
            query_block=query_block,
        )
        dense = sparse_attention(
            q,
            kv,
            win,
            sinks,
            0.4,
            return_lse=True,
            query_block=query_block,
            dense=DenseKeys(entries, layout, qi, seg),
        )
        return gathered, dense

    (o1, l1), (o2, l2) = both(q, kv, entries)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
    grads = [jax.jit(jax.grad(lambda e, i=i: jnp.sum(both(q, kv, e)[i][0] ** 2))) for i in (0, 1)]
    g1, g2 = (grad(entries) for grad in grads)
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)


def test_entry_attention_is_the_dense_target():
    """entry_attention: a per-query distribution over visible entries only, and the same
    selection as the forward pass."""
    layer = make("csa", index_topk=2)
    x = jax.random.normal(jax.random.key(6), (2, 19, 32))
    mass, sel = eqx.filter_jit(lambda m, x: m.entry_attention(x))(layer, x)
    _, aux = call(layer, x, return_aux=True)
    np.testing.assert_array_equal(sel, aux["selection"])
    t = np.arange(19)[:, None]
    visible = np.arange(mass.shape[-1])[None, :] < (t + 1) // 4
    assert (np.asarray(mass)[:, ~visible] == 0).all()
    sums = np.asarray(mass).sum(-1)
    np.testing.assert_allclose(sums[:, 3:], 1.0, rtol=1e-5)
    assert (sums[:, :3] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_mesh_batch_sharded_input(kind):
    """A batch sharded over an Explicit "data" axis (top-k rows over "tensor") gives the
    unsharded outputs and selections."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layer = make(kind)
    sharded = layer.with_execution(ce.Execution(selection=ce.ShardedSelection()))
    x = jax.random.normal(jax.random.key(7), (2, 24, 32))
    seg = jnp.array([[0] * 10 + [1] * 14, [0] * 24])
    want, want_aux = call(layer, x, segment_ids=seg, return_aux=True)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        segs = jax.device_put(seg, NamedSharding(mesh, P("data")))
        got, aux = call(sharded, xs, segment_ids=segs, return_aux=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if kind == "csa":
        np.testing.assert_array_equal(aux["selection"], want_aux["selection"])


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_close_to_float32(kind):
    """bf16 weights and activations (softmaxes, norms and indexer scores still accumulate in
    float32) stay within 1.5% of the float32 layer: mean |error| / mean |output|."""
    layer = make(kind)
    x = jax.random.normal(jax.random.key(8), (2, 30, 32))
    want = np.asarray(call(layer, x), np.float64)
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim > 1 else a, layer)
    got = call(half, x.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16 and np.isfinite(np.asarray(got, np.float32)).all()
    err = np.abs(np.asarray(got, np.float64) - want).mean() / np.abs(want).mean()
    assert err <= 1.5e-2, err  # measured ~7.5e-3, about one bf16 ulp
