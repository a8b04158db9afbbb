"""Execution(save_selection=True): the saved selection removes the top-k recompute from the
backward."""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import name_p
from jax._src.lax.lax import dot_general_p

import csa_eqx
from csa_eqx.presets import tiny_v4, tiny_v32
from csa_eqx.remat import SELECTION_NAME, compose_selection_policy

B, S, K = 2, 24, 3


def config():
    return tiny_v4(
        "csa", hidden_size=48, q_lora_rank=24, sliding_window=6, index_n_heads=8, index_topk=K
    )


def remat_layer(key=None, **options):
    """The test layer, run as the loaders' execution keyword ``options`` say."""
    execution = csa_eqx.Execution.from_options(**options)
    key = jax.random.key(0) if key is None else key
    return csa_eqx.V4Attention(config(), key=key, execution=execution)


# Each exact top-k (csa_eqx._topk.exact_topk, a radix select) starts with one float ->
# uint32 bitcast of its scores; nothing else in the layers bitcasts: count those.
TOPK = "bitcast_convert_type"


def count_prim(jaxpr, name: str) -> int:
    """Occurrences of primitive ``name`` in ``jaxpr`` and every nested jaxpr (scan, checkpoint,
    shard_map, pjit, custom_jvp ...)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    n += count_prim(sub, name)
    return n


def inputs():
    x = jax.random.normal(jax.random.key(1), (B, S, 48))
    seg = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], B, 0), jnp.int32)
    return x, seg


def checkpointed_loss(wrap):
    def loss(layer, x, seg):
        return jnp.sum(wrap(lambda m, x, s: m(x, segment_ids=s))(layer, x, seg) ** 2)

    return loss


JAX_CKPT = lambda f: jax.checkpoint(f, policy=compose_selection_policy(None))  # noqa: E731
EQX_CKPT = lambda f: eqx.filter_checkpoint(f, policy=compose_selection_policy(None))  # noqa: E731


@pytest.mark.parametrize("wrap", [JAX_CKPT, EQX_CKPT], ids=["jax.checkpoint", "eqx"])
def test_saved_selection_is_not_recomputed(wrap):
    x, seg = inputs()
    loss = checkpointed_loss(wrap)
    grads, counts = {}, {}
    for save in (False, True):
        layer = remat_layer(indexer_save_selection=save)
        forward = count_prim(jax.make_jaxpr(loss)(layer, x, seg), TOPK)
        counts[save] = count_prim(jax.make_jaxpr(jax.grad(loss))(layer, x, seg), TOPK)
        if wrap is JAX_CKPT:  # one compile pair is enough for the bitwise check
            grads[save] = jax.jit(jax.grad(loss))(layer, x, seg)
    assert forward == 1
    assert counts[False] == 2 * forward  # full remat recomputes the indexer chain
    assert counts[True] == forward
    if grads:
        for a, b in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_residuals_show_the_selection():
    x, seg = inputs()
    loss = checkpointed_loss(JAX_CKPT)
    for save in (False, True):
        layer = remat_layer(indexer_save_selection=save)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            jax.ad_checkpoint.print_saved_residuals(loss, layer, x, seg)
        saved = [ln.split(" from ")[0] for ln in buf.getvalue().splitlines() if " named " in ln]
        assert saved == ([f"i32[{B},{S},{K}] named '{SELECTION_NAME}'"] if save else [])


def test_scanned_layers():
    """A ``lax.scan`` over stacked, checkpointed layers: one exact top-k in the scan body, none
    recomputed in the backward scan when the selection is saved."""
    x, seg = inputs()
    keys = jax.random.split(jax.random.key(0), 2)
    counts = {}
    for save in (False, True):
        make = lambda k, save=save: remat_layer(k, indexer_save_selection=save)  # noqa: E731
        params, static = eqx.partition(eqx.filter_vmap(make)(keys), eqx.is_array)

        def body(h, p, static=static):
            return eqx.combine(p, static)(h, segment_ids=seg), None

        def loss(params, x, body=body):
            ckpt = jax.checkpoint(body, policy=compose_selection_policy(None))
            return jnp.sum(jax.lax.scan(ckpt, x, params)[0] ** 2)

        assert count_prim(jax.make_jaxpr(loss)(params, x), TOPK) == 1
        counts[save] = count_prim(jax.make_jaxpr(jax.grad(loss))(params, x), TOPK)
    assert counts == {False: 2, True: 1}


def test_sharded_topk_saved_under_remat():
    """The saved selection also covers the shard_map'ed top-k (counted inside shard_map)."""
    x, seg = inputs()
    loss = checkpointed_loss(JAX_CKPT)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    counts = {}
    with jax.set_mesh(mesh):
        for save in (False, True):
            layer = remat_layer(indexer_save_selection=save, indexer_sharded_topk=True)
            counts[save] = count_prim(jax.make_jaxpr(jax.grad(loss))(layer, x, seg), TOPK)
            assert count_prim(jax.make_jaxpr(loss)(layer, x, seg), "shard_map") == 1
    assert counts == {False: 2, True: 1}


class FakeVar:
    """Stands in for a traced operand: policies only look at primitives and params."""

    shape = (2, 3)


