"""Per-device compiled memory of one V4-Flash CSA layer's forward + backward (bf16, B = 1)
under context parallelism, alone and with head parallelism over a tensor axis (docs/scaling.md,
"Memory per device").

Compile only (``memory_analysis()``; nothing runs), on simulated CPU devices, so any sequence
length and device count fits on a laptop. Each device count needs its own process (the
simulated device count is fixed at start-up), so the table is built from one subprocess per
cell:

    python -m benchmarks.context_memory                       # the docs table
    python -m benchmarks.context_memory --cell 4 2 131072     # one cell: context, tensor, S
    python -m benchmarks.context_memory --ratio               # 8 devices against the ideal

``--ratio`` compares, for two CSA layer sizes at S = 32k and 64k (float32, B = 1), the
per-device temp on 8 context devices with the ideal: one device's temp / 8 (one process with
8 simulated devices; the single-device program is compiled there unsharded).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# (context, tensor) mesh shapes: one device, then 8, 32 and 64 devices as a context axis alone
# and as context x tensor with the heads split over tensor (head parallelism)
MESHES = ((1, 1), (8, 1), (4, 2), (32, 1), (8, 4), (64, 1), (8, 8))
SEQ_LENS = (131072, 524288, 1048576)


def cell(context: int, tensor: int, seq: int) -> str:
    """One measurement: ``temp_GiB argument_GiB`` per device (run in a fresh process)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={context * tensor}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import csa_eqx as ce
    from csa_eqx import presets

    cfg = presets.v4_flash("csa")
    execution = ce.Execution(
        context=ce.ContextParallel() if context > 1 else None,
        heads=ce.HeadParallel() if tensor > 1 else None,
    )
    layer = jax.eval_shape(
        lambda: ce.V4Attention(cfg, key=jax.random.key(0), dtype=jnp.bfloat16, execution=execution)
    )
    params, static = eqx.partition(layer, lambda v: isinstance(v, jax.ShapeDtypeStruct))

    def fwd_bwd(p, x):
        def loss(p, x):
            return jnp.sum(eqx.combine(p, static)(x).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1))(p, x)

    # no size-1 tensor axis: XLA's CPU compiler aborts on this program with one (jax 0.10.2,
    # "Invalid binary instruction opcode copy")
    shape, names = (
        ((context, tensor), ("context", "tensor")) if tensor > 1 else ((context,), ("context",))
    )
    mesh = jax.make_mesh(shape, names)
    sharding = NamedSharding(mesh, P(None, "context")) if context > 1 else None
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.bfloat16, sharding=sharding)
    with jax.set_mesh(mesh):
        mem = jax.jit(fwd_bwd).lower(params, x).compile().memory_analysis()
    return f"{mem.temp_size_in_bytes / 2**30:.1f} {mem.argument_size_in_bytes / 2**30:.2f}"


# (name, config overrides of presets.tiny_v4("csa")) for --ratio
RATIO_LAYERS = (
    (
        "hidden 512, 8 x 128 heads",
        dict(hidden_size=512, num_heads=8, head_dim=128, q_lora_rank=256, o_lora_rank=128),
    ),
    (
        "hidden 1024, 16 x 256 heads",
        dict(hidden_size=1024, num_heads=16, head_dim=256, q_lora_rank=512, o_lora_rank=256),
    ),
)
RATIO_SEQ_LENS = (32768, 65536)


def ratio_table() -> str:
    """The markdown table of ``--ratio`` (run in a process with 8 simulated devices)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import csa_eqx as ce
    from csa_eqx import presets

    mesh = jax.make_mesh((8,), ("context",))

    def temp(cfg, seq, execution, sharding):
        layer = jax.eval_shape(
            lambda: ce.V4Attention(cfg, key=jax.random.key(0), execution=execution)
        )
        params, static = eqx.partition(layer, lambda v: isinstance(v, jax.ShapeDtypeStruct))
        x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), jnp.float32, sharding=sharding)

        def fwd_bwd(p, x):
            return jax.grad(lambda p, x: jnp.sum(eqx.combine(p, static)(x)), (0, 1))(p, x)

        with jax.set_mesh(mesh):
            compiled = jax.jit(fwd_bwd).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    lines = [
        "| layer (CSA, indexer 16 x 64, k = 256) | S | 1 device | 8 devices, per device | "
        "ratio to ideal (1 device / 8) |",
        "| --- | --- | --- | --- | --- |",
    ]
    split = ce.Execution(context=ce.ContextParallel())
    along = NamedSharding(mesh, P(None, "context"))
    for name, sizes in RATIO_LAYERS:
        cfg = presets.tiny_v4(
            "csa",
            rope_dim=64,
            o_groups=4,
            sliding_window=128,
            index_n_heads=16,
            index_head_dim=64,
            index_topk=256,
            **sizes,
        )
        for seq in RATIO_SEQ_LENS:
            one, each = temp(cfg, seq, ce.Execution(), None), temp(cfg, seq, split, along)
            lines.append(
                f"| {name} | {seq // 1024}k | {one / 2**20:.0f} MiB | {each / 2**20:.0f} MiB | "
                f"{each / (one / 8):.2f} |"
            )
    return "\n".join(lines)


def _label(context: int, tensor: int) -> str:
    if context * tensor == 1:
        return "1 device"
    return f"context = {context}" + (f" x tensor = {tensor}" if tensor > 1 else "")


def table() -> str:
    """The markdown table: per-device temp (+ arguments) GiB per sequence length and mesh."""
    head = "| S | " + " | ".join(_label(*m) for m in MESHES)
    lines = [head + " |", "| --- |" + " --- |" * len(MESHES)]
    for seq in SEQ_LENS:
        cells = []
        for context, tensor in MESHES:
            cmd = [sys.executable, "-m", "benchmarks.context_memory", "--cell"]
            cmd += [str(context), str(tensor), str(seq)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
            cells.append(f"{out[-2]} (+{out[-1]})")
        lines.append(f"| {seq // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", nargs=3, type=int, metavar=("CONTEXT", "TENSOR", "SEQ"))
    parser.add_argument("--ratio", action="store_true", help="8 devices against the ideal")
    args = parser.parse_args()
    if args.ratio:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        print(ratio_table())
    else:
        print(cell(*args.cell) if args.cell else table())


if __name__ == "__main__":
    main()
