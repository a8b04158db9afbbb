"""``DeepSeekInference`` numerics: agreement with DeepSeek's own quantised inference code
(fixtures), and every execution path with the numerics on.

The ``q_*`` fixtures in ``tests/fixtures/deepseek/`` hold DeepSeek's inference code run in
bf16 with plain-torch ports of its kernels (``README.md`` there): V3.2 with FP8 indexer
scoring, V4 CSA with the FP4 indexer, V4 CSA and HCA with V4-Pro's FP8 KV round trip
(``benchmarks.numerics_agreement`` loads them). The numerics must reproduce DeepSeek's
selections (mean overlap >= 0.99) and, on rows whose selection is equal, its output within
1e-2 of its largest value; the exact path must not.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import packed_segments, relative_error
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx.presets import tiny_v32

QUANTISED = ["q_v32", "q_v4_csa_flash", "q_v4_csa_pro", "q_v4_hca_pro"]


@pytest.mark.torch  # the fixtures are written as a checkpoint with safetensors' torch API
@pytest.mark.parametrize("name", QUANTISED)
def test_matches_deepseeks_quantised_inference(name):
    from benchmarks.numerics_agreement import QUANTISED as FIXTURES
    from benchmarks.numerics_agreement import agreement

    assert list(FIXTURES) == QUANTISED
    kv_fp8 = FIXTURES[name][2]
    overlap, _, err = agreement(name, ce.DeepSeekInference(kv_fp8=kv_fp8))
    assert overlap >= 0.99 and err <= 1e-2, (overlap, err)
    # the exact path does not: fewer equal picks (indexer) or a larger error (FP8 KV)
    exact_overlap, _, exact_err = agreement(name, "exact")
    assert exact_overlap < 0.98 or exact_err > 2e-2, (exact_overlap, exact_err)


@pytest.mark.torch
def test_loader_keyword_reads_the_scale_format():
    from benchmarks.numerics_agreement import load

    layer, _ = load("q_v32", numerics="deepseek")  # the config says scale_fmt "ue8m0"
    assert layer.execution.numerics == ce.DeepSeekInference(scale_fmt="ue8m0")
    layer, _ = load("q_v4_hca_pro", numerics="deepseek")  # V4: scale_dtype "fp8" by default
    assert layer.execution.numerics == ce.DeepSeekInference(scale_fmt="ue8m0", kv_fp8=False)


NUMERICS = ce.DeepSeekInference(kv_fp8=True)


def numerics_layer(kind: str, **options):
    """A tiny random layer whose sizes DeepSeek's formats take (indexer 32 / 128 wide, 64
    non-rotary KV channels, V3.2's latent 128 wide), run with ``NUMERICS`` and the
    ``Execution.from_options``."""
    ex = ce.Execution.from_options(numerics=NUMERICS, **options)
    if kind == "v32":
        cfg = tiny_v32(index_head_dim=128, kv_lora_rank=128)
        return randomise(ce.V32Attention(cfg, key=jax.random.key(0), execution=ex))
    cfg = tiny(kind, head_dim=72, index_head_dim=32, sliding_window=6, index_topk=4)
    return randomise(ce.V4Attention(cfg, key=jax.random.key(0), execution=ex))


def forward(layer, x, seg):
    return layer(x, segment_ids=seg, return_aux=True)


@pytest.mark.parametrize(
    "kind, options",
    [
        ("csa", dict(indexer_sharded_topk=True, qk_head_chunk_size=2, indexer_key_block=4)),
        ("csa", dict(context_parallel=True, head_parallel=True, indexer_sharded_topk=True)),
        ("hca", dict(context_parallel=True, head_parallel=True)),
        ("v32", dict(context_parallel=True, head_parallel=True, indexer_sharded_topk=True)),
    ],
    ids=["csa-sharded-streaming", "csa-context-heads", "hca-context-heads", "v32-context-heads"],
)
def test_parallel_selections_equal_one_device(kind, options):
    """With the numerics on, the row-sharded top-k and context x head parallelism select
    exactly what one device selects; outputs agree to bf16 rounding."""
    one = numerics_layer(kind)
    many = one.with_execution(ce.Execution.from_options(numerics=NUMERICS, **options))
    x = jax.random.normal(jax.random.key(1), (2, 64, one.config.hidden_size))
    seg = packed_segments(2, 64)
    want_y, want_aux = jax.jit(forward)(one, x, seg)
    with jax.set_mesh(jax.make_mesh((4, 2), ("context", "tensor"))):
        y, aux = jax.jit(forward)(many, x, seg)
    assert y.dtype == x.dtype  # bf16 inside, the caller's dtype outside
    if kind != "hca":
        sel = np.asarray(want_aux["selection"])
        assert (sel >= 0).any() and (sel == -1).any()
        np.testing.assert_array_equal(np.asarray(aux["selection"]), sel)
    assert relative_error(y, want_y) < 2e-2


@pytest.mark.parametrize("kind", ["csa", "hca", "v32"])
def test_decode_equals_the_forward(kind):
    """Prefill, then chunks of 5 and single tokens through ``extend``: the same selections as
    the full forward, outputs to bf16 rounding."""
    layer = numerics_layer(kind)
    s = 40
    x = jax.random.normal(jax.random.key(2), (2, s, layer.config.hidden_size))
    want_y, want_aux = jax.jit(lambda m, x: m(x, return_aux=True))(layer, x)
    extend = eqx.filter_jit(lambda m, x, c: m.extend(x, c, return_aux=True))
    cache = layer.init_cache(2, s)
    ys, sels = [], []
    for lo, hi in [(0, 17), (17, 22), (22, 27), *((t, t + 1) for t in range(27, s))]:
        y, cache, aux = extend(layer, x[:, lo:hi], cache)
        ys.append(y)
        sels.append(aux["selection"])
    assert relative_error(jnp.concatenate(ys, 1), want_y) < 2e-2
    if kind != "hca":
        got = np.concatenate([np.asarray(a) for a in sels], 1)
        want = np.asarray(want_aux["selection"])
        if kind == "csa":  # V4's extend numbers entry slots as the cache holds them
            got, want = np.sort(got, -1), np.sort(want, -1)
        np.testing.assert_array_equal(got, want)


def test_indexer_trains_through_the_quantisation():
    """The indexer loss' gradient reaches the indexer's weights through the round trips
    (straight-through), finite and non-zero."""
    layer = numerics_layer("csa")
    x = jax.random.normal(jax.random.key(3), (1, 32, layer.config.hidden_size))

    def loss(layer):
        return layer(x, return_aux=True, indexer_loss="sparse")[1]["indexer_loss"]

    grads = jax.jit(jax.grad(loss))(layer).indexer
    for g in (grads.q_b_proj, grads.weights_proj, grads.compressor.kv_proj):
        assert np.isfinite(np.asarray(g)).all() and float(jnp.abs(g).max()) > 0


def test_sizes_the_formats_cannot_take_are_named():
    with pytest.raises(ValueError, match=r"index_head_dim=16 must be a power of two and a mu"):
        ce.V4Attention(
            tiny("csa"), key=jax.random.key(0), execution=ce.Execution(numerics=NUMERICS)
        )
    with pytest.raises(ValueError, match=r"head_dim - rope_dim = 8 must be a multiple of 64"):
        cfg = tiny("csa", index_head_dim=32)
        ce.V4Attention(cfg, key=jax.random.key(0), execution=ce.Execution(numerics=NUMERICS))
    with pytest.raises(ValueError, match=r"numerics must be 'exact', 'deepseek'"):
        ce.Execution.from_options(numerics="fp8")
    with pytest.raises(ValueError, match=r"scale_fmt must be None or 'ue8m0'"):
        ce.DeepSeekInference(scale_fmt="e4m3")


@pytest.mark.parametrize(
    "score_dtype, want", [("bfloat16", [17, 18, 19, 20]), (None, [28, 29, 30, 31])]
)
def test_every_selection_strategy_rounds_scores_alike(score_dtype, want):
    """Scores ``1 + t·2^-12`` (t < 32) differ in float32 but round to two bf16 values (1 for
    t <= 16, 1 + 2^-7 above): rounded, the top 4 are the lowest indices of the upper tie;
    unrounded, the four largest. Dense, streaming and the row-sharded top-k all round (a
    strategy that rebuilt the problem without ``score_dtype`` would pick the largest)."""
    b, s, t, d = 1, 8, 32, 16
    keys = np.zeros((b, t, d), np.float32)
    keys[0, :, 0] = (1 + np.arange(t) * 2.0**-12) * d**0.5  # the d^-1/2 factor cancels
    q = np.zeros((b, s, 1, d), np.float32)
    q[..., 0] = 1.0
    slots = jnp.arange(t, dtype=jnp.int32)[None]
    layout = ce.EntryLayout(slots, jnp.zeros_like(slots), jnp.ones(slots.shape, bool))
    rows = jnp.full((b, s), t, jnp.int32)  # every query sees every entry
    visibility = ce.Visibility(rows, jnp.zeros_like(rows), layout)
    problem = ce.SelectionProblem.from_queries(
        jnp.asarray(q), jnp.ones((b, s, 1)), jnp.asarray(keys), visibility, 0, score_dtype
    )
    strategies = [
        ce.DenseSelection(),
        ce.StreamingSelection(key_block=8, query_block=4),
        ce.ShardedSelection(ce.DenseSelection()),
    ]
    with jax.set_mesh(jax.make_mesh((4, 2), ("data", "tensor"))):
        for strategy in strategies:
            got = np.asarray(eqx.filter_jit(lambda p, st=strategy: st.select(p, 4))(problem))
            np.testing.assert_array_equal(got, np.broadcast_to(want, (b, s, 4)), str(strategy))
