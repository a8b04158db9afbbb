"""The placements inside a user's ``shard_map`` (issue 53; docs/composing.md, "Data parallel
with ``shard_map``"): ``HeadParallel`` and ``ContextParallel`` nested in a ``check_vma=True``
``shard_map`` over ``data``, the layer differentiated under a ``jax.checkpoint`` whose policy
saves the (tagged) selection. JAX types a nested ``shard_map``'s residuals with the enclosing
one's manual axes too, which it cannot lower; the placements' ``shard_map`` leaves no residual
there (``csa_eqx._mesh.run_sharded``). The loss and every gradient equal one device's.
``ContextParallel`` also with ``vmap`` of unbatched calls between the two ``shard_map``s;
``HeadParallel`` so, with the kernels: tests/test_conformance_transforms.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import csa_eqx as ce
from csa_eqx.presets import tiny_v4
from csa_eqx.remat import compose_selection_policy

CONFIG = tiny_v4(
    "csa", hidden_size=48, q_lora_rank=24, sliding_window=6, index_n_heads=8, index_topk=3,
    o_groups=4,
)  # fmt: skip


def loss(layer, x, vmap=False):
    call = (lambda m, x: jax.vmap(m)(x)) if vmap else (lambda m, x: m(x))
    step = jax.checkpoint(call, policy=compose_selection_policy(None))
    return jnp.mean(step(layer, x) ** 2)


@pytest.mark.parametrize(
    "axis, placement, vmap",
    [
        ("tensor", dict(heads=ce.HeadParallel()), False),
        ("context", dict(context=ce.ContextParallel()), False),
        ("context", dict(context=ce.ContextParallel()), True),  # unbatched calls, vmapped
    ],
    ids=["heads", "context", "context-vmap"],
)
def test_placement_inside_a_user_shard_map(axis, placement, vmap):
    mesh = jax.make_mesh((2, 4), ("data", axis), axis_types=(AxisType.Explicit,) * 2)
    execution = ce.Execution(save_selection=True, **placement)
    layer = ce.V4Attention(CONFIG, key=jax.random.key(0), execution=execution)
    alone = ce.V4Attention(CONFIG, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 24, CONFIG.hidden_size))
    want_value, want_grads = jax.jit(jax.value_and_grad(loss))(alone, x)

    def local(layer, x):
        return jax.value_and_grad(lambda m, x: jax.lax.pmean(loss(m, x, vmap), "data"))(layer, x)

    def program(layer, x):
        specs = (jax.P(), jax.P("data"))
        manual = {"data"}  # the placement's axis left to it
        return jax.shard_map(
            local, mesh=mesh, in_specs=specs, out_specs=jax.P(), axis_names=manual
        )(layer, x)

    with jax.set_mesh(mesh):
        value, grads = jax.jit(program)(layer, jax.device_put(x, jax.P("data")))
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.max(jnp.abs(want))) or 1.0
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * scale
