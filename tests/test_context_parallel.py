"""Context parallelism of the V4 layers and V3.2 on 8 simulated CPU devices: selections
bitwise equal to the single-device layer, outputs and gradients (parameters and x) within
1e-5, packed documents crossing chunk boundaries, sequences that need padding, and the
errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_helpers import walk_eqns
from parallel_helpers import (
    assert_loader_matches_hf,
    assert_matches_single_device,
    packed_segments,
    random_layer,
    relative_error,
)
from test_v4_behaviour import tiny

import csa_eqx as ce

CONTEXT8 = ((8,), ("context",))
CONTEXT4_TENSOR2 = ((4, 2), ("context", "tensor"))
DATA2_CONTEXT2_TENSOR2 = ((2, 2, 2), ("data", "context", "tensor"))
# streaming top-k with head chunks, the row-sharded top-k over the tensor axis, saved selection
SHARDED_STREAMING = dict(
    indexer_sharded_topk=True,
    indexer_save_selection=True,
    qk_head_chunk_size=2,
    indexer_key_block=4,
)
HEADS = dict(head_parallel=True)  # the attention heads split over the tensor axis too


def check_against_single_device(kind, mesh_shape, s, options, shard_x):
    """The context-parallel layer vs the same parameters on one device: forward (output and
    selection) and the gradient of a scalar loss w.r.t. every parameter and x."""
    layer = random_layer(kind)
    cp = layer.with_execution(ce.Execution.from_options(context_parallel=True, **options))
    x = jax.random.normal(jax.random.key(1), (2, s, layer.config.hidden_size))
    seg = packed_segments(2, s)

    def loss(layer, x, seg):
        return jnp.sum(jnp.sin(layer(x, segment_ids=seg)))

    def forward(layer, x, seg):
        return layer(x, segment_ids=seg, return_aux=True)

    want_y, want_aux = jax.jit(forward)(layer, x, seg)
    want_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, x, seg)
    mesh = jax.make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        if shard_x:  # x and the segment ids split along the sequence (and the batch over data)
            data = "data" if "data" in mesh.axis_names else None
            x, seg = (jax.device_put(a, NamedSharding(mesh, P(data, "context"))) for a in (x, seg))
        y, aux = jax.jit(forward)(cp, x, seg)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(cp, x, seg)
    assert_matches_single_device(kind, (y, aux, grads), (want_y, want_aux, want_grads))


@pytest.mark.parametrize(
    "kind, mesh_shape, s, options, shard_x",
    [
        # 45 rows: padded to 16 chunks of 8 (halo 7 = the CSA windows' 2m - 1)
        ("csa", CONTEXT8, 45, {}, False),
        # 64 rows split evenly; x arrives sharded along the sequence; the heads split over
        # the tensor axis; streaming top-k with head chunks, the row-sharded top-k over the
        # same tensor axis and the saved selection
        ("csa", CONTEXT4_TENSOR2, 64, SHARDED_STREAMING | HEADS, True),
        ("hca", CONTEXT4_TENSOR2, 45, HEADS, False),
        ("hca", CONTEXT8, 45, {}, False),
        ("sliding", CONTEXT8, 45, {}, False),
        ("sliding", CONTEXT4_TENSOR2, 45, HEADS, False),
        # V3.2: chunks of 3 tokens (45 rows padded to 48), every token an entry
        ("v32", CONTEXT8, 45, {}, False),
        # padded to 8 chunks of 5, with x sharded along the sequence
        ("v32", CONTEXT4_TENSOR2, 36, SHARDED_STREAMING | HEADS, True),
    ],
    ids=[
        "csa-context8-padded",
        "csa-context4xtensor2-heads-sharded-x",
        "hca-context4xtensor2-heads",
        "hca-context8-padded",
        "sliding-context8-padded",
        "sliding-context4xtensor2-heads",
        "v32-context8-padded",
        "v32-context4xtensor2-heads-sharded-x",
    ],
)
def test_matches_single_device(kind, mesh_shape, s, options, shard_x):
    check_against_single_device(kind, mesh_shape, s, options, shard_x)


@pytest.mark.parametrize(
    "kind, options",
    [
        ("sliding", {}),
        ("csa", dict(indexer_sharded_topk=True, **HEADS)),
        ("hca", {}),
        ("v32", dict(indexer_sharded_topk=True, **HEADS)),
    ],
    ids=["sliding", "csa-heads", "hca", "v32-heads"],
)
def test_data_axis_matches_single_device(kind, options):
    """(data=2, context=2, tensor=2): the batch split over data (one row each), the sequence
    over context (22 rows, padded), the top-k rows (and the heads, with head parallelism) over
    tensor, x sharded over both."""
    check_against_single_device(kind, DATA2_CONTEXT2_TENSOR2, 22, options, True)
    # the batch is split by the context shard_map itself (manual over data), not left to the
    # compiler; with head parallelism the same shard_map is manual over tensor too (context
    # around heads: one shard_map over both axes), and the row-sharded top-k runs its rows
    # inside it
    execution = ce.Execution.from_options(context_parallel=True, **options)
    cp = random_layer(kind).with_execution(execution)
    with jax.set_mesh(jax.make_mesh(*DATA2_CONTEXT2_TENSOR2)):
        jaxpr = jax.make_jaxpr(cp)(jnp.zeros((2, 22, cp.config.hidden_size)))
    manual = [
        e.params["newly_manual_axes"] for e in walk_eqns(jaxpr) if e.primitive.name == "shard_map"
    ]
    assert manual == (
        [{"data", "context", "tensor"}] if options.get("head_parallel") else [{"data", "context"}]
    )


@pytest.mark.parametrize(
    "kind, stage, mesh_shape, options",
    [
        ("csa", "sparse", CONTEXT8, {}),
        # the heads split over tensor: the target all-gathers them
        (
            "csa",
            "dense",
            CONTEXT4_TENSOR2,
            dict(indexer_key_block=4, qk_head_chunk_size=2, **HEADS),
        ),
        ("v32", "sparse", CONTEXT4_TENSOR2, dict(indexer_sharded_topk=True)),
        ("v32", "dense", CONTEXT8, dict(indexer_key_block=4, qk_head_chunk_size=2)),
    ],
    ids=[
        "csa-sparse-context8",
        "csa-dense-streaming-context4xtensor2-heads",
        "v32-sparse-context4xtensor2",
        "v32-dense-streaming-context8",
    ],
)
def test_indexer_loss_matches_single_device(kind, stage, mesh_shape, options):
    """The KL loss (a mean over the queries with a candidate, summed over the shards) and the
    gradients of a loss that includes it."""
    layer = random_layer(kind)
    cp = layer.with_execution(ce.Execution.from_options(context_parallel=True, **options))
    x = jax.random.normal(jax.random.key(1), (2, 45, layer.config.hidden_size))
    seg = packed_segments(2, 45)

    def loss(layer, x):
        y, aux = layer(x, segment_ids=seg, return_aux=True, indexer_loss=stage)
        return jnp.sum(jnp.sin(y)) + 3.0 * aux["indexer_loss"], aux["indexer_loss"]

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, want), want_grads = jax.jit(grad)(layer, x)
    with jax.set_mesh(jax.make_mesh(*mesh_shape)):
        (_, got), grads = jax.jit(grad)(cp, x)
    assert float(want) > 0
    assert abs(float(got) - float(want)) <= 1e-5 * float(want)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert relative_error(got, want) < 1e-5


@pytest.mark.torch
@pytest.mark.parametrize(
    "family, options, mesh_shape, seq, min_rows",
    [
        # S = 100: not a multiple of 2 x 4 x m; the axis renamed; the heads split over tensor
        (
            "v4",
            dict(context_axis="seq", head_parallel=True),
            ((4, 2), ("seq", "tensor")),
            100,
            90,
        ),
        ("v32", {}, CONTEXT8, 50, 26),  # S = 50: padded to 16 chunks of 4
    ],
)
def test_loader_option_matches_transformers(family, options, mesh_shape, seq, min_rows):
    """``load_v4_attention`` / ``load_v32_attention(..., context_parallel=True)`` (V4 with
    ``head_parallel=True`` too) under a mesh with the context axis give HF's output and top-k."""
    mesh = jax.make_mesh(*mesh_shape)
    layer = assert_loader_matches_hf(
        family, dict(context_parallel=True, **options), mesh, seq, min_rows
    )
    assert layer.execution.context == ce.ContextParallel(options.get("context_axis", "context"))


