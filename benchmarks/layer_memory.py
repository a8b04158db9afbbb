"""Compiled XLA temp memory of one V4 CSA layer fwd+bwd: csa_eqx vs a naive dense baseline.

Compile only (``memory_analysis``), nothing runs, so any sequence length fits on a laptop.
Layer: indexer 64 heads x 128, top-k 512, m = 4, small main dims (hidden 256, 4 heads x 64),
float32, batch 1. ``python -m benchmarks.layer_memory [--seqs 4096 8192 ...]`` prints a
markdown table.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from csa_eqx import Execution, V4Attention, V4AttentionConfig

from .naive_baseline import naive_v4_csa

GIB = 1 << 30
CONFIG = V4AttentionConfig(
    hidden_size=256,
    num_heads=4,
    head_dim=64,
    rope_dim=64,
    q_lora_rank=256,
    o_groups=2,
    o_lora_rank=128,
    sliding_window=128,
    compress_rate=4,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
)


VARIANTS = {
    "csa_eqx": lambda m, x: m(x),
    "csa_eqx qk_head_chunk_size=8": lambda m, x: m(x),
    "naive dense-mask": naive_v4_csa,
}


def fwd_bwd_temp_bytes(
    config: V4AttentionConfig, forward, seq: int, execution: Execution | None = None
) -> tuple[int, float]:
    """Temp bytes of ``grad(sum(forward(layer, x)))`` w.r.t. parameters and ``x``, and the
    seconds the compile took (the layer runs as ``execution`` says; default automatic)."""
    abstract = eqx.filter_eval_shape(
        V4Attention, config, key=jax.random.key(0), execution=execution
    )
    is_leaf = lambda v: isinstance(v, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(abstract, is_leaf, is_leaf=is_leaf)

    def step(params, x):
        loss = lambda p, x: jnp.sum(forward(eqx.combine(p, static), x))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(params, x)

    x = jax.ShapeDtypeStruct((1, seq, config.hidden_size), jnp.float32)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    executions = {"csa_eqx qk_head_chunk_size=8": Execution(qk_head_chunk_size=8)}
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| S | " + " | ".join(f"{v} (GiB)" for v in args.variants) + " |")
    print("|---" * (len(args.variants) + 1) + "|")
    previous: dict[str, int] = {}
    for seq in args.seqs:
        cells = []
        for name in args.variants:
            temp, secs = fwd_bwd_temp_bytes(CONFIG, VARIANTS[name], seq, executions.get(name))
            cell = f"{temp / GIB:.3f}"
            if name in previous:
                cell += f" (x{temp / previous[name]:.2f})"
            previous[name] = temp
            cells.append(cell + f" [{secs:.0f}s]")
        print(f"| {seq} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
