"""Every member of every family composes with JAX's transformations (issue 53;
docs/composing.md): one program per member nests them all, on 8 simulated CPU devices.

The program: a ``jax.shard_map`` over ``data`` with JAX's default ``check_vma`` (the batch
split, the weights replicated), inside it ``jax.value_and_grad`` of a ``lax.scan`` over two
stacked layers (their selections tagged, ``save_selection``) whose body is a
``jax.checkpoint`` with ``compose_selection_policy`` around a ``jax.vmap`` of the layer over
unbatched sequences, the loss's ``pmean`` over ``data``;
jitted with the inputs donated and traced under ``jax_enable_checks``; it must carry no
effect. Its loss (the outputs' mean square and the indexer losses) and every gradient must
equal the reference: the same two layers (the same weights) on the automatic path (XLA on the
CPU), called one after the other on the whole batch, on one device, untransformed; one
reference per config and indexer loss stage, shared by the members that have them. Members
run forced; the kernels in plain interpret mode. Each program is traced once: the checked
trace is the one compiled and run.
"""

import contextlib
import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import RowsRead, mosaic_plan
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AxisType

import csa_eqx as ce
from csa_eqx.presets import tiny_v4, tiny_v32
from csa_eqx.remat import compose_selection_policy

B, S, K = 4, 24, 3
MESH = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
V4 = tiny_v4(
    "csa", hidden_size=48, q_lora_rank=24, sliding_window=6, index_n_heads=8, index_topk=K,
    o_groups=4,  # HeadParallel over the 4 devices of "tensor"
)  # fmt: skip
V32 = tiny_v32(index_topk=K)

MOSAIC = dict(selection=ce.MosaicSelection(), attention=ce.MosaicAttention())
TRITON = dict(
    selection=ce.TritonSelection(), attention=ce.TritonAttention(), scorer=ce.TritonScorer()
)
# (config, Execution fields, indexer loss stage): the members of every family, the kernels of a
# backend together (one program each: interpret mode compiles slowly on the CPU)
MEMBERS = {
    "auto": (V4, {}, "off"),
    "auto/v32": (V32, {}, "off"),
    "selection/dense+scorer/blocked": (
        V4,
        dict(selection=ce.DenseSelection(), scorer=ce.BlockedScorer()),
        "off",
    ),  # fmt: skip
    "selection/streaming+loss/streaming": (
        V4,
        dict(selection=ce.StreamingSelection(), indexer_kl=ce.StreamingIndexerLoss()),
        "dense",
    ),  # fmt: skip
    "selection/gathered+loss/gathered": (
        V4,
        dict(selection=ce.GatheredSelection(), indexer_kl=ce.GatheredIndexerLoss()),
        "sparse",
    ),  # fmt: skip
    "selection/sharded+loss/dense": (
        V4,
        dict(
            selection=ce.ShardedSelection(inner=ce.DenseSelection()),
            indexer_kl=ce.DenseIndexerLoss(),
        ),
        "dense",
    ),
    "kernels/mosaic+loss/auto": (V4, MOSAIC, "sparse"),
    "kernels/mosaic/v32": (V32, MOSAIC, "off"),
    "kernels/triton+loss/auto": (V4, TRITON, "dense"),
    "placement/heads+kernels/mosaic": (V4, dict(heads=ce.HeadParallel(), **MOSAIC), "off"),
}


def make_layer(config, execution):
    kind = ce.V32Attention if isinstance(config, ce.V32AttentionConfig) else ce.V4Attention
    return kind(config, key=jax.random.key(0), execution=execution)


def layer_of(name):
    """The member's layer, its selection tagged for the policy to save."""
    config, fields, stage = MEMBERS[name]
    return make_layer(config, ce.Execution(indexer_loss=stage, save_selection=True, **fields))


def stacked(layer):
    """Two layers' weights stacked (the second scaled, so that the layers differ)."""
    params, static = eqx.partition(layer, eqx.is_array)
    scale = lambda a: a * 0.75 if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
    return jax.tree.map(lambda a: jnp.stack([a, scale(a)]), params), static


def inputs(width):
    return jax.random.normal(jax.random.key(1), (B, S, width), jnp.float32)


def indexer_loss(aux):
    loss = aux["indexer_loss"]
    return jnp.zeros(()) if loss is None else jnp.mean(loss)


