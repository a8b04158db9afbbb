"""Checkpointed fwd+bwd of one V4 CSA layer with the indexer selection saved vs recomputed.

Both variants run under ``jax.checkpoint(policy=compose_selection_policy(None))`` (full remat
apart from the selection); ``Execution(save_selection=...)`` decides whether the backward pass
recomputes the indexer chain (scores + top-k). Timings interleave the two variants in the same
process; the ratio is recomputed / saved (> 1: saving helps).

    python -m benchmarks.remat_timing [--seq 2048] [--reps 15]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import csa_eqx
from csa_eqx.remat import compose_selection_policy


def timed_layer(save: bool, k: int) -> csa_eqx.V4Attention:
    """The timed layer; ``save``: the selection is tagged for the remat policy to save."""
    config = csa_eqx.V4AttentionConfig(
        hidden_size=512,
        num_heads=8,
        head_dim=64,
        rope_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=64,
        compress_rate=4,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=k,
    )
    execution = csa_eqx.Execution(save_selection=save)
    return csa_eqx.V4Attention(config, key=jax.random.key(0), execution=execution)


def step_fn():
    policy = compose_selection_policy(None)

    def loss(layer, x):
        return jnp.mean(jax.checkpoint(lambda m, x: m(x), policy=policy)(layer, x) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    x = jax.random.normal(jax.random.key(1), (a.batch, a.seq, 512))
    runs = {}
    for save in (False, True):
        layer = timed_layer(save, a.topk)
        step = step_fn()
        jax.block_until_ready(step(layer, x))  # compile + warm up
        runs[save] = (step, layer, [])
    for _ in range(a.reps):
        for step, layer, times in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(step(layer, x))
            times.append(time.perf_counter() - t0)
    print(
        f"backend={jax.default_backend()} devices={jax.device_count()} B={a.batch} S={a.seq} "
        f"k={a.topk} reps={a.reps} (seconds per fwd+bwd)"
    )
    stats = {"median": statistics.median, "min": min}
    for label, save in (("selection recomputed", False), ("selection saved", True)):
        times = runs[save][2]
        print(f"{label:22s} " + "  ".join(f"{n} {f(times):.4f}" for n, f in stats.items()))
    for n, f in stats.items():
        print(f"ratio recomputed/saved ({n}): {f(runs[False][2]) / f(runs[True][2]):.3f}x")


if __name__ == "__main__":
    main()
