"""A/B of a layer at released sizes on an accelerator (issue 54): one layer (``--kind``, random
bf16 weights, B = 1) at ``--seq`` tokens, its training step (``harness.fwd_bwd``) under each
``--variants`` execution, each compiled first (its compiled memory recorded, and run only where
it fits the device's free memory), a first call each, then ``--reps`` rounds of one call per
variant, alternating. Model-FLOP utilisation by ``benchmarks/flops.py``'s count (the page's
convention) of ``--peak-tflops``. Writes ``OUT/layer_ab.json``; ``--quick``: the tiny V4 layer
with the kernels forced (a CPU smoke run, interpreted).

    python -m benchmarks.layer_ab --out DIR [--kind v4_flash_csa] [--seq 32768] [--reps 3] \\
        [--variants automatic rows] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import csa_eqx as ce
from csa_eqx import presets
from csa_eqx._layers import v32

from . import flops, harness
from .accelerator_table import alternating_rounds, first_call, released_layer
from .harness import forward

_ROWS_DMA = ce.MosaicAttention(
    gather="rows", resident=False, gradients="vmem", vmem_limit_bytes=124 * 2**20
)
# the executions compared, by name (what each forces beside the automatic choice)
VARIANTS = {
    "automatic": ce.Execution(),
    "tiles": ce.Execution(attention=ce.MosaicAttention(gather="tiles")),
    "rows": ce.Execution(attention=ce.MosaicAttention(gather="rows", resident=True)),
    # the forward's rows copied from a resident table, the backward's read as tiles from HBM
    # (V3.2's table and its gradients do not fit VMEM together: its automatic choice at 32k)
    "rows-forward": ce.Execution(
        attention=ce.MosaicAttention(gather="rows", resident=True, gradients="hbm")
    ),
    # rows from a resident table both ways, the gradients in VMEM under a 124 MiB scoped limit
    # (of the v5e's 128): V3.2 at 16k 931 -> 710 ms on the chip, its automatic choice there
    "rows-124": ce.Execution(
        attention=ce.MosaicAttention(gather="rows", resident=True, vmem_limit_bytes=124 * 2**20)
    ),
    # rows by DMA both ways, the backward's float32 gradient table in VMEM (at 32k, 84 MB: it
    # fits where the table is not resident beside it) under a 124 MiB scoped limit
    "rows-dma": ce.Execution(attention=_ROWS_DMA),
    # V3.2 past 16k in query chunks with every head (``csa_eqx._layers.v32.SPLIT``): a query's
    # picked rows fetched once for its 128 heads rather than once per head group
    "query-chunks": ce.Execution(),
    "query-chunks-dma": ce.Execution(attention=_ROWS_DMA),
}
# the variants that run V3.2's long calls in query chunks (``v32.SPLIT`` while they compile)
QUERY_CHUNKS = ("query-chunks", "query-chunks-dma")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kind", default="v4_flash_csa", choices=("v4_flash_csa", "v32_dsa"))
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["automatic", "rows"])
    p.add_argument("--peak-tflops", type=float, default=197.0)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        config, seq = presets.tiny_v4("csa"), 64

        def build(key):
            return ce.V4Attention(config, key=key, dtype=jnp.bfloat16)

    else:
        config, build = released_layer(args.kind, "full")
        seq = args.seq
    layer = eqx.filter_jit(build)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, seq, config.hidden_size), jnp.bfloat16)
    model = flops.layer_costs(layer, seq, jnp.dtype(jnp.bfloat16).itemsize)["fwd_bwd"]
    res: dict = dict(
        device=str(jax.devices()[0].device_kind),
        kind="tiny_v4" if args.quick else args.kind,
        seq=seq,
        model_tflop=model / 1e12,
        peak_tflops=args.peak_tflops,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        variants={},
    )
    path = args.out / "layer_ab.json"

    def save():
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")

    runs = {}
    for name in args.variants:
        execution = VARIANTS[name]
        if args.quick and name == "automatic":  # the kernels, interpreted
            execution = ce.Execution(selection=ce.MosaicSelection(), attention=ce.MosaicAttention())
        variant = layer.with_execution(execution)
        rec = res["variants"][name] = dict(execution=repr(execution))
        split = "queries" if name in QUERY_CHUNKS else v32.SPLIT
        rec["v32_split"] = split
        with mock.patch.object(v32, "SPLIT", split):  # read while the program is traced
            called = first_call(harness.fwd_bwd(forward), (variant, x), rec)
        if called is not None:
            runs[name], out = called
            leaves = jax.tree.leaves(out)
            rec["checksum"] = float(sum(jnp.sum(jnp.abs(a.astype(jnp.float32))) for a in leaves))
        save()
    alternating_rounds(runs, res["variants"], args.reps, save)
    for name in runs:
        rec = res["variants"][name]
        rec["median_ms"] = 1e3 * float(np.median(rec["times_s"]))
        rec["mfu"] = model / (rec["median_ms"] / 1e3) / (args.peak_tflops * 1e12)
        print(f"{name}: {rec['median_ms']:.1f} ms, MFU {100 * rec['mfu']:.1f} %", flush=True)
    save()


if __name__ == "__main__":
    main()