@functools.cache
def expected(v32: bool, stage: str):
    """The reference's loss and gradients for the config (``v32``: V3.2's, else V4's) and
    ``stage``: the automatic path, one device, untransformed, the members' weights (the same
    key). Computed once per pair in a process and shared by the members."""
    layer = make_layer(V32 if v32 else V4, ce.Execution(indexer_loss=stage))
    params, static = stacked(layer)
    x = inputs(layer.config.hidden_size)
    return jax.jit(jax.value_and_grad(reference), static_argnums=1)(params, static, x)


def reference(params, static, x):
    """The two layers one after the other on the whole batch, on one device."""
    h, total = x, jnp.zeros(())
    for i in range(2):
        layer = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)
        y, aux = layer(h, return_aux=True)
        h, total = h + y, total + indexer_loss(aux)
    return jnp.mean(h**2) + total


def composed(params, static, x):
    """The same loss and gradients through every transformation (the module docstring)."""

    def body(h, p):
        layer = eqx.combine(p, static)
        y, aux = jax.vmap(lambda seq: layer(seq, return_aux=True))(h)
        return h + y, indexer_loss(aux)

    step = jax.checkpoint(body, policy=compose_selection_policy(None))

    def loss(params, x):
        h, losses = jax.lax.scan(step, x, params)
        return jnp.mean(h**2) + jnp.sum(losses)

    def local(params, x):
        # the mean over devices inside the differentiated loss: under check_vma the gradient
        # of replicated weights is summed over the devices by JAX itself (docs/composing.md)
        return jax.value_and_grad(lambda p, x: jax.lax.pmean(loss(p, x), "data"))(params, x)

    return jax.shard_map(
        local,
        mesh=MESH,
        in_specs=(jax.P(), jax.P("data")),
        out_specs=jax.P(),
        axis_names={"data"},
    )(params, x)


def assert_gradients_close(grads, want_grads, msg=""):
    """Every gradient within 1e-5 of its reference's largest magnitude (in NumPy: no small
    programs compiled per leaf shape)."""
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        scale = float(np.max(np.abs(want))) or 1.0
        assert float(np.max(np.abs(got - want))) <= 1e-5 * scale, msg


# Known gaps (issue 53 left open; docs/composing.md, "Known gaps"): each fails today (a strict
# xfail with the reason); none at present
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN[n], strict=True)) if n in KNOWN else n
        for n in MEMBERS
    ],
)
def test_every_transformation_at_once(name):
    layer = layer_of(name)
    params, static = stacked(layer)
    x = inputs(layer.config.hidden_size)
    config, _, stage = MEMBERS[name]
    want_value, want_grads = expected(config is V32, stage)
    with jax.set_mesh(MESH):
        xs = jax.device_put(x, jax.P("data"))
        ps = jax.device_put(params, jax.P())
        program = jax.jit(composed, static_argnums=1, donate_argnums=(0, 2))
        with jax.enable_checks(True):
            traced = program.trace(ps, static, xs)
        assert not traced.jaxpr.effects
        value, grads = traced.lower().compile()(ps, xs)  # the checked trace, run
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    assert_gradients_close(grads, want_grads, name)


def test_the_v32_kernels_member_reads_resident_rows():
    """The V3.2 kernels member is the suite's case of rows copied from a table resident in
    VMEM (the automatic choice for its 24-entry table, V3.2's from 16k on a chip; V4's picks
    here are read as tiles): its kernels, forward and backward, read the gathered rows so,
    with the gradient table in VMEM. The plan of its layer's call, traced at the suite's
    sizes (nothing compiled)."""
    plans, plan = [], mosaic_plan.plan

    def spy(*args):
        plans.append(plan(*args))
        return plans[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mosaic_plan, "plan", spy)
        layer = layer_of("kernels/mosaic/v32")
        jax.eval_shape(layer, inputs(layer.config.hidden_size))
    assert plans
    for config in [c for p in plans for c in (p.static.config, p.static.backward)]:
        rows = [config.tables[s.table] for s in config.sources if isinstance(s, RowsRead)]
        assert rows and all(t.resident and not t.hbm_grads for t in rows), config


