"""Compile a benchmarked layer's programs for a TPU v5e on a machine without one, and print the
chip's compiled memory: XLA's ``memory_analysis`` of each program as the TPU compiler builds it.

    PYTHONPATH=/tmp/libtpu python tools/tpu_compile.py --seqs 4096 16384 \\
        --programs stage fwd fwdbwd [--layer v4_flash_csa] [--execution "ce.Execution(...)"] \\
        [--v32-split queries] [--json out.json]

It needs ``libtpu`` (the TPU compiler; no chip), installed OUTSIDE the project's environments,
where JAX would otherwise try to start a TPU backend::

    pip install --no-deps --target /tmp/libtpu libtpu==0.0.42.1   # the version JAX 0.10.2 pins

How: JAX's compile-only TPU topology (``jax.experimental.topologies.get_topology_desc``, one
v5e chip) gives a device that nothing runs on; each program is jitted with its inputs placed on
it, so the lowering is the TPU's (the Pallas kernels as Mosaic custom calls) and ``.compile()``
runs XLA's TPU passes and Mosaic's own compile (a kernel past VMEM fails here as on the chip).
The temporaries it reports matched the chip's to the digit (docs/kernels.md, "Compiling for a
TPU without one"). Before JAX is imported the tool sets ``JAX_PLATFORMS=cpu`` (no TPU backend
is started), ``TPU_ACCELERATOR_TYPE`` / ``TPU_WORKER_HOSTNAMES`` (only to silence libtpu's
warnings that it cannot find them) and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (libtpu otherwise
refuses to load while another process holds ``/tmp/libtpu_lockfile``); values already in the
environment win.

The library's choices (``MosaicSelection``, ``MosaicAttention``, ``TPU_TILES``) follow
``jax.default_backend()``, which ``csa_eqx._backend`` alone asks and which stays ``"cpu"``
here; while a program is traced the tool makes it answer ``"tpu"`` (``unittest.mock.patch``,
undone after each trace). JAX's own code asks its backend elsewhere
(``xla_bridge.default_backend``), so the patch reaches only callers of ``jax.default_backend``:
the library's choosers.

Layers (``--layer``): ``speed`` (default), the benchmark pages' layer below;
``v4_flash_csa`` / ``v32_dsa``, the accelerator table's layers at released sizes (its part 2,
``benchmarks.accelerator_table.released_layer``: random bfloat16 weights, ``x`` ``[1, S,
hidden]`` bfloat16; ``stage`` is a V4 layer's only). A program past the chip's HBM is a row
with the compiler's ``RESOURCE_EXHAUSTED`` message (the temporaries it would need); ``needs
GiB`` is what a program needs to run where nothing is resident (temporaries, arguments,
outputs: ``needed_bytes``, the accelerator table's test against the device's free memory).

Programs (the benchmark pages' layer, ``benchmarks.harness.speed_layer``, in bfloat16 as
``benchmarks.accelerator_table.cast`` makes it, ``x`` ``[1, S, hidden]`` bfloat16): ``stage``,
the indexer's selection stage (``benchmarks.layer_speed.selection_stage``); ``fwd``, the layer's
forward; ``fwdbwd``, its gradient (``benchmarks.harness.fwd_bwd``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

INSTALL = (
    "libtpu is not importable. Install it outside the project's environments and put it on "
    "PYTHONPATH:\n"
    "    pip install --no-deps --target /tmp/libtpu libtpu==0.0.42.1\n"
    "    PYTHONPATH=/tmp/libtpu python tools/tpu_compile.py ...\n"
    "(0.0.42.1 is the libtpu JAX 0.10.2 pins; never install it into a test environment: there "
    "JAX would try to start a TPU backend.)"
)
ENVIRONMENT = {
    "JAX_PLATFORMS": "cpu",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
PROGRAMS = ("stage", "fwd", "fwdbwd")
# the benchmark layer, then the accelerator table's layers at released sizes
LAYERS = ("speed", "v4_flash_csa", "v32_dsa")
GIB = 2**30


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096], help="sequence lengths S")
    p.add_argument("--programs", nargs="+", choices=PROGRAMS, default=["stage"])
    p.add_argument(
        "--layer",
        choices=LAYERS,
        default="speed",
        help="speed: the benchmark pages' layer; v4_flash_csa / v32_dsa: the accelerator "
        "table's layers at released sizes (its part 2)",
    )
    p.add_argument(
        "--execution",
        help='an expression in csa_eqx as "ce", e.g. '
        '"ce.Execution(attention=ce.MosaicAttention(query_block=64))" (default: automatic)',
    )
    p.add_argument(
        "--v32-split",
        choices=("heads", "queries"),
        help="how V3.2's long calls split (csa_eqx._layers.v32.SPLIT; default: the library's)",
    )
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if "stage" in args.programs and args.layer == "v32_dsa":
        p.error("the stage program is a V4 layer's (--layer speed or v4_flash_csa)")
    return args


def compile_rows(args: argparse.Namespace) -> list[dict]:
    """Compile each of ``args.programs`` at each of ``args.seqs`` for the TPU; one row each:
    program, S, kernel calls, XLA's memory analysis (bytes) and the compile seconds."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import csa_eqx as ce
    from benchmarks import harness, layer_speed
    from benchmarks.accelerator_table import Program, cast, needed_bytes, released_layer
    from csa_eqx._layers import v32

    topology = topologies.get_topology_desc(
        topology_name="v5e:1x1",
        platform="tpu",
        chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1),
        num_slices=1,
    )
    chip = NamedSharding(Mesh(np.array(topology.devices), ("chip",)), PartitionSpec())
    if args.layer == "speed":
        config = harness.speed_layer()
        layer = eqx.filter_eval_shape(
            lambda key: cast(ce.V4Attention(config, key=key), jnp.bfloat16), jax.random.key(0)
        )
    else:
        config, build = released_layer(args.layer, "full")
        layer = eqx.filter_eval_shape(build, jax.random.key(0))
    if args.execution:
        layer = layer.with_execution(eval(args.execution, {"ce": ce}))

    def on_chip(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=chip)

    layer = jax.tree.map(on_chip, layer)
    functions = {
        "stage": layer_speed.selection_stage,
        "fwd": harness.forward,
        "fwdbwd": harness.fwd_bwd(harness.forward),
    }
    rows = []
    for seq in args.seqs:
        x = on_chip(jax.ShapeDtypeStruct((1, seq, config.hidden_size), jnp.bfloat16))
        for name in args.programs:
            start = time.perf_counter()
            split = args.v32_split or v32.SPLIT
            with mock.patch.object(jax, "default_backend", return_value="tpu"), \
                    mock.patch.object(v32, "SPLIT", split):  # fmt: skip
                program = Program(functions[name], (layer, x))
            row = dict(program=name, seq=seq, kernel_calls=program.kernel_calls)
            try:
                program.compile()
            except jax.errors.JaxRuntimeError as err:  # past the chip's HBM: a row that says so
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                row["error"] = str(err).splitlines()[0]
            else:
                row |= program.memory
                row["needed"] = needed_bytes(program.memory, resident=False)
            rows.append(row | dict(seconds=time.perf_counter() - start))
            print(table_row(rows[-1]), flush=True)
    return rows


HEADER = (
    f"{'program':8} {'S':>6} {'kernels':>7} {'temp GiB':>9} {'arg GiB':>8} {'out GiB':>8} "
    f"{'needs GiB':>9}"
)


def table_row(row: dict) -> str:
    head = f"{row['program']:8} {row['seq']:6} {row['kernel_calls']:7} "
    if "error" in row:
        return head + f"{row['error']}  (compiled in {row['seconds']:.1f} s)"
    return head + (
        f"{row['temp'] / GIB:9.3f} {row['argument'] / GIB:8.3f} {row['output'] / GIB:8.3f} "
        f"{row['needed'] / GIB:9.3f}  (compiled in {row['seconds']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if importlib.util.find_spec("libtpu") is None:
        print(INSTALL, file=sys.stderr)
        return 2
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # csa_eqx, benchmarks
    print(HEADER, flush=True)
    rows = compile_rows(args)
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(execution=args.execution, v32_split=args.v32_split, rows=rows), indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
