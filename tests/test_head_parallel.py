"""Head parallelism of the V4 layers and V3.2 on simulated CPU devices: selections bitwise
equal to the single-device layer, outputs and gradients (parameters and x) within 1e-5 (also
with the row-sharded top-k and the indexer loss), the loader option against HF transformers,
the per-device weight shards, and the errors. Head parallelism together with context
parallelism is tested in test_context_parallel.py."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parallel_helpers import (
    assert_loader_matches_hf,
    assert_matches_single_device,
    packed_segments,
    random_layer,
    relative_error,
)
from test_v4_behaviour import tiny

import csa_eqx as ce
from csa_eqx.presets import tiny_v32, v4_flash

TENSOR2 = ((2,), ("tensor",))
TENSOR4 = ((4,), ("tensor",))
DATA2_TENSOR2 = ((2, 2), ("data", "tensor"))
# the tests of a kind share its single-device reference (``single_device``): one half of
# `make test` runs them (tests/conftest.py, ``_unit``)
DEALT_TOGETHER = ("kind",)
HEAD_SPLIT = {"q_b_proj": 0, "sinks": 0, "o_a_proj": 0, "o_b_proj": 1}  # name -> split dim


def loss(layer, x):
    return jnp.sum(jnp.sin(layer(x, segment_ids=packed_segments(2, 45))))


def forward(layer, x):
    return layer(x, segment_ids=packed_segments(2, 45), return_aux=True)


@functools.cache
def single_device(kind):
    """The layer, its input, and its single-device output, aux and gradients (once per kind)."""
    layer = random_layer(kind, o_groups=4)  # (V3.2 ignores the V4 field)
    x = jax.random.normal(jax.random.key(1), (2, 45, layer.config.hidden_size))
    y, aux = jax.jit(forward)(layer, x)
    return layer, x, y, aux, jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, x)


@pytest.mark.parametrize(
    "kind, mesh_shape",
    [
        ("csa", TENSOR2),
        ("csa", TENSOR4),
        ("csa", DATA2_TENSOR2),
        ("hca", TENSOR4),
        ("hca", DATA2_TENSOR2),
        ("sliding", TENSOR2),
        ("v32", TENSOR4),
        ("v32", DATA2_TENSOR2),
    ],
    ids=[
        "csa-tensor2",
        "csa-tensor4",
        "csa-data2xtensor2",
        "hca-tensor4",
        "hca-data2xtensor2",
        "sliding-tensor2",
        "v32-tensor4",
        "v32-data2xtensor2",
    ],
)
def test_matches_single_device(kind, mesh_shape):
    """Forward (output, selection) and the gradient of a scalar loss w.r.t. every parameter
    and x, packed documents in row 0; x sharded over data when the mesh has it."""
    layer, x, want_y, want_aux, want_grads = single_device(kind)
    hp = layer.with_execution(ce.Execution.from_options(head_parallel=True))
    mesh = jax.make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        if "data" in mesh.axis_names:
            x = jax.device_put(x, NamedSharding(mesh, P("data")))
        y, aux = jax.jit(forward)(hp, x)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(hp, x)
        jaxpr = jax.make_jaxpr(forward)(hp, x)
    assert_matches_single_device(kind, (y, aux, grads), (want_y, want_aux, want_grads))
    # one explicit shard_map, manual over the tensor axis (and data when it splits the batch)
    (manual,) = [
        e.params["newly_manual_axes"] for e in jaxpr.eqns if e.primitive.name == "shard_map"
    ]
    assert manual == set(mesh.axis_names)


@pytest.mark.parametrize(
    "kind, stage, mesh_shape",
    [("csa", "sparse", TENSOR2), ("v32", "dense", DATA2_TENSOR2)],
)
def test_indexer_loss_and_sharded_topk_match_single_device(kind, stage, mesh_shape):
    """With the row-sharded top-k over the same tensor axis (each device selects its slice of
    the rows inside the head-parallel shard_map) and the indexer's KL loss (its target over
    every head, all-gathered): the selection bitwise, the loss and the gradients of a loss that
    includes it within 1e-5."""
    layer, x, *_ = single_device(kind)
    options = dict(indexer_sharded_topk=True, qk_head_chunk_size=2)
    hp = layer.with_execution(ce.Execution.from_options(head_parallel=True, **options))
    seg = packed_segments(2, 45)

    def loss(layer, x):
        y, aux = layer(x, segment_ids=seg, return_aux=True, indexer_loss=stage)
        return jnp.sum(jnp.sin(y)) + 3.0 * aux["indexer_loss"], aux

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, want), want_grads = jax.jit(grad)(layer, x)
    with jax.set_mesh(jax.make_mesh(*mesh_shape)):
        (_, got), grads = jax.jit(grad)(hp, x)
    assert float(want["indexer_loss"]) > 0
    assert relative_error(got["indexer_loss"], want["indexer_loss"]) < 1e-5
    np.testing.assert_array_equal(np.asarray(got["selection"]), np.asarray(want["selection"]))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert relative_error(got, want) < 1e-5


def test_weight_shards_are_one_over_the_axis():
    """Compile-time shapes: inside the shard_map each device holds 1/T of the query
    projection's rows, the sinks, the grouped o_a_proj's rows and o_b_proj's input columns,
    and every other weight whole (T = 4, V4-Flash's CSA layer, traced abstractly)."""
    cfg = v4_flash("csa")
    execution = ce.Execution.from_options(head_parallel=True)
    layer = jax.eval_shape(lambda: ce.V4Attention(cfg, key=jax.random.key(0), execution=execution))
    params, static = eqx.partition(layer, lambda v: isinstance(v, jax.ShapeDtypeStruct))
    x = jax.ShapeDtypeStruct((1, 64, cfg.hidden_size), jnp.float32)
    with jax.set_mesh(jax.make_mesh(*TENSOR4)):
        jaxpr = jax.make_jaxpr(lambda p, x: eqx.combine(p, static)(x))(params, x)
    (shard_map,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    named = jax.tree_util.tree_flatten_with_path(params)[0]
    # the shard_map's inputs end with the layer's arrays, x and the rows' integer arrays:
    # positions, segments, query indices and two entry layouts of three arrays each (before
    # them: constants the layer's code closes over)
    rows = 3 + 2 * 3
    inner = shard_map.params["jaxpr"].invars[-len(named) - 1 - rows : -1 - rows]
    split_bytes = whole_bytes = 0
    for (path, leaf), var in zip(named, inner, strict=True):
        name = path[1].name if len(path) == 2 and path[0].name == "block" else None
        local = var.aval.shape
        if name in HEAD_SPLIT:
            d = HEAD_SPLIT[name]
            want = leaf.shape[:d] + (leaf.shape[d] // 4,) + leaf.shape[d + 1 :]
            split_bytes += leaf.size * 4
        else:
            want = leaf.shape
        assert local == want, (path, local, want)
        whole_bytes += leaf.size * 4
    assert split_bytes > 0.5 * whole_bytes  # the split weights are most of the layer's


@pytest.mark.torch
@pytest.mark.parametrize(
    "family, mesh_shape, seq, min_rows", [("v4", TENSOR2, 40, 31), ("v32", TENSOR4, 30, 16)]
)
def test_loader_option_matches_transformers(family, mesh_shape, seq, min_rows):
    """``load_v4_attention`` / ``load_v32_attention(..., head_parallel=True)`` under a mesh
    with the tensor axis give HF's output and top-k."""
    mesh = jax.make_mesh(*mesh_shape)
    layer = assert_loader_matches_hf(family, dict(head_parallel=True), mesh, seq, min_rows)
    assert layer.execution.heads == ce.HeadParallel("tensor")


def test_errors_name_axis_and_sizes():
    hp = ce.Execution.from_options(head_parallel=True)
    x = jnp.zeros((1, 16, 32))
    two_groups = ce.V4Attention(tiny("csa"), key=jax.random.key(0), execution=hp)  # o_groups 2
    v32 = ce.V32Attention(tiny_v32(), key=jax.random.key(0), execution=hp)
    for mesh_shape, error, match, call in (
        (((8,), ("context",)), ValueError, "Execution.heads needs a mesh axis named 'tensor'", {}),
        (TENSOR4, ValueError, "'tensor' has 4 devices.*divide o_groups=2", {}),
        (((8,), ("tensor",)), ValueError, "'tensor' has 8 devices.*divide num_heads=4", {}),
    ):
        with jax.set_mesh(jax.make_mesh(*mesh_shape)), pytest.raises(error, match=match):
            two_groups(x, **call)
    v32_heads = pytest.raises(ValueError, match="'tensor' has 8 devices.*divide num_heads=4")
    with jax.set_mesh(jax.make_mesh((8,), ("tensor",))), v32_heads:
        v32(jnp.zeros((1, 8, v32.config.hidden_size)))
    with pytest.raises(ValueError, match="heads is not composable with indexer_heads_axis"):
        ce.Execution.from_options(head_parallel=True, shard_indexer_acts=True)
    with pytest.raises(ValueError, match="heads needs a HeadParallel.axis other than the Cont"):
        ce.Execution.from_options(head_parallel=True, context_parallel=True, context_axis="tensor")
    with pytest.raises(ValueError, match="HeadParallel.axis and data_axis must differ"):
        ce.Execution.from_options(head_parallel=True, tensor_axis="data")
