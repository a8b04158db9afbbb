"""Head and context parallelism of a V4.1 stack on simulated CPU devices (docs/v41.md,
"Scaling out"): the tiny stack of test_v41_layers.py (every role: sliding, full ratio 2, reuse,
full ratio 1 with candidates, reindex within them, reuse after it), run layer by layer under a
mesh, against the single-device stack: outputs, the index sources' indexer losses and the
gradients (parameters and x) within 1e-5, every published selection and candidate block
bitwise, published entries and keys bitwise (head parallel) or within float rounding (context
parallel), packed documents in row 0; the errors and the loader's execution keywords."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parallel_helpers import relative_error
from test_v41_config import _get
from test_v41_layers import CONFIG, _stack

import csa_eqx as ce
from csa_eqx.hf import load_v41_attention, v41_parameter_names

SEQ = 24
SEGMENTS = jnp.asarray(np.repeat([[0, 1], [0, 0]], [11, 13], axis=1), jnp.int32)


def objective(layers, x, published=True):
    """A scalar of every layer's output and the index sources' indexer losses (sparse stage),
    and what the stack returns: the outputs, the losses and (``published``) the published
    state."""
    ys, states, auxes = ce.run_v41_stack(
        layers, x, segment_ids=SEGMENTS, return_aux=True, indexer_loss="sparse"
    )
    losses = [aux["indexer_loss"] for aux in auxes if aux["indexer_loss"] is not None]
    value = sum(jnp.sum(jnp.sin(y)) for y in ys) + 3.0 * sum(losses)
    return value, (ys, losses, states if published else None)


grad = jax.jit(
    jax.value_and_grad(objective, argnums=(0, 1), has_aux=True), static_argnames="published"
)


@functools.cache
def single_device():
    """The stack, its input and its single-device outputs, published state and gradients."""
    layers = _stack()
    x = jax.random.normal(jax.random.key(1), (2, SEQ, CONFIG.hidden_size))
    (_, (ys, losses, published)), grads = grad(layers, x)
    return layers, x, (ys, losses), published, grads


def assert_matches_single_device(got, entries_exact):
    """``got`` is ``((ys, losses), published, grads)``; selections and candidates (and, when
    ``entries_exact``, entries and keys) bitwise, the rest within 1e-5."""
    *_, (want_ys, want_losses), want_published, want_grads = single_device()
    (ys, losses), published, grads = got
    for i, (y, want_y) in enumerate(zip(ys, want_ys, strict=True)):
        assert relative_error(y, want_y) < 1e-5, i
    assert len(want_losses) == 3 and min(want_losses) > 0  # the index sources 1, 3 and 4
    # a KL near 0 (~6e-4 here) is a small difference of O(1) terms: its rounding is absolute
    np.testing.assert_allclose(np.asarray(losses), np.asarray(want_losses), rtol=1e-5, atol=1e-7)
    for i, (pub, want) in enumerate(zip(published, want_published, strict=True)):
        for name in ("selection", "candidates", "layout", "entries", "keys"):
            value, want_value = getattr(pub, name), getattr(want, name)
            assert (value is None) == (want_value is None), (i, name)
            if value is None:
                continue
            if name in ("entries", "keys") and not entries_exact:
                filled = np.asarray(want.layout.end) >= 0  # an empty slot's value is unspecified
                got_filled, want_filled = np.asarray(value)[filled], np.asarray(want_value)[filled]
                assert relative_error(got_filled, want_filled) < 1e-5, (i, name)
            else:
                for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(want_value), strict=True):
                    np.testing.assert_array_equal(
                        np.asarray(a), np.asarray(b), err_msg=f"{i} {name}"
                    )
    # the selections are not trivial and the candidate filter bites (6 blocks of 4, 2 kept)
    assert (np.asarray(want_published[4].selection) >= 0).any()
    assert (np.asarray(want_published[3].candidates) >= 0).all(-1).mean() > 0.5
    leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
    assert len(leaves) == len(want_leaves)
    for leaf, want_leaf in zip(leaves, want_leaves, strict=True):
        assert relative_error(leaf, want_leaf) < 1e-5


def test_head_parallel_stack_matches_single_device():
    """Every layer head-parallel on a (data 2, tensor 2) mesh (x split over data): one
    shard_map per layer, manual over both axes; what the heads share (compressor, indexer,
    top-k, candidates) is computed on every device, so the published state is bitwise."""
    layers, x, *_ = single_device()
    hp = [layer.with_execution(ce.Execution.from_options(head_parallel=True)) for layer in layers]
    mesh = jax.make_mesh((2, 2), ("data", "tensor"))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("data")))
        (_, (ys, losses, published)), grads = grad(hp, x)
        jaxpr = jax.make_jaxpr(objective)(hp, x)
    assert_matches_single_device(((ys, losses), published, grads), entries_exact=True)
    manual = [e.params["newly_manual_axes"] for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert manual == [{"data", "tensor"}] * CONFIG.num_layers


@pytest.mark.parametrize(
    "mesh_shape, heads",
    [(((4,), ("context",)), False), (((2, 2, 2), ("data", "context", "tensor")), True)],
    ids=["context4", "data2xcontext2xtensor2-heads"],
)
def test_context_parallel_stack_matches_single_device(mesh_shape, heads):
    """Every layer context-parallel, x split along the sequence: 2N zigzag chunks (context 4:
    chunks of 4 rows at ratio 2, the sequence padded to 32, and 3 rows at ratio 1) with 3-row
    halos; each device makes the entries its chunks close and all-gathers them, and the
    published entries are the whole sequence's. With ``heads``, the batch is split over data
    too, the heads over tensor inside each context shard and each shard's top-k rows over
    tensor too (``indexer_sharded_topk``)."""
    layers, x, *_ = single_device()
    execution = ce.Execution.from_options(
        context_parallel=True, head_parallel=heads, indexer_sharded_topk=heads
    )
    cp = [layer.with_execution(execution) for layer in layers]
    mesh = jax.make_mesh(*mesh_shape)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("data" if heads else None, "context")))
        # XLA's Shardy partitioner of JAX 0.10.2 (not 0.12) aborts compiling this gradient
        # under context x tensor when it also returns the candidate source's selection
        # (docs/v41.md, "Scaling out"): the published state from the forward alone there
        (_, (ys, losses, published)), grads = grad(cp, x, published=not heads)
        if heads:
            _, published = jax.jit(ce.run_v41_stack)(cp, x, segment_ids=SEGMENTS)
    assert_matches_single_device(((ys, losses), published, grads), entries_exact=False)


def test_errors_name_axis_and_sizes():
    """A mesh without the axis, or a tensor axis that does not divide the heads: named
    ValueErrors before anything compiles."""
    layers = _stack()
    x = jnp.zeros((1, 8, CONFIG.hidden_size))
    hp = layers[1].with_execution(ce.Execution.from_options(head_parallel=True))
    cp = layers[1].with_execution(ce.Execution.from_options(context_parallel=True))
    for layer, mesh_shape, match in (
        (hp, ((8,), ("tensor",)), "'tensor' has 8 devices.*divide num_heads=4"),
        (hp, ((4,), ("tensor",)), "'tensor' has 4 devices.*divide o_groups=2"),
        (cp, ((8,), ("tensor",)), "Execution.context needs a mesh axis named 'context'"),
    ):
        with jax.set_mesh(jax.make_mesh(*mesh_shape)), pytest.raises(ValueError, match=match):
            layer(x)


def test_loader_takes_the_execution_keywords():
    """``load_v41_attention`` takes ``Execution.from_options``' keywords as the V4 loaders do
    (or ``execution=``, not both); ``numerics="deepseek"`` names V4.1's DeepSeek numerics
    (test_v41_reference's quantised runs load through it and match DeepSeek's code)."""
    layer = _stack()[3]
    names = v41_parameter_names(layer)
    tensors = {f"layers.3.attn.{n}": _get(layer, p) for p, n in names.items()}
    loaded = load_v41_attention(CONFIG, 3, tensors, head_parallel=True, context_parallel=True)
    assert loaded.execution.placement == ce.ContextParallel(inner=ce.HeadParallel())
    with pytest.raises(ValueError, match="either execution= or the execution keywords"):
        load_v41_attention(CONFIG, 3, tensors, execution=ce.Execution(), head_parallel=True)
    # this tiny stack's head_dim is too small for the numerics' blocks: checked as V4.1's
    with pytest.raises(ValueError, match="multiple of 32 for DeepSeekV41Inference numerics"):
        load_v41_attention(CONFIG, 3, tensors, numerics="deepseek")