def test_zigzag_balances_causal_work():
    """Device i owns chunks i and 2N - 1 - i: the causal work (keys visible to its rows) is
    the same on every device."""
    plan = ce.ContextParallel("context", mesh=jax.make_mesh(*CONTEXT8)).plan(1000, 7, 4)
    assert plan.devices == 8 and plan.chunk % 4 == 0 and 16 * plan.chunk >= 1000
    rows = plan.chunks[..., None] * plan.chunk + np.arange(plan.chunk)  # [N, 2, c]
    work = (rows + 1).sum(axis=(1, 2))
    assert (work == work[0]).all()
    np.testing.assert_array_equal(np.sort(rows.reshape(-1)), np.arange(16 * plan.chunk))


def test_errors_name_axis_and_sizes():
    layer = ce.V4Attention(tiny("csa"), key=jax.random.key(0))
    cp = layer.with_execution(ce.Execution.from_options(context_parallel=True))
    x = jnp.zeros((1, 16, 32))
    no_axis = pytest.raises(
        ValueError, match=r"Execution.context needs a mesh axis named 'context'"
    )
    with jax.set_mesh(jax.make_mesh((8,), ("tensor",))), no_axis:
        cp(x)
    with pytest.raises(ValueError, match="context_axis must be a non-empty mesh axis name"):
        ce.Execution.from_options(context_parallel=True, context_axis="")
    with pytest.raises(ValueError, match="ContextParallel.axis and data_axis must differ"):
        ce.Execution.from_options(context_parallel=True, context_axis="data")
    with pytest.raises(ValueError, match="indexer_heads_axis must be None with context"):
        ce.Execution.from_options(context_parallel=True, shard_indexer_acts=True)


