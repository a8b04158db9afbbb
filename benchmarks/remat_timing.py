"""Checkpointed fwd+bwd of one V4 CSA layer with the indexer selection saved vs recomputed.

Both variants run under ``jax.checkpoint(policy=compose_selection_policy(None))`` (full remat
apart from the selection); ``Execution(save_selection=...)`` decides whether the backward pass
recomputes the indexer chain (scores + top-k). Timings interleave the two variants in the same
process; the ratio is recomputed / saved (> 1: saving helps). Layer: ``harness.small_v4`` with
hidden 512, window 64 and an indexer of 16 heads x 64.

    python -m benchmarks.remat_timing [--seq 2048] [--reps 15]
"""

import argparse

import jax
import jax.numpy as jnp

import csa_eqx
from csa_eqx.remat import compose_selection_policy

from . import harness

HIDDEN = 512
VARIANTS = {"selection recomputed": False, "selection saved": True}


def timed_layer(save: bool, k: int) -> csa_eqx.V4Attention:
    """The measured CSA layer, top-k ``k``, with the selection saved for the backward or not."""
    config = harness.small_v4(
        "csa",
        hidden_size=HIDDEN,
        sliding_window=64,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=k,
    )
    execution = csa_eqx.Execution(save_selection=save)
    return csa_eqx.V4Attention(config, key=jax.random.key(0), execution=execution)


def step_fn():
    """Jitted gradient of ``mean(checkpointed layer(x)^2)`` w.r.t. the layer and ``x``."""
    policy = compose_selection_policy(None)

    def loss(layer, x):
        return jnp.mean(jax.checkpoint(lambda m, x: m(x), policy=policy)(layer, x) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def measure(seq: int, topk: int, reps: int, batch: int = 1) -> dict[str, list[float]]:
    """Seconds per fwd+bwd of each variant (``VARIANTS``), ``reps`` interleaved rounds."""
    x = jax.random.normal(jax.random.key(1), (batch, seq, HIDDEN))
    runs = {
        label: harness.blocking(step_fn(), timed_layer(save, topk), x)
        for label, save in VARIANTS.items()
    }
    return harness.interleaved(runs, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    times = measure(a.seq, a.topk, a.reps, a.batch)
    print(harness.machine_markdown(harness.machine_info()))
    print(f"\nB={a.batch} S={a.seq} k={a.topk} reps={a.reps} (seconds per fwd+bwd)\n")
    stats = {label: harness.summary(t) for label, t in times.items()}
    rows = [[label, f"{s['median']:.4f}", f"{s['min']:.4f}"] for label, s in stats.items()]
    print(harness.table(["variant", "median (s)", "min (s)"], rows))
    rec, sav = stats["selection recomputed"], stats["selection saved"]
    for n in ("median", "min"):
        print(f"ratio recomputed/saved ({n}): {rec[n] / sav[n]:.3f}x")


if __name__ == "__main__":
    main()
