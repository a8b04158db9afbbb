"""``DeepSeekInference`` numerics: agreement with DeepSeek's own quantised inference code
(fixtures), and every execution path with the numerics on.

The ``q_*`` fixtures in ``tests/fixtures/deepseek/`` hold DeepSeek's inference code run in
bf16 with plain-torch ports of its kernels (``README.md`` there) on bf16 weights: V3.2 with FP8
indexer scoring and its FP8 KV latent, V4 CSA with the FP4 indexer, V4 CSA and HCA with
V4-Pro's FP8 KV round trip; the ``q8_*`` ones the same code on FP8 checkpoints
(``benchmarks.numerics_agreement`` loads them, jitted; the FP8 projections as ``Fp8Weight``).
The numerics must reproduce DeepSeek's selections (mean overlap >= 0.99) and, on rows whose
selection is equal, its output within 1e-2 of its largest value (measured: bit for bit on
every FP8 case); the exact path must not. The parallel and decode tests run layers with
``Fp8Weight`` projections (8 x 8 tiles) and layers with bf16 weights.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from parallel_helpers import packed_segments, relative_error
from test_v4_behaviour import randomise, tiny

import csa_eqx as ce
from csa_eqx._numerics.base import V41_FORMATS
from csa_eqx.presets import tiny_v32

BF16_CASES = ["q_v32", "q_v4_csa_flash", "q_v4_csa_pro", "q_v4_hca_pro"]
FP8_CASES = ["q8_v32", "q8_v4_csa_flash", "q8_v4_csa_pro", "q8_v4_hca_flash", "q8_v4_hca_pro"]


@pytest.mark.torch  # the fixtures are written as a checkpoint with safetensors' torch API
@pytest.mark.parametrize("name", BF16_CASES)
def test_matches_deepseeks_quantised_inference(name):
    from benchmarks.numerics_agreement import QUANTISED, agreement

    assert list(QUANTISED) == BF16_CASES + FP8_CASES
    kv_fp8 = QUANTISED[name][3]
    overlap, _, err = agreement(name, ce.DeepSeekInference(kv_fp8=kv_fp8))
    assert overlap >= 0.99 and err <= 1e-2, (overlap, err)
    # the exact path does not: fewer equal picks (indexer) or a larger error (FP8 KV)
    exact_overlap, _, exact_err = agreement(name, "exact")
    assert exact_overlap < 0.98 or exact_err > 2e-2, (exact_overlap, exact_err)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["q8_v32", "q8_v4_csa_pro", "q8_v4_hca_flash"])
def test_matches_deepseeks_quantised_inference_on_fp8_checkpoints(name):
    """DeepSeek's code on FP8 checkpoint folders (E4M3 128 x 128 tiles, power-of-two scales,
    the released configs' keys), loaded with ``numerics="deepseek"``: the FP8 projections kept
    as ``Fp8Weight`` (V4's ``o_a_proj`` dequantised, as DeepSeek's ``convert.py``), run jitted;
    the issue's bar (benchmarks/numerics_agreement.py runs every case; docs/numerics.md)."""
    from benchmarks.numerics_agreement import QUANTISED, agreement, load

    overlap, _, err = agreement(name, ce.DeepSeekInference(kv_fp8=QUANTISED[name][3]))
    assert overlap >= 0.99 and err <= 1e-2, (overlap, err)
    layer, _ = load(name, numerics="deepseek")
    exact, _ = load(name)
    if name == "q8_v32":
        held = [layer.q_a_proj, layer.kv_b_proj, layer.o_proj, layer.indexer.wk]
        floats = [exact.q_a_proj, exact.kv_b_proj]
    else:
        held = [layer.block.q_a_proj, layer.block.kv_proj, layer.block.o_b_proj]
        floats = [layer.block.o_a_proj, exact.block.q_a_proj]
    assert all(isinstance(w, ce.Fp8Weight) for w in held)
    assert not any(isinstance(w, ce.Fp8Weight) for w in floats)


@pytest.mark.torch
def test_loader_keyword_reads_the_scale_format():
    from benchmarks.numerics_agreement import load

    layer, _ = load("q_v32", numerics="deepseek")  # the config says scale_fmt "ue8m0"
    assert layer.execution.numerics == ce.DeepSeekInference(scale_fmt="ue8m0")
    layer, _ = load("q_v4_hca_pro", numerics="deepseek")  # V4: scale_dtype "fp8" by default
    assert layer.execution.numerics == ce.DeepSeekInference(scale_fmt="ue8m0", kv_fp8=False)


