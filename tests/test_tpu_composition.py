"""On a TPU (skipped elsewhere): the layer composes with JAX's transformations on the automatic
path, the compiled Mosaic kernels (issue 53; docs/composing.md), at hidden sizes. Run on the
chip as::

    JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_composition.py

The uses are ``benchmarks.composition``'s table (a V4-Flash CSA layer, bf16, S = 2048:
``jax.checkpoint`` with ``compose_selection_policy`` and ``grad``, ``lax.scan`` over a stack
with and without a checkpointed body, ``vmap``, a ``shard_map`` with ``check_vma`` forward and
backward, ``grad`` under ``jit`` with the batch sharded over a mesh), then the docs' remat
recipe on the kernels (no effect, finite gradients).
"""

import jax
import jax.numpy as jnp
import pytest

import csa_eqx as ce
from benchmarks.composition import _uses, layer_of
from csa_eqx.remat import compose_selection_policy

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "tpu",
    reason="needs a TPU: JAX_PLATFORMS=tpu,cpu python -m pytest -q tests/test_tpu_composition.py",
)


@pytest.mark.parametrize("kind", ["v4"])
def test_every_use_works_on_the_kernels(kind):
    uses = _uses(ce.Execution(), quick=False, seq=2048)
    assert all(result == "works" for result in uses.values()), uses


def test_the_docs_remat_recipe_runs_on_the_kernels():
    layer = layer_of("v4", ce.Execution(), quick=False)
    x = jax.random.normal(jax.random.key(1), (1, 2048, layer.config.hidden_size), jnp.bfloat16)
    policy = compose_selection_policy(None)

    def loss(m, x):
        y = jax.checkpoint(lambda m, x: m(x), policy=policy)(m, x)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(layer, x)
    assert not jaxpr.effects
    grads = jax.jit(jax.grad(loss))(layer, x)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
