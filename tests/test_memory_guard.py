"""Whole-layer memory guard: forward + backward never forms a [B, S, T]-sized array.

The jaxpr of the gradient of ``sum(y) + indexer_loss`` (KL loss on, both stages) with respect
to the parameters and the input is traced on abstract inputs at S = 8192 (no compute), and
every value in it, nested jaxprs included (pjit, scan, while, cond, custom_vjp, checkpoint,
shard_map), must hold fewer than ``B·S·T/8`` elements of any dtype: ``T = S/m`` compressed
entries for V4 CSA, ``T = S`` tokens for V3.2. Head counts are small so that the largest
legitimate per-token tensors ([B, S, H, d]) stay below that bound. The batch is 64 so that the
automatic tiles, whose size is a fixed budget (at most 2^24 elements on CPU, 2^26 on
accelerators) independent of S and T, stay below it too, while any tensor proportional to
B·S·T is 8 times above it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_v41_config import SIZES

from csa_eqx import (
    Execution,
    V4Attention,
    V32Attention,
    V41Attention,
    V41AttentionConfig,
    run_v41_stack,
)
from csa_eqx.presets import tiny_v4, tiny_v32

B, S = 64, 8192


def layer_for(version: str, stage: str):
    """A small-headed layer with the KL loss in ``stage`` (the one place that knows how the
    training stage is chosen)."""
    execution = Execution(indexer_loss=stage)
    if version == "v4":
        config = tiny_v4("csa", num_heads=2, o_groups=1, head_dim=64)
        layer = V4Attention(config, key=jax.random.key(0), execution=execution)
        return layer, S // config.compress_rate
    layer = V32Attention(tiny_v32(num_heads=2), key=jax.random.key(0), execution=execution)
    return layer, S


def sub_jaxprs(value):
    """Jaxprs held by one equation parameter (a jaxpr, a closed jaxpr, or a tuple of them)."""
    for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, jax.extend.core.ClosedJaxpr):
            yield item.jaxpr
        elif isinstance(item, jax.extend.core.Jaxpr):
            yield item


def largest_values(jaxpr, found=None, depth=0):
    """(elements, shape, dtype, primitive) of every value, nested jaxprs included."""
    found = [] if found is None else found
    for v in (*jaxpr.invars, *jaxpr.constvars):
        found.append((int(np.prod(v.aval.shape)), v.aval.shape, v.aval.dtype, "input"))
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            found.append(
                (int(np.prod(shape)), shape, getattr(v.aval, "dtype", None), str(eqn.primitive))
            )
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                largest_values(sub, found, depth + 1)
    return found


def nested_primitives(jaxpr, seen=None):
    seen = set() if seen is None else seen
    for eqn in jaxpr.eqns:
        seen.add(str(eqn.primitive))
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                nested_primitives(sub, seen)
    return seen


def assert_no_value_reaches(objective, model, hidden: int, bound: int) -> None:
    """No value of ``jax.grad(objective)``'s jaxpr (nested ones included) over ``model``'s
    float arrays and an ``[B, S, hidden]`` input has ``bound`` elements or more."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = jax.ShapeDtypeStruct((B, S, hidden), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(objective, argnums=(0, 2)), static_argnums=1)(
        params, static, x
    ).jaxpr
    values = largest_values(jaxpr)
    assert len(values) > 100 and "while" in nested_primitives(jaxpr)  # the walk went deep
    too_big = sorted(
        {(n, str(shape), str(dtype), p) for n, shape, dtype, p in values if n >= bound}
    )
    assert not too_big, f"values with >= B*S*T/8 = {bound} elements: {too_big[-5:]}"


# V3.2's KL loss streams over the same SelectionProblem as V4's (it scored every token against
# every token, [B, S, H, S], before the redesign).
CASES = [("v4", "dense"), ("v4", "sparse"), ("v32", "off"), ("v32", "dense"), ("v32", "sparse")]


@pytest.mark.parametrize("version, stage", CASES)
def test_fwd_bwd_never_forms_bst(version, stage):
    layer, t = layer_for(version, stage)
    bound = B * S * t // 8

    def objective(params, static, x):
        y, aux = eqx.combine(params, static)(x, return_aux=True)
        return jnp.sum(y) + (0.0 if stage == "off" else aux["indexer_loss"])

    assert_no_value_reaches(objective, layer, layer.config.hidden_size, bound)


# A V4.1 stack (docs/v41.md) with every role that scores: a ratio-2 KV source, a reuse layer, the
# ratio-1 candidate source and a reindex consumer, whose filter bites (T / bc = 2048 blocks,
# Nb = 16). The bound takes the smallest T (the ratio-2 layer's S/2); the ratio-1 layers'
# [B, S, T] is twice as large again.
V41_STACK = V41AttentionConfig(
    compress_ratios=(2, 2, 1, 1),
    kv_source_layers=(0, 2),
    index_source_layers=(0, 2, 3),
    candidate_source_layer=2,
    candidate_topk_blocks=16,
    candidate_block_size=4,
    **SIZES,
)


@pytest.mark.parametrize("stage", ["dense", "sparse"])  # "sparse" attends as "off" does
def test_v41_stack_fwd_bwd_never_forms_bst(stage):
    """With the indexer loss of the three index sources on: the consumer's warm-up distils
    over its gathered candidates, the sources' over streamed key tiles."""
    keys = jax.random.split(jax.random.key(0), V41_STACK.num_layers)
    execution = Execution(indexer_loss=stage)
    layers = tuple(
        V41Attention(V41_STACK, i, key=k, execution=execution) for i, k in enumerate(keys)
    )
    assert [V41_STACK.role(i) for i in range(4)] == ["full", "reuse", "full", "reindex"]
    bound = B * S * (S // 2) // 8

    def objective(params, static, x):
        ys, _, auxes = run_v41_stack(eqx.combine(params, static), x, return_aux=True)
        losses = [a["indexer_loss"] for a in auxes if a["indexer_loss"] is not None]
        assert len(losses) == 3
        return sum(jnp.sum(y) for y in ys) + sum(losses)

    assert_no_value_reaches(objective, layers, V41_STACK.hidden_size, bound)


def test_guard_sees_a_materialised_score_matrix():
    """The walk finds a [B, S, T] array hidden in a scan inside a checkpoint (so a passing
    guard is not vacuous)."""
    t = 2048

    def f(q, k):
        def body(c, qi):  # half of the query rows: [B, S/2, T] scores
            scores = jax.checkpoint(lambda a: jnp.einsum("bsd,td->bst", a, k))(qi)
            return c + jnp.sum(scores), None

        return jax.lax.scan(body, 0.0, q)[0]

    q = jax.ShapeDtypeStruct((2, B, S // 2, 4), jnp.float32)
    k = jax.ShapeDtypeStruct((t, 4), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(f))(q, k).jaxpr
    assert max(n for n, *_ in largest_values(jaxpr)) >= B * S * t // 8
