"""The battery of ``tests/test_codegen.py``: a tiny V4 CSA layer (the sliding window, the
compressor, the indexer's top-k and the sparse attention: output, selection, the gradients of
every parameter and of x) and the row-sharded top-k on 8 devices against the unsharded one, on
exact ties. Run as a script, it writes the results to the ``.npz`` file named by its
argument."""

import sys

import numpy as np

CHILD_DEVICES = 8


def layer_results(name, layer, s, out):
    """Forward (output, selection) and the gradient of ``sum(sin(y))`` w.r.t. x and every
    parameter, into ``out`` under ``name``."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(2, s, layer.config.hidden_size)), jnp.float32)
    seg = np.zeros((2, s), np.int32)
    seg[0, s // 3 :] = 1
    seg = jnp.asarray(seg)

    @eqx.filter_jit
    def run(layer, x):
        def loss(layer, x):
            y, aux = layer(x, segment_ids=seg, return_aux=True)
            return jnp.sum(jnp.sin(y)), (y, aux["selection"])

        grads, (y, selection) = jax.grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
        return y, selection, grads

    y, selection, grads = run(layer, x)
    out[f"{name}/y"] = np.asarray(y)
    if selection is not None:
        out[f"{name}/selection"] = np.asarray(selection)
    for i, g in enumerate(jax.tree.leaves(grads)):
        out[f"{name}/grad{i}"] = np.asarray(g)


def results() -> dict[str, np.ndarray]:
    """Every array of the battery, by name."""
    import jax
    from multiprocess_worker import K
    from selection_helpers import selected, sharded_selected
    from test_sharding import random_inputs
    from test_v4_behaviour import randomise

    import csa_eqx as ce
    from csa_eqx.presets import tiny_v4

    out = {}
    layer = ce.V4Attention(tiny_v4("csa"), key=jax.random.key(0))
    layer_results("csa", randomise(layer, 2), 29, out)
    args = random_inputs(2, 13, True, True)  # small integers: many exact score ties
    out["topk/unsharded"] = np.asarray(jax.jit(lambda *a: selected(*a, k=K))(*args))
    with jax.set_mesh(jax.make_mesh((CHILD_DEVICES,), ("tensor",))):
        out["topk/sharded"] = np.asarray(jax.jit(lambda *a: sharded_selected(*a, k=K))(*args))
    return out


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", CHILD_DEVICES)
    np.savez(sys.argv[1], **results())
