"""Compiled XLA temp memory of one V4 CSA layer fwd+bwd: csa_eqx vs a naive dense baseline.

Compile only (``memory_analysis``), nothing runs, so any sequence length fits on a laptop.
Layer: indexer 64 heads x 128, top-k 512, m = 4, small main dims (hidden 256, 4 heads x 64),
float32, batch 1. ``python -m benchmarks.layer_memory [--seqs 4096 8192 ...]`` prints a
markdown table.
"""

from __future__ import annotations

import argparse
import time

import jax

from csa_eqx import Execution, V4AttentionConfig

from . import harness
from .harness import forward
from .naive_baseline import naive_v4_csa

CONFIG = harness.speed_layer()
VARIANTS = {
    "csa_eqx": (CONFIG, forward),
    "csa_eqx qk_head_chunk_size=8": (CONFIG, forward, Execution(qk_head_chunk_size=8)),
    "naive dense-mask": (CONFIG, naive_v4_csa),
}


def fwd_bwd_temp_bytes(
    config: V4AttentionConfig, forward, seq: int, execution: Execution | None = None
) -> tuple[int, float]:
    """Temp bytes of ``grad(sum(forward(layer, x)))`` w.r.t. the layer's arrays and ``x``
    (float32, B = 1; compiled for shapes only; the layer runs as ``execution`` says, default
    automatic), and the seconds the compile took."""
    layer, x = harness.layer_shapes(config, seq, execution)
    start = time.perf_counter()
    temp = harness.temp_bytes(harness.fwd_bwd(forward), layer, x)
    return temp, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| S | " + " | ".join(f"{v} (GiB)" for v in args.variants) + " |")
    print("|---" * (len(args.variants) + 1) + "|")
    previous: dict[str, int] = {}
    for seq in args.seqs:
        cells = []
        for name in args.variants:
            config, forward, *execution = VARIANTS[name]
            temp, secs = fwd_bwd_temp_bytes(config, forward, seq, *execution)
            cell = f"{temp / harness.GIB:.3f}"
            if name in previous:
                cell += f" (x{temp / previous[name]:.2f})"
            previous[name] = temp
            cells.append(cell + f" [{secs:.0f}s]")
        print(f"| {seq} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