def test_compiled_memory_splits_over_the_context_axis(capfd):
    """Compile only: fwd+bwd of a CSA layer (hidden 1024, 16 heads x 256, indexer 16 x 64,
    k = 256) at S = 32k needs at most 1.3 x (one device's temp / 8) per device on 8 devices
    (each device's tiles shrink with its share of the rows: ``auto.shared_tiles``), and XLA
    reports no involuntary full rematerialisation."""
    cfg = ce.V4AttentionConfig(
        hidden_size=1024,
        num_heads=16,
        head_dim=256,
        rope_dim=64,
        q_lora_rank=512,
        o_groups=4,
        o_lora_rank=256,
        sliding_window=128,
        compress_rate=4,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=256,
    )
    mesh = jax.make_mesh(*CONTEXT8)

    def temp(execution, sharding):
        layer = jax.eval_shape(
            lambda: ce.V4Attention(cfg, key=jax.random.key(0), execution=execution)
        )
        params, static = eqx.partition(layer, lambda v: isinstance(v, jax.ShapeDtypeStruct))
        x = jax.ShapeDtypeStruct((1, 32768, 1024), jnp.float32, sharding=sharding)

        def fwd_bwd(p, x):
            return jax.grad(lambda p, x: jnp.sum(eqx.combine(p, static)(x)), (0, 1))(p, x)

        with jax.set_mesh(mesh):
            compiled = jax.jit(fwd_bwd).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one = temp(ce.Execution(), None)
    split = temp(
        ce.Execution(context=ce.ContextParallel()), NamedSharding(mesh, P(None, "context"))
    )
    assert split <= 1.3 * one / 8, (split / 2**30, one / 2**30)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