NUMERICS = ce.DeepSeekInference(kv_fp8=True)
# the projections an FP8 checkpoint stores in FP8 and DeepSeek's code multiplies as FP8
FP8_PATHS = {
    "v32": (
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "indexer.wq_b",
        "indexer.wk",
    ),
    "v4": (
        "block.q_a_proj",
        "block.q_b_proj",
        "block.kv_proj",
        "block.o_b_proj",
        "indexer.q_b_proj",
    ),
}


def fp8_weight(w: np.ndarray, block: int) -> ce.Fp8Weight:
    """``w`` as DeepSeek's releases store it: E4M3 values, one power-of-two scale
    ``2^ceil(log2(amax / 448))`` per ``block x block`` tile (ragged at the edges)."""
    out, inp = w.shape
    grid = (-(-out // block), -(-inp // block))
    scale = np.ones(grid, np.float32)
    values = np.zeros(w.shape, np.float32)
    for i, j in np.ndindex(grid):
        tile = np.s_[i * block : (i + 1) * block, j * block : (j + 1) * block]
        scale[i, j] = 2.0 ** np.ceil(np.log2(np.abs(w[tile]).max() / 448))
        values[tile] = w[tile] / scale[i, j]
    q = jnp.asarray(values.astype(ml_dtypes.float8_e4m3fn))
    return ce.Fp8Weight(q, jnp.asarray(scale), (block, block))


def with_fp8(layer, block: int = 8):
    """``layer`` with the projections of ``FP8_PATHS`` it holds as ``Fp8Weight`` (``block``-wide
    tiles: the tiny layers' widths are multiples of 8), as a loader keeps them."""
    for path in FP8_PATHS["v32" if isinstance(layer, ce.V32Attention) else "v4"]:

        def get(m, path=path):
            for name in path.split("."):
                m = getattr(m, name)
            return m

        if layer.indexer is not None or not path.startswith("indexer."):
            layer = eqx.tree_at(get, layer, fp8_weight(np.asarray(get(layer)), block))
    return layer


def numerics_layer(kind: str, fp8: bool = True, **options):
    """A tiny random layer whose sizes DeepSeek's formats take (indexer 32 / 128 wide, 64
    non-rotary KV channels, V3.2's latent 128 wide), run with ``NUMERICS`` and the
    ``Execution.from_options``; with ``fp8``, its projections ``Fp8Weight`` (``with_fp8``)."""
    ex = ce.Execution.from_options(numerics=NUMERICS, **options)
    if kind == "v32":
        cfg = tiny_v32(index_head_dim=128, kv_lora_rank=128)
        layer = randomise(ce.V32Attention(cfg, key=jax.random.key(0), execution=ex))
    else:
        cfg = tiny(kind, head_dim=72, index_head_dim=32, sliding_window=6, index_topk=4)
        layer = randomise(ce.V4Attention(cfg, key=jax.random.key(0), execution=ex))
    return with_fp8(layer) if fp8 else layer


def forward(layer, x, seg):
    return layer(x, segment_ids=seg, return_aux=True)


@pytest.mark.parametrize(
    "kind, fp8, options",
    [
        ("csa", False, dict(indexer_sharded_topk=True, qk_head_chunk_size=2, indexer_key_block=4)),
        ("csa", True, dict(context_parallel=True, head_parallel=True, indexer_sharded_topk=True)),
        ("hca", False, dict(context_parallel=True, head_parallel=True)),
        ("v32", True, dict(context_parallel=True, head_parallel=True, indexer_sharded_topk=True)),
    ],
    ids=["csa-sharded-streaming", "csa-context-heads", "hca-context-heads", "v32-context-heads"],
)
def test_parallel_selections_equal_one_device(kind, fp8, options):
    """With the numerics on, the row-sharded top-k and context x head parallelism select
    exactly what one device selects; outputs agree to bf16 rounding. With FP8 projections
    (``Fp8Weight``: DeepSeek's FP8 products) too: head parallelism splits their values and
    tile scales; the others are bf16-weight layers."""
    one = numerics_layer(kind, fp8)
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
    """Prefill, then chunks of 5 and single tokens through ``extend`` (CSA and V3.2 with FP8
    projections, V3.2 in DeepSeek's expanded form over the cache; HCA on bf16 weights): the
    same selections as the full forward, outputs to bf16 rounding."""
    layer = numerics_layer(kind, fp8=kind != "hca")
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
    (straight-through), finite and non-zero (float weights: an ``Fp8Weight`` is frozen)."""
    layer = numerics_layer("csa", fp8=False)
    x = jax.random.normal(jax.random.key(3), (1, 32, layer.config.hidden_size))

    def loss(layer):
        return layer(x, return_aux=True, indexer_loss="sparse")[1]["indexer_loss"]

    grads = jax.jit(jax.grad(loss))(layer)
    indexer = grads.indexer
    for g in (indexer.q_b_proj, indexer.weights_proj, grads.index_compressor.kv_proj):
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
    # head parallelism gives each device whole FP8 tiles: o_b_proj's 16 columns in 16-wide
    # tiles cannot be split over 2 devices
    layer = with_fp8(numerics_layer("csa", fp8=False, head_parallel=True), block=16)
    x = jnp.zeros((2, 8, layer.config.hidden_size))
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    match = r"columns of .*o_b_proj.* each needs whole tiles"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        layer(x)
    with pytest.raises(ValueError, match="TritonAttention computes the exact softmax"):
        ce.Execution(attention=ce.TritonAttention(), numerics=NUMERICS)


def _bf16(v) -> np.ndarray:
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_v4_scores_round_under_jit():
    """V4's bf16 scores (each head's logit, its weight and their product rounded, the head sum
    in float32, then rounded) are the numpy reference's under ``jit`` too: a cast whose result
    is upcast into the head sum is one XLA drops (41% of these scores differed)."""
    rng = np.random.default_rng(14)
    q, k = rng.normal(size=(2, 16, 8, 32)), rng.normal(size=(2, 24, 32))
    w = rng.normal(size=(2, 16, 8))
    q, k, w = (np.asarray(a, np.float32) for a in (q, k, w))
    logits = np.einsum("bshd,btd->bsht", q, k)
    terms = _bf16(np.maximum(_bf16(logits), 0) * _bf16(w * 32**-0.5)[..., None])
    scores = jax.jit(ce.indexer_scores, static_argnames="score_dtype")
    got = scores(jnp.asarray(q), jnp.asarray(w), jnp.asarray(k), score_dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(got), _bf16(terms.sum(2)))


def test_one_deepseek_numerics_for_every_family():
    """``DeepSeekInference`` runs a V4.1 layer (it reads what to quantise from the family's
    formats; what each hook computes for every family: tests/test_conformance_numerics.py);
    ``DeepSeekV41Inference`` is the same under V4.1's name, for V4.1 layers only. The loaders'
    keyword names them in one place (``named_numerics``)."""
    from csa_eqx._numerics.deepseek import named_numerics

    cfg = ce.V41AttentionConfig(
        compress_ratios=(0, 1),
        kv_source_layers=(1,),
        index_source_layers=(1,),
        **{**V41_SIZES, "hidden_size": 32},
    )
    ex = ce.Execution(numerics=ce.DeepSeekInference())
    assert ce.V41Attention(cfg, 1, key=jax.random.key(0), execution=ex).execution is ex
    with pytest.raises(ValueError, match="DeepSeekV41Inference is the numerics of V4.1 layers"):
        v41 = ce.Execution(numerics=ce.DeepSeekV41Inference())
        ce.V4Attention(
            tiny("csa", head_dim=72, index_head_dim=32), key=jax.random.key(0), execution=v41
        )
    with pytest.raises(ValueError, match=r"kv_lora_rank=32 must be a multiple of 128"):
        ce.V32Attention(tiny_v32(index_head_dim=128), key=jax.random.key(0), execution=ex)
    assert named_numerics("deepseek", None) == ce.DeepSeekInference(scale_fmt=None)
    assert type(named_numerics("deepseek", formats=V41_FORMATS)) is ce.DeepSeekV41Inference
    assert named_numerics("exact") == ce.ExactNumerics()
    assert named_numerics(NUMERICS) is NUMERICS


# the sizes of a V4.1 layer DeepSeek's formats take (head_dim, index_head_dim multiples of 32)
V41_SIZES = dict(
    num_heads=2, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    sliding_window=4, index_n_heads=2, index_head_dim=32, index_topk=2,
)  # fmt: skip
