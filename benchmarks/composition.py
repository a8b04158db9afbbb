"""Composition on an accelerator (issue 53; docs/composing.md, docs/benchmarks_tpu.md,
"Composition"): the layer under JAX's transformations on the automatic path and with the XLA
path forced, a checkpointed ``lax.scan`` training step over a stack against an unchecked one
and the XLA path's (compiled memory and time, one run), and the kernels against the XLA path
in float32 at ``precision="highest"``, and the layer with its batch sharded by ``jit`` over a
mesh of every device (the kernels per device) against the same step without a mesh.

    python -m benchmarks.composition --out DIR [--part table stack float32 jit] [--quick]
        [--kinds v4 v32]

``--quick`` shrinks every size (a CPU smoke run; the numbers mean nothing). Writes
``DIR/composition.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
import traceback
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import csa_eqx as ce
from csa_eqx.presets import tiny_v4, tiny_v32, v4_flash, v32
from csa_eqx.remat import compose_selection_policy

from .accelerator_table import KERNEL_CALLS

XLA = ce.Execution(selection=ce.DenseSelection(), attention=ce.XlaAttention())
XLA_TPU = ce.Execution(selection=ce.StreamingSelection(), attention=ce.XlaAttention())
POLICY = compose_selection_policy(None)


def config_of(kind: str, quick: bool):
    if kind == "v4":
        return tiny_v4("csa") if quick else v4_flash("csa")
    return tiny_v32() if quick else v32()


def layer_of(kind: str, execution, quick: bool, dtype=jnp.bfloat16):
    """A released-size layer (``quick``: a tiny one) whose selection is tagged for
    ``compose_selection_policy`` to save (``save_selection``: a no-op outside a checkpoint)."""
    execution = dataclasses.replace(execution, save_selection=True)
    cls = ce.V4Attention if kind == "v4" else ce.V32Attention
    return cls(config_of(kind, quick), key=jax.random.key(0), execution=execution, dtype=dtype)


def stacked(layer, n: int):
    params, static = eqx.partition(layer, eqx.is_array)
    return jax.tree.map(lambda a: jnp.stack([a] * n), params), static


def timed(fn, *args, reps: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def temporaries(fn, *args) -> float:
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    return mem.temp_size_in_bytes / 2**30


def table(quick: bool) -> dict:
    """The issue's table: each use on the automatic path and with the XLA path forced."""
    seq = 64 if quick else 2048
    paths = (("automatic", ce.Execution()), ("xla", XLA_TPU))
    return {path: _uses(execution, quick, seq) for path, execution in paths}


def _uses(execution, quick: bool, seq: int) -> dict:
    """Each use of the table on one path: ``"works"`` or the error's first line."""
    layer = layer_of("v4", execution, quick)
    x = jax.random.normal(jax.random.key(1), (2, seq, layer.config.hidden_size), jnp.bfloat16)
    params, static = stacked(layer, 2)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))

    def loss(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    def body(h, p):
        return h + eqx.combine(p, static)(h), None

    def square(y):
        return jnp.mean(y.astype(jnp.float32) ** 2)

    def remat(m, x):
        return square(jax.checkpoint(lambda m, x: m(x), policy=POLICY)(m, x))

    def stack_loss(p, x, step):
        return square(jax.lax.scan(step, x, p)[0])

    def data_parallel(m, x, grad):
        def local(m, x):
            f = lambda m, x: jax.lax.pmean(loss(m, x), "data")  # noqa: E731
            return jax.grad(f)(m, x) if grad else f(m, x)

        spec = (jax.P(), jax.P("data"))
        x = jax.reshard(x, jax.NamedSharding(mesh, jax.P("data")))
        return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=jax.P())(m, x)

    uses = {
        "checkpoint + grad": lambda: jax.jit(jax.grad(remat))(layer, x),
        "scan + grad": lambda: jax.jit(jax.grad(stack_loss), static_argnums=2)(params, x, body),
        "scan(checkpoint) + grad": lambda: jax.jit(jax.grad(stack_loss), static_argnums=2)(
            params, x, jax.checkpoint(body, policy=POLICY)
        ),
        "vmap": lambda: jax.jit(jax.vmap(layer))(x),
        "shard_map fwd": lambda: jax.jit(lambda m, x: data_parallel(m, x, False))(layer, x),
        "shard_map grad": lambda: jax.jit(lambda m, x: data_parallel(m, x, True))(layer, x),
        "jit sharding grad": lambda: sharded_grad(jax.grad(loss), mesh, layer, x),
    }
    out = {}
    for use, run in uses.items():
        try:
            jax.block_until_ready(run())
            out[use] = "works"
        except Exception as error:  # recorded, not raised: the table is the point
            out[use] = first_line(error, 200)
            traceback.print_exc()
        print(use, out[use], flush=True)
    return out


