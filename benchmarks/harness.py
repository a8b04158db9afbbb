"""What every benchmark script shares: the machine, interleaved timing, XLA's compiled memory,
markdown tables, and the layer sizes the benchmark pages measure.

Timing rules learned on the shared CPU and the H200 (keep them when adding a benchmark):

- compile and warm every callable before timing any of them;
- interleave: one timed call of each callable per round, so that ratios share the machine's
  load (absolute seconds on a shared machine mean little);
- ``settle`` untimed calls right before each timed one: a call just after another
  implementation freed multi-GiB temporaries pays for re-faulting its own buffers (measured:
  the selection stage ran ~30% slower right after the naive layer's fwd+bwd);
- report the median and the minimum.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from csa_eqx import Execution, V4Attention, V4AttentionConfig, V32AttentionConfig, presets

GIB = 2.0**30


# --- the layers the benchmark pages measure -------------------------------------------------


def speed_layer(quick: bool = False) -> V4AttentionConfig:
    """The CSA layer of the speed / memory tables (CPU and GPU pages): V4-Flash's indexer
    (64 heads x 128, k = 512, m = 4, window 128) on small main dims (hidden 256, 4 heads x 64,
    full-width RoPE), so the indexer dominates. ``quick``: ``presets.tiny_v4("csa")``."""
    if quick:
        return presets.tiny_v4("csa")
    return presets.v4_flash(
        "csa",
        hidden_size=256,
        num_heads=4,
        head_dim=64,
        rope_dim=64,
        q_lora_rank=256,
        o_groups=2,
        o_lora_rank=128,
    )


def small_v4(kind: presets.LayerKind, **overrides) -> V4AttentionConfig:
    """A V4 layer of ``kind`` with small main dims (hidden 256, 8 heads x 64, RoPE 16,
    indexer 8 x 32, k = 128; V4-Flash's window and compress rates), for decode and remat."""
    small = dict(
        hidden_size=256, num_heads=8, head_dim=64, rope_dim=16, q_lora_rank=128, o_groups=2,
        o_lora_rank=64, index_n_heads=8, index_head_dim=32, index_topk=128,
    )  # fmt: skip
    return presets.v4_flash(kind, **(small | overrides))


def small_v32(**overrides) -> V32AttentionConfig:
    """A V3.2 layer with the shared sizes of ``small_v4`` but k = 512, and MLA latents of 128
    (nope 32, rope 16, values 32)."""
    mla = dict(kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return presets.v32_sized_as(small_v4("csa"), **(mla | {"index_topk": 512} | overrides))


def forward(layer, x):
    """csa_eqx's layer forward (a named function: profiles and HLO dumps show its name)."""
    return layer(x)


def layer_shapes(
    config: V4AttentionConfig, seq: int, execution: Execution | None = None
) -> tuple[V4Attention, jax.ShapeDtypeStruct]:
    """``(layer, x)`` as shapes only, to compile for and never run: a ``V4Attention`` of
    ``config`` (run as ``execution`` says, default automatic) and a float32 ``x[1, seq, D]``."""
    layer = eqx.filter_eval_shape(V4Attention, config, key=jax.random.key(0), execution=execution)
    return layer, jax.ShapeDtypeStruct((1, seq, config.hidden_size), jnp.float32)


# --- machine --------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _ram() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        return f"{kib / 2**20:.1f} GiB"
    return "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)  # reads metadata, imports nothing
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """The host, JAX's backend and the library versions of this run (starts JAX's backend;
    imports neither torch nor transformers)."""
    return dict(
        cpu=_cpu_model(),
        cores=os.cpu_count(),
        arch=platform.machine(),
        ram=_ram(),
        python=platform.python_version(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=jax.devices()[0].device_kind,
        device_count=jax.device_count(),
        torch=_version("torch"),
        transformers=_version("transformers"),
        date=f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        load=os.getloadavg()[0],
    )


def machine_markdown(info: dict[str, Any]) -> str:
    """``machine_info()`` as a markdown list."""
    return "\n".join(
        [
            f"- CPU: {info['cpu']}, {info['cores']} cores (`nproc`), {info['arch']}; "
            f"RAM {info['ram']}",
            f"- JAX {info['jax']} ({info['backend']} backend, {info['device_count']} x "
            f"{info['device']}); Python {info['python']}; torch {info['torch']}; "
            f"transformers {info['transformers']}",
            f"- date: {info['date']}; load average at the start: {info['load']:.1f}",
        ]
    )


# --- timing ---------------------------------------------------------------------------------


def blocking(fn: Callable, *args) -> Callable[[], Any]:
    """A no-argument call of ``fn(*args)`` that waits for the device to finish."""
    return lambda: jax.block_until_ready(fn(*args))


def interleaved(
    runs: dict[str, Callable[[], Any]], reps: int, settle: int = 0
) -> dict[str, list[float]]:
    """Seconds of ``reps`` interleaved rounds: one warm-up call of each run first, then per
    round ``settle`` untimed calls and one timed call of each run in turn (module docstring)."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            for _ in range(settle):
                fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict[str, float]:
    """``{"median": s, "min": s}`` of one run's timed calls."""
    return dict(median=statistics.median(times), min=min(times))


def gemm(n: int, dtype, precision=None) -> Callable[[], Any]:
    """A blocking ``jnp.dot`` of two random ``n x n`` matrices in ``dtype`` (``2 n^3``
    FLOPs), at ``precision`` (``jax.lax.Precision``; None: the backend's default, which may
    be TF32 for float32 on a GPU)."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32).astype(dtype) for i in (0, 1))
    return blocking(jax.jit(lambda a, b: jnp.dot(a, b, precision=precision)), a, b)


# --- compiled memory ------------------------------------------------------------------------


def fwd_bwd(forward: Callable) -> Callable:
    """``grad(sum(forward(layer, x)))`` with respect to the layer's arrays and ``x``, named
    ``<forward>_fwd_bwd`` (the name of its jitted program in profiles and HLO dumps)."""
    grad = jax.grad(lambda m, x: jnp.sum(forward(m, x)), argnums=(0, 1))
    grad.__name__ = f"{forward.__name__}_fwd_bwd"
    return grad


def compile_for(fn: Callable, *args):
    """``jax.jit(fn)`` compiled for ``args`` (arrays, or ``jax.ShapeDtypeStruct`` leaves when
    it will only be measured, never run)."""
    return jax.jit(fn).lower(*args).compile()


def memory(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled program, in bytes: ``temp`` (scratch the program
    allocates), ``argument``, ``output`` and ``alias`` (outputs reusing argument buffers)."""
    m = compiled.memory_analysis()
    return dict(
        temp=m.temp_size_in_bytes,
        argument=m.argument_size_in_bytes,
        output=m.output_size_in_bytes,
        alias=m.alias_size_in_bytes,
    )


def temp_bytes(fn: Callable, *args) -> int:
    """XLA temp bytes of ``jax.jit(fn)`` compiled for ``args`` (nothing runs)."""
    return memory(compile_for(fn, *args))["temp"]


# --- markdown -------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])