def test_composition_keeps_other_decisions():
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["kept"],
        names_which_can_be_offloaded=["moved"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    base_policies = [
        jax.checkpoint_policies.save_only_these_names("other"),
        offload,
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.nothing_saveable,
    ]
    probes = [(name_p, {"name": n}) for n in ("other", "kept", "moved", "unnamed")]
    probes.append((dot_general_p, {"dimension_numbers": (((1,), (0,)), ((), ()))}))
    for base in base_policies:
        composed = compose_selection_policy(base)
        for prim, params in probes:
            assert composed(prim, FakeVar(), **params) == base(prim, FakeVar(), **params), (
                base,
                prim,
                params,
            )
        assert composed(name_p, FakeVar(), name=SELECTION_NAME) is True
    none = compose_selection_policy(None)
    assert none(name_p, FakeVar(), name=SELECTION_NAME) is True
    assert none(name_p, FakeVar(), name="other") is False
    assert none(dot_general_p, FakeVar(), dimension_numbers=(((1,), (0,)), ((), ()))) is False
    # a wrapped policy that offloads the selection keeps offloading it
    offload_sel = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[SELECTION_NAME],
        offload_src="device",
        offload_dst="pinned_host",
    )
    decision = compose_selection_policy(offload_sel)(name_p, FakeVar(), name=SELECTION_NAME)
    assert decision == jax.ad_checkpoint.Offloadable(src="device", dst="pinned_host")
    assert compose_selection_policy(None) == compose_selection_policy(None)


def test_composition_in_saved_residuals():
    """End to end: with save_only_these_names("other") composed, both the selection and the
    value named "other" are saved, nothing else from inside the checkpoint."""
    x, seg = inputs()
    layer = remat_layer(indexer_save_selection=True)
    policy = compose_selection_policy(jax.checkpoint_policies.save_only_these_names("other"))

    def loss(layer, x):
        def f(m, x):
            h = jax.ad_checkpoint.checkpoint_name(jnp.sin(x), "other")
            return m(h, segment_ids=seg) * jnp.cos(x)

        return jnp.sum(jax.checkpoint(f, policy=policy)(layer, x))

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(loss, layer, x)
    lines = [ln for ln in buf.getvalue().splitlines() if " named " in ln or " output of " in ln]
    assert sorted(ln.split(" from ")[0] for ln in lines) == sorted(
        [f"f32[{B},{S},48] named 'other'", f"i32[{B},{S},{K}] named '{SELECTION_NAME}'"]
    )


def test_v32_saved_selection_is_not_recomputed():
    from csa_eqx import V32Attention

    config = tiny_v32(index_topk=3)
    x = jax.random.normal(jax.random.key(1), (B, 12, config.hidden_size))
    seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 7], B, 0), jnp.int32)
    loss = checkpointed_loss(JAX_CKPT)
    counts = {}
    for save in (False, True):
        execution = csa_eqx.Execution(save_selection=save)
        layer = V32Attention(config, key=jax.random.key(0), execution=execution)
        assert count_prim(jax.make_jaxpr(loss)(layer, x, seg), TOPK) == 1
        counts[save] = count_prim(jax.make_jaxpr(jax.grad(loss))(layer, x, seg), TOPK)
    assert counts == {False: 2, True: 1}


def test_v41_stack_saves_one_selection_per_index_source():
    """A V4.1 stack under one ``jax.checkpoint`` (docs/v41.md; the memory guard's, 0 a ratio-2
    source, 1 reuse, 2 the candidate source, 3 its consumer, with 2 blocks of 4 kept of 6):
    each index source computes its selection once and saves it, the backward recomputes none
    of them (nor the candidates, which only the consumer's selection needs), and the reuse
    layer computes none at all, with the indexer losses on (the sparse stage: the attention of
    ``"off"``, plus the loss over the saved selection). Streaming with small tiles: merged row
    buffers, the candidate source's blocks from the same buffers, the consumer's gathered
    candidates."""
    import dataclasses

    from test_memory_guard import V41_STACK

    CONFIG = dataclasses.replace(V41_STACK, candidate_topk_blocks=2)

    x = jax.random.normal(jax.random.key(1), (B, S, CONFIG.hidden_size))
    keys = jax.random.split(jax.random.key(0), CONFIG.num_layers)
    counts = {}
    for save in (False, True):
        selection = csa_eqx.StreamingSelection(key_block=4, topk_block=8)
        execution = csa_eqx.Execution(
            selection=selection, save_selection=save, indexer_loss="sparse"
        )
        layers = tuple(
            csa_eqx.V41Attention(CONFIG, i, key=k, execution=execution) for i, k in enumerate(keys)
        )

        def stack(layers, x):
            ys, _, auxes = csa_eqx.run_v41_stack(layers, x, return_aux=True)
            losses = [a["indexer_loss"] for a in auxes if a["indexer_loss"] is not None]
            return sum(jnp.sum(y**2) for y in ys) + sum(losses)

        loss = JAX_CKPT(stack)
        forward = count_prim(jax.make_jaxpr(loss)(layers, x), TOPK)
        counts[save] = (forward, count_prim(jax.make_jaxpr(jax.grad(loss))(layers, x), TOPK))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            jax.ad_checkpoint.print_saved_residuals(loss, layers, x)
        saved = [ln.split(" from ")[0] for ln in buf.getvalue().splitlines() if " named " in ln]
        k = CONFIG.index_topk
        assert saved == ([f"i32[{B},{S},{k}] named '{SELECTION_NAME}'"] * 3 if save else [])
    # per layer, on what the earlier ones publish (shapes only)
    _, published = jax.eval_shape(csa_eqx.run_v41_stack, layers, x)
    per_layer = [
        count_prim(
            jax.make_jaxpr(lambda x, s, m=m: m(x, shared=s))(x, published[i - 1] if i else None),
            TOPK,
        )
        for i, m in enumerate(layers)
    ]
    assert [i for i, n in enumerate(per_layer) if n] == [0, 2, 3]  # reuse: none
    assert sum(per_layer) == counts[True][0] == counts[False][0]
    assert counts[True][1] == counts[True][0]  # nothing recomputed
    assert counts[False][1] == 2 * counts[False][0]  # full remat recomputes every selection