def sharded_grad(grad, mesh, layer, x):
    """``grad(layer, x)`` under ``jit`` with ``x``'s batch sharded over the mesh's ``data``
    axis (no placement: docs/composing.md, "Data parallel with `jit` sharding")."""
    with jax.set_mesh(mesh):
        return jax.jit(grad)(layer, jax.device_put(x, jax.P("data")))


def jit_sharding(quick: bool) -> dict:
    """A V4-Flash CSA layer's training step (bf16, the selection saved) with its batch sharded
    by ``jit`` over a mesh of every device, on the automatic path (the kernels, once per
    device) and with the XLA path forced, beside the automatic path without a mesh: compiled
    temporaries, time, and how many kernel calls the program holds (0: the path fell back to
    XLA's)."""
    seq = 128 if quick else 8192
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    out = {"seq": seq, "batch": n, "devices": n}
    for name, execution, sharded in (
        ("automatic, no mesh", ce.Execution(), False),
        ("automatic, jit sharding", ce.Execution(), True),
        ("xla, jit sharding", XLA_TPU, True),
    ):
        layer = layer_of("v4", execution, quick)
        x = jax.random.normal(jax.random.key(1), (n, seq, layer.config.hidden_size), jnp.bfloat16)

        def loss(m, x):
            return jnp.mean(m(x).astype(jnp.float32) ** 2)

        grad = jax.jit(jax.grad(loss))
        try:
            with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
                x = jax.device_put(x, jax.P("data")) if sharded else x
                lowered = grad.lower(layer, x)
                temp = lowered.compile().memory_analysis().temp_size_in_bytes / 2**30
                calls = len(KERNEL_CALLS.findall(lowered.as_text()))
                out[name] = dict(temp_gib=temp, kernel_calls=calls, seconds=timed(grad, layer, x))
        except Exception as error:
            out[name] = dict(error=first_line(error))
        print(name, out[name], flush=True)
    return with_ratios(out, "automatic, no mesh", "time_ratio_to_no_mesh")


def first_line(error: Exception, width: int = 300) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:width]}"


def stack(quick: bool) -> dict:
    """A training step over 4 V4-Flash CSA layers (bf16): checkpointed ``lax.scan`` with the
    selection saved, on the kernels; the same unchecked; the checkpointed one on the XLA path."""
    seq = 128 if quick else 8192
    out = {"layers": 4, "seq": seq}
    for name, execution, checkpoint in (
        ("kernels, checkpointed", ce.Execution(), True),
        ("kernels, unchecked", ce.Execution(), False),
        ("xla, checkpointed", XLA_TPU, True),
    ):
        out[name] = _step(execution, checkpoint, quick, seq)
        print(name, out[name], flush=True)
    return with_ratios(out, "kernels, checkpointed", "time_ratio_to_kernels_checkpointed")


def with_ratios(out: dict, base: str, key: str) -> dict:
    """``out`` with each timed row's time relative to row ``base``'s, as ``key``."""
    seconds = out.get(base, {}).get("seconds")
    for row in out.values():
        if isinstance(row, dict) and seconds and "seconds" in row:
            row[key] = row["seconds"] / seconds
    return out


def _step(execution, checkpoint: bool, quick: bool, seq: int) -> dict:
    """One training step's compiled temporaries and time (or the error)."""
    layer = layer_of("v4", execution, quick)
    params, static = stacked(layer, 4)
    x = jax.random.normal(jax.random.key(1), (1, seq, layer.config.hidden_size), jnp.bfloat16)

    def body(h, p):
        return h + eqx.combine(p, static)(h), None

    step = jax.checkpoint(body, policy=POLICY) if checkpoint else body

    def loss(p, x):
        return jnp.mean(jax.lax.scan(step, x, p)[0].astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss))
    try:
        temp = temporaries(jax.grad(loss), params, x)
        return dict(temp_gib=temp, seconds=timed(grad, params, x))
    except Exception as error:
        return dict(error=first_line(error))


