"""Per-device compiled memory of one V4-Flash CSA layer's forward + backward (bf16, B = 1)
under context parallelism (docs/scaling.md, "Memory per device").

Compile only (``memory_analysis()``; nothing runs), on simulated CPU devices, so any sequence
length and device count fits on a laptop. Each device count needs its own process (the
simulated device count is fixed at start-up), so the table is built from one subprocess per
cell:

    python -m benchmarks.context_memory                       # the docs table
    python -m benchmarks.context_memory --cell 8 131072       # one cell
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DEVICES = (1, 8, 32, 64)
SEQ_LENS = (131072, 524288, 1048576)


def cell(devices: int, seq: int) -> str:
    """One measurement: ``temp_GiB argument_GiB`` per device (run in a fresh process)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import csa_eqx as ce
    from csa_eqx import presets

    context = ce.ContextParallel() if devices > 1 else None
    cfg = presets.v4_flash("csa")
    execution = ce.Execution(context=context)
    layer = jax.eval_shape(
        lambda: ce.V4Attention(cfg, key=jax.random.key(0), dtype=jnp.bfloat16, execution=execution)
    )
    params, static = eqx.partition(layer, lambda v: isinstance(v, jax.ShapeDtypeStruct))

    def fwd_bwd(p, x):
        def loss(p, x):
            return jnp.sum(eqx.combine(p, static)(x).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1))(p, x)

    mesh = jax.make_mesh((devices,), ("context",))
    sharding = NamedSharding(mesh, P(None, "context")) if context else None
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.bfloat16, sharding=sharding)
    with jax.set_mesh(mesh):
        mem = jax.jit(fwd_bwd).lower(params, x).compile().memory_analysis()
    return f"{mem.temp_size_in_bytes / 2**30:.1f} {mem.argument_size_in_bytes / 2**30:.2f}"


def table() -> str:
    """The markdown table: per-device temp (+ arguments) GiB per sequence length and mesh."""
    head = "| S | " + " | ".join("1 device" if d == 1 else f"context = {d}" for d in DEVICES)
    lines = [head + " |", "| --- |" + " --- |" * len(DEVICES)]
    for seq in SEQ_LENS:
        cells = []
        for d in DEVICES:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.context_memory", "--cell", str(d), str(seq)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            cells.append(f"{out[-2]} (+{out[-1]})")
        lines.append(f"| {seq // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", nargs=2, type=int, metavar=("DEVICES", "SEQ"))
    args = parser.parse_args()
    print(cell(*args.cell) if args.cell else table())


if __name__ == "__main__":
    main()