def test_the_tpu_interpreter_is_the_only_effectful_choice():
    """Pallas' TPU interpreter (simulated memories), asked for by name, is what carries IO
    effects: kept for kernel-alone tests, never chosen for a user."""

    def layer(interpret):
        execution = ce.Execution(selection=ce.MosaicSelection(interpret=interpret))
        return ce.V4Attention(V4, key=jax.random.key(0), execution=execution)

    x = inputs(48)
    assert not jax.make_jaxpr(layer(None))(x).effects
    assert jax.make_jaxpr(layer(pltpu.InterpretParams()))(x).effects


def pallas_calls(jaxpr, name: str) -> int:
    """``pallas_call``s of kernel ``name`` in ``jaxpr`` and every nested jaxpr."""
    from jaxpr_helpers import walk_eqns

    return sum(
        e.primitive.name == "pallas_call" and e.params.get("name") == name
        for e in walk_eqns(jaxpr.jaxpr)
    )


@pytest.mark.parametrize(
    "selection, kernel",
    [(ce.MosaicSelection(), "indexer_topk_mosaic"), (ce.TritonSelection(), "indexer_topk")],
    ids=["mosaic", "triton"],
)
def test_saved_selection_runs_no_kernel_in_the_backward(selection, kernel):
    """With the selection saved (``compose_selection_policy``), the gradient of a checkpointed
    layer runs the selection kernel as often as the forward does (the forward's calls), not
    again in the backward; without the policy the backward runs them again (``launch`` puts
    each kernel in a jit of its own: Pallas' DCE keeps any unused ``pallas_call``)."""
    execution = ce.Execution(selection=selection, save_selection=True)
    layer = ce.V4Attention(V4, key=jax.random.key(0), execution=execution)
    x = inputs(48)

    def loss(layer, x, policy):
        return jnp.sum(jax.checkpoint(lambda m, x: m(x), policy=policy)(layer, x) ** 2)

    forward = pallas_calls(jax.make_jaxpr(lambda m, x: loss(m, x, None))(layer, x), kernel)
    saved = jax.make_jaxpr(jax.grad(lambda m, x: loss(m, x, compose_selection_policy(None))))
    recomputed = jax.make_jaxpr(jax.grad(lambda m, x: loss(m, x, None)))
    assert forward >= 1
    assert pallas_calls(saved(layer, x), kernel) == forward
    assert pallas_calls(recomputed(layer, x), kernel) == 2 * forward


def kernels_loss(m, x):
    """The Mosaic kernels' member's loss, its forward ``(y, aux)`` the auxiliary output."""
    y, aux = m(x, return_aux=True)
    return jnp.mean(y**2) + aux["indexer_loss"], (y, aux)


@functools.cache
def kernels_on_one_device():
    """The Mosaic kernels' member, its inputs, and on one device (no mesh) its loss, every
    gradient and its forward's ``(y, aux)``: one interpreted compile (the gradient's forward
    is the batched call), shared by three tests."""
    layer = layer_of("kernels/mosaic+loss/auto")
    x = inputs(48)
    (value, forward), grads = jax.jit(jax.value_and_grad(kernels_loss, has_aux=True))(layer, x)
    return layer, x, value, grads, forward


# the Mosaic kernels' member's forward alone (no gradient), jitted
call = jax.jit(lambda m, x: m(x, return_aux=True))


def test_unbatched_layers_and_vmap_fold_into_the_kernel():
    """A layer takes one ``[S, hidden]`` sequence as ``eqx.nn`` layers do, and ``jax.vmap``
    of it over a batch equals the batched call; the attention kernels take the mapped axis in
    their own batch (one ``pallas_call`` of each, its batch the mapped size), not a loop of
    calls (the selection kernel, whose picks nothing differentiates, JAX maps itself)."""
    layer, x, _, _, (want, aux) = kernels_on_one_device()
    one, one_aux = call(layer, x[1])
    np.testing.assert_allclose(one, want[1], atol=1e-6)
    np.testing.assert_array_equal(one_aux["selection"], aux["selection"][1])
    mapped = jax.jit(jax.vmap(lambda s: layer(s))).trace(x)
    np.testing.assert_allclose(mapped.lower().compile()(x), want, atol=1e-6)
    from jaxpr_helpers import walk_eqns

    jaxpr = mapped.jaxpr.jaxpr
    calls = [e for e in walk_eqns(jaxpr) if e.params.get("name", "").startswith("mosaic_sparse")]
    assert calls and all(e.outvars[0].aval.shape[0] == B for e in calls)
    assert not any(
        e.primitive.name == "while" and "mosaic_sparse_attention" in str(e)
        for e in walk_eqns(jaxpr)
    )