def float32(quick: bool, kinds=("v4", "v32")) -> dict:
    """The kernels against the XLA path, float32 at ``precision="highest"``: the largest
    difference of the output, the indexer loss and every gradient, relative to the largest
    value, with the leaf that differs most. Beside it the same XLA path run on the host's CPU
    against the chip's: how far two float32 programs that only sum in another order lie apart,
    the yardstick for the kernels' difference (docs/benchmarks_tpu.md, "Composition"). And
    every float32 result against the same weights run in float64 on the host's CPU (the XLA
    path, ``DenseSelection``): how far each float32 program lies from the exact value, at every
    leaf and at the leaf where the kernels and the XLA path part most. On a CPU backend the
    TPU kernels run interpreted (the automatic path there is XLA's), with exact float32 dots:
    the kernels against XLA where only the order of the sums differs."""
    seq = 64 if quick else 3072
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.default_backend() == "cpu"
    xla = eqx.tree_at(lambda e: e.indexer_loss, XLA_TPU, "dense")
    kernels = ce.Execution(indexer_loss="dense")
    if on_cpu:
        kernels = ce.Execution(
            selection=ce.MosaicSelection(), attention=ce.MosaicAttention(), indexer_loss="dense"
        )
    paths = (("kernels", kernels, None), ("xla", xla, None))
    paths += () if on_cpu else (("xla_cpu", xla, cpu),)
    exact = ce.Execution(
        selection=ce.DenseSelection(),
        attention=ce.XlaAttention(),
        indexer_loss="dense",
        indexer_kl=ce.DenseIndexerLoss(),  # the streaming loss's carries are float32
    )
    out = {"seq": seq}
    with jax.default_matmul_precision("highest"):
        for kind in kinds:
            results = {}
            for path, execution, device in paths:
                with jax.default_device(device) if device else contextlib.nullcontext():
                    layer = layer_of(kind, execution, quick, dtype=jnp.float32)
                    results[path] = _value_and_grad(layer, seq)
            # The same weights and input as the float32 runs (drawn in float32: an x64 draw
            # differs), cast; the library's own float32 casts, as the indexer's scores, stay
            with jax.default_device(cpu):
                layer = layer_of(kind, exact, quick, dtype=jnp.float32)
            with jax.enable_x64(True), jax.default_device(cpu):
                layer = jax.tree.map(
                    lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, layer
                )
                results["float64_cpu"] = _value_and_grad(layer, seq, jnp.float64)
            pairs = {f"{a}_vs_{b}": (a, b) for a, b in _PAIRS if {a, b} <= results.keys()}
            out[kind] = {
                name: _differences(results[a], results[b]) for name, (a, b) in pairs.items()
            }
            leaf = out[kind]["kernels_vs_xla"]["worst_leaf"]
            for name, (a, b) in pairs.items():
                out[kind][name]["at_kernels_vs_xla_leaf"] = _differences(
                    results[a], results[b], leaf
                )["worst_gradient"]
            print(kind, out[kind], flush=True)
    return out


_PAIRS = (
    ("kernels", "xla"),
    ("xla_cpu", "xla"),
    ("kernels", "xla_cpu"),
    ("kernels", "float64_cpu"),
    ("xla", "float64_cpu"),
    ("xla_cpu", "float64_cpu"),
)


def _value_and_grad(layer, seq: int, dtype=jnp.float32):
    """Output, indexer loss and the gradients of ``mean(y**2) + indexer loss`` on the host."""
    shape = (1, seq, layer.config.hidden_size)
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)

    def loss(m, x):
        y, aux = m(x, return_aux=True)
        return jnp.mean(y**2) + aux["indexer_loss"], (y, aux["indexer_loss"])

    (_, (y, kl)), grads = jax.device_get(jax.jit(jax.value_and_grad(loss, has_aux=True))(layer, x))
    return y, kl, grads


def _differences(got, want, leaf: str | None = None) -> dict:
    """Largest differences of output, indexer loss and gradients, relative to ``want``'s
    largest value, and the name of the gradient leaf that differs most (``leaf``: the
    gradients of that leaf alone)."""

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

    (y0, kl0, g0), (y1, kl1, g1) = got, want
    named = jax.tree_util.tree_leaves_with_path(g1)
    grads = [
        (rel(a, b), jax.tree_util.keystr(path))
        for a, (path, b) in zip(jax.tree.leaves(g0), named, strict=True)
        if leaf in (None, jax.tree_util.keystr(path))
    ]
    worst, leaf = max(grads)
    return dict(
        output=rel(y0, y1), indexer_loss=rel(kl0, kl1), worst_gradient=worst, worst_leaf=leaf
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part", nargs="+", default=["table", "stack", "float32", "jit"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--kinds", nargs="+", default=["v4", "v32"], help="float32 part's layers")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = dict(
        backend=jax.default_backend(),
        devices=[d.device_kind for d in jax.devices()],
        jax=jax.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    parts = dict(table=table, stack=stack, float32=float32, jit=jit_sharding)
    for part in args.part:
        kinds = dict(kinds=args.kinds) if part == "float32" else {}
        record[part] = parts[part](args.quick, **kinds)
        (args.out / "composition.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