def test_kernels_run_per_device_under_jit_sharding():
    """With the batch sharded by ``jit`` over two mesh axes (no placement, as data x FSDP
    training shards it), each kernel runs once per device, in a ``shard_map`` over both of the
    batch's axes, and the loss, every gradient, the output and the selection equal one
    device's."""
    from jaxpr_helpers import walk_eqns

    layer, x, want_value, want_grads, (want, want_aux) = kernels_on_one_device()
    with jax.set_mesh(jax.make_mesh((2, B // 2), ("data", "fsdp"))):
        xs = jax.device_put(x, jax.P(("data", "fsdp")))
        traced = jax.jit(jax.value_and_grad(kernels_loss, has_aux=True)).trace(layer, xs)
        jaxpr = traced.jaxpr
        (value, (y, aux)), grads = traced.lower().compile()(layer, xs)
    maps = [e for e in walk_eqns(jaxpr.jaxpr) if e.primitive.name == "shard_map"]
    # (under the check_vma shard_map, interpret mode binds a kernel as one primitive:
    # csa_eqx._compat.interpreted)
    kernels = [
        m
        for m in maps
        if any(k in str(m.params["jaxpr"]) for k in ("pallas_call", "csa_eqx_interpreted_kernel"))
    ]
    assert kernels and all(m.params["in_specs"][0] == jax.P(("data", "fsdp")) for m in kernels)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    assert_gradients_close(grads, want_grads)
    np.testing.assert_allclose(y, want, atol=1e-6)
    np.testing.assert_array_equal(aux["selection"], want_aux["selection"])


@pytest.mark.parametrize(
    "devices, context, batch",
    [(1, True, None), (2, True, None), (2, False, None), (2, False, "data")],
    ids=["1-set_mesh-replicated", "2-set_mesh-replicated", "2-replicated", "2-sharded"],
)
def test_kernels_run_on_a_mesh_the_batch_is_typed_over(devices, context, batch):
    """Arrays put on a ``jax.make_mesh`` mesh (``Explicit`` axes) and jitted, with
    ``jax.set_mesh`` or without it (their types carry the mesh), the batch replicated or
    sharded over ``data``: the kernels run per device (a ``shard_map`` over the batch's axes
    and a one-device mesh's axis; a replicated batch whole on each device), the library's own
    buffers and the kernels' outputs typed over the inputs' mesh; the output and selection
    (in row chunks of 8 queries: a loop whose carry the layer builds from constants) equal
    one device's. Before, each failed (a buffer without the mesh updated by a row with it, or
    the reverse; a kernel ref sliced along a sharded axis)."""
    layer, x, _, _, (want, want_aux) = kernels_on_one_device()
    # the selection in row chunks of 8 queries (picks bitwise the one call's): the chunks'
    # loop carries a buffer the layer builds from constants
    selection = ce.MosaicSelection(query_block=8, query_chunk=8)
    chunked = dataclasses.replace(layer.execution, selection=selection)
    mesh = jax.make_mesh((devices,), ("data",))
    on_mesh = jax.device_put(layer.with_execution(chunked), jax.NamedSharding(mesh, jax.P()))
    xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P(batch)))
    with jax.set_mesh(mesh) if context else contextlib.nullcontext():
        got, aux = call(on_mesh, xs)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_array_equal(aux["selection"], want_aux["selection"])


def test_kernels_run_on_a_one_device_mesh():
    """A batch sharded over an ``Explicit`` mesh axis of size 1 (one chip, code written for
    many) is still typed sharded, which a kernel's reshapes and refs refuse: the kernels run
    in a ``shard_map`` over it (the chip's jit-sharding benchmark failed so), and the output
    and selection equal the call without a mesh."""
    layer, x, _, _, (want, want_aux) = kernels_on_one_device()
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        got, aux = call(layer, jax.device_put(x, jax.P("data")))
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_array_equal(aux["selection"], want_aux["selection"])
