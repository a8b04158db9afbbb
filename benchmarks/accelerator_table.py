"""One-shot accelerator benchmark: the speed and memory table of csa_eqx on a GPU or a TPU.

Made for one run of at most ~8 minutes on a lent accelerator, or two prepared runs
(``--part 1`` then ``--part 2 --resume``); ``--quick`` runs tiny stand-ins of every section on
any backend (the test suite does this on the CPU). Work runs in priority order and the
results are rewritten after every step, so a run that is cut off keeps everything that
finished; a step (or a single program) predicted not to fit the time budget or the device
memory is skipped and listed as such, and an error is recorded where it happened and the run
goes on. It writes, named by JAX's backend (``benchmarks_tpu`` on a TPU):

- ``OUT/benchmarks_<backend>.md``: the page (tables, the commands, the date, the device);
- ``OUT/benchmarks_<backend>.json``: ``{"device", "jax", "date", "command", "figures",
  "skipped"}``, one figure per measurement (``figures``);
- ``OUT/benchmarks_<backend>_raw.json``: every record of the run (what ``--resume`` reads).

In part 1 every csa_eqx program runs twice, as **the automatic choice** (``Execution()``: on
a TPU the Mosaic fused indexer (``MosaicSelection``), elsewhere XLA's strategies; on a GPU the
table forces the Pallas (Triton) kernels instead, ``chosen.platform_execution``, since they are
what it measures there; the strategies it took are recorded, and
its figures' ``path`` is ``"kernel"`` where a Pallas / Mosaic kernel class ran, else ``"xla"``)
and as **the XLA path** (the dense or streaming top-k that ``AutoSelection.choose`` picks,
with ``XlaAttention``, forced); where the automatic choice is the XLA path it runs once.

Part 1:

1. GEMM rate of an ``n x n`` ``jnp.dot``: bfloat16, float32 at ``'highest'`` precision (true
   fp32) and float32 at the default precision (TF32 on a GPU, bf16 passes on a TPU).
2. The benchmark layer (``benchmarks/layer_speed.py``'s layer and weights, B = 1) for each S and
   dtype: csa_eqx (automatic, XLA), the naive dense-mask baseline and HF transformers' eager
   ``DeepseekV4Attention`` (torch, where it fits), fwd and fwd+bwd; the selection stages
   alone, their visible-pair scoring FLOP/s as a fraction of the GEMM rate of the same dtype;
   XLA's compiled memory of every program. Order: S = 4k (bf16, fp32), bf16 at 16k and 32k,
   the anchor, fp32 at 16k and 32k, then 64k (bf16, fp32). "float32" is true fp32 (JAX
   ``default_matmul_precision('highest')``, torch TF32 off); "bfloat16" casts every float
   parameter and the input.
3. The anchor: a V3.2-style indexer alone (token keys, causal), Q = K = 32768, 32 heads x 128,
   k = 2048, bf16, its automatic selection and the XLA path, each one's picks checked against
   a blocked ``lax.top_k`` reference (``anchor_reference``).
4. Profiles (bf16, S = 4k and 32k; not with ``--no-profile``): one ``jax.profiler`` trace per S
   of the selection stage, csa_eqx fwd and fwd+bwd, summarised and saved as
   ``OUT/profile_S.json.gz``.

Part 2: one DeepSeek-V4-Flash CSA layer (``presets.v4_flash("csa")``) and one V3.2 DSA layer
(``presets.v32()``) at their released sizes, random bf16 weights, fwd and fwd+bwd at 16k, 32k,
8k, 64k (in that order) as the automatic choice runs them, each compiled first (shapes only;
every program compiled, time permitting: no memory prediction) and run only where its compiled
memory (temporaries, outputs and, given as shapes, arguments) fits the device's free memory, a
compile the compiler refuses for memory recorded as skipped; the longest S each layer ran at
(fwd, fwd+bwd) is in the page and the figures file (``longest``); the model-FLOP utilisation
beside each time (``benchmarks/flops.py`` says what is counted) and the attention kernel alone
(the layer's own call, inputs captured from its forward), fwd and fwd+bwd, with its bytes per
second. ``--tiles`` (last): the selection stage at several streaming key tiles.

    python -m benchmarks.accelerator_table --out DIR [--part {1,2,all}] [--resume RAW]
        [--quick] [--budget 400] [--reps 3] [--slow 1] [--seqs ...] [--released-seqs ...]
        [--dtypes bfloat16 float32] [--gemm-n 8192] [--peak-tflops P] [--no-hf]
        [--no-anchor] [--no-profile] [--tiles]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import csa_eqx as ce
from csa_eqx import entry_layout, presets
from csa_eqx._backend import backend_tiles

from . import flops, harness, layer_speed
from .accelerator_report import figure_text, markdown
from .chosen import (
    attention_inputs,
    attention_programs,
    automatic_selection,
    is_kernel,
    platform_execution,
    resolve,
    xla_selection,
)
from .harness import forward

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
GEMMS = {  # name: (dtype, matmul precision)
    "bfloat16": (jnp.bfloat16, None),
    "float32 (precision highest)": (jnp.float32, jax.lax.Precision.HIGHEST),
    "float32 (default precision)": (jnp.float32, None),
}
LARGEST_MAIN_SEQ = 32768  # longer sequences run last, when time allows
# dense bf16 peak of the chips whose model-FLOP utilisation the page reports (by
# ``device_kind``); elsewhere ``--peak-tflops`` gives it
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0}
# the automatic choice's runs of a layer step, and the XLA path's run each one repeats
AUTOMATIC_RUNS = {
    "csa_eqx fwd+bwd": "csa_eqx XLA fwd+bwd",
    "csa_eqx fwd": "csa_eqx XLA fwd",
    "selection stage": "selection stage XLA",
}
# profiled: the automatic choice's runs, or (where it is the XLA path) the XLA path's
PROFILED = tuple(AUTOMATIC_RUNS), tuple(AUTOMATIC_RUNS.values())
# JAX runs of a layer step, most important first (the first to get the time that is left)
PRIORITY = (
    "csa_eqx fwd+bwd", "csa_eqx fwd", "selection stage", "naive fwd+bwd", "naive fwd",
    "csa_eqx XLA fwd+bwd", "csa_eqx XLA fwd", "selection stage XLA",
)  # fmt: skip
TILE_KEY_BLOCKS = (0, 512, 1024, 2048)  # indexer_key_block values of --tiles (0 = automatic)
MAX_TRACE_BYTES = 15 << 20  # a trace larger than this is summarised but not copied to OUT
# the layers at released sizes (part 2): figure-name prefix -> (layer class, config by mode)
RELEASED = {
    "v4_flash_csa": (
        ce.V4Attention,
        {"full": lambda: presets.v4_flash("csa"), "quick": lambda: presets.tiny_v4("csa")},
    ),
    "v32_dsa": (ce.V32Attention, {"full": presets.v32, "quick": presets.tiny_v32}),
}
RELEASED_RUNS = ("fwd", "fwd+bwd", "attention fwd", "attention fwd+bwd")
MODES = {
    "full": dict(
        seqs=(4096, 16384, 32768, 65536),
        # the goals' S first; every S compiled, its compiled memory deciding whether it runs
        released_seqs=(16384, 32768, 8192, 65536),
        profile=(4096, 32768),
        gemm_n=8192,
        # CuTe DSL fused indexer score + exact radix top-k on an H200 (TileLang: 28.6 ms);
        # the reference check scores ``block`` queries at a time
        anchor=dict(seq=32768, heads=32, dim=128, k=2048, block=256, reference_ms=16.1),
        first_compile_s=30.0,
        released_first_compile_s=90.0,
    ),
    "quick": dict(
        seqs=(128, 256),
        released_seqs=(256,),  # V4's T = 64 > 4k: gathered picks, as at the released sizes
        profile=(128, 256),
        gemm_n=256,
        anchor=dict(seq=256, heads=4, dim=16, k=16, block=64, reference_ms=None),
        first_compile_s=30.0,
        released_first_compile_s=30.0,
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def describe_error(err: BaseException) -> str:
    """'OOM' for an out-of-memory error of either framework, else the error's first line."""
    text = f"{type(err).__name__}: {err}"
    if any(s in text for s in ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemory")):
        return "OOM"
    return text.splitlines()[0][:200]


def precision(dtype_name: str):
    """True fp32 matmuls for the float32 runs; the default precision for bfloat16."""
    if dtype_name == "float32":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def machine() -> dict:
    """``harness.machine_info()`` plus the GPU (nvidia-smi), JAX's environment report and the
    memory / precision settings of this run."""
    meta = harness.machine_info()
    meta.update(
        jax_default_matmul_precision=str(jax.config.jax_default_matmul_precision),
        xla_preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        xla_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
    )
    try:
        meta["jax_env"] = jax.print_environment_info(return_string=True)
    except Exception as err:  # noqa: BLE001 - a report, not a requirement
        meta["jax_env"] = describe_error(err)
    try:
        query = "--query-gpu=name,memory.total,driver_version"
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv"], capture_output=True, text=True, timeout=30
        )
        meta["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as err:
        meta["nvidia_smi"] = f"not available ({type(err).__name__})"
    return meta


def torch_setup(cpu_ok: bool) -> dict:
    """torch, transformers and the device the HF layer runs on (the CPU only if ``cpu_ok``), or
    why it cannot run."""
    try:
        import torch

        import csa_eqx.testing  # noqa: F401 - needs a transformers with DeepSeek-V4 and V3.2
    except Exception as err:  # noqa: BLE001 - ImportError, or a CUDA library that fails to load
        return dict(ok=False, why=f"torch / transformers not usable ({describe_error(err)})")
    info = dict(ok=True, torch=torch.__version__, cuda=torch.cuda.is_available())
    if info["cuda"]:
        info.update(device="cuda", gpu=torch.cuda.get_device_name(0))
    elif cpu_ok:
        info["device"] = "cpu"
    else:
        return dict(info, ok=False, why="torch has no CUDA device; HF eager skipped")
    # True fp32 in the float32 rows (these are torch's defaults, set to be sure).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if info["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    return info


def free_memory() -> None:
    """Collect garbage and hand torch's cached CUDA blocks back (JAX keeps its pool)."""
    gc.collect()
    torch = sys.modules.get("torch")  # only if the HF layer imported it
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def jax_free_bytes() -> float:
    """Bytes JAX may still allocate on its device (infinite where it does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return float("inf")
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def cast(layer, dtype):
    """Every float array of ``layer`` in ``dtype`` (as torch's ``module.to(dtype)`` does)."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, layer)


def released_layer(kind: str, mode: str) -> tuple[Any, Callable]:
    """The config of the layer at released sizes ``kind`` (a key of ``RELEASED``) in ``mode``
    (``"full"``: the released sizes) and its builder: ``build(key)``, the layer with random
    bfloat16 weights (under ``eqx.filter_eval_shape``, its shapes only)."""
    cls, configs = RELEASED[kind]
    config = configs[mode]()

    def build(key):
        return cls(config, key=key, dtype=jnp.bfloat16)

    return config, build


def needed_bytes(mem: dict, resident: bool) -> int:
    """Device bytes a compiled program still needs to run: its temporaries and outputs, and its
    arguments unless they are ``resident`` already."""
    return mem["temp"] + mem["output"] - mem["alias"] + (0 if resident else mem["argument"])


def recomputed_groups(layer, choice, groups: int) -> int:
    """The attention calls (V3.2's head groups) whose forward the backward runs again: those
    that keep no output (``csa_eqx._layers.v32.kept_parts``; none with one call)."""
    if groups == 1:
        return 0
    from csa_eqx._layers import v32

    q = choice.inputs[0]
    shape = (*q.shape[:2], q.shape[2] * groups, q.shape[3])
    kept = v32.kept_parts(shape, groups, layer.config.kv_lora_rank)
    return groups - (kept if hasattr(choice.attention, "replay") else 0)


def mosaic_config(choice):
    """The forward and the backward kernel's configurations (``mosaic_layout.Config``) of a
    ``resolve``d choice whose attention is ``MosaicAttention`` (one call: a V3.2 head group's),
    else ``None``."""
    kernel = choice.attention
    if not isinstance(kernel, ce.MosaicAttention):
        return None
    from csa_eqx._attention import mosaic_plan

    q, reads, sinks = choice.inputs
    scale, seen = choice.call[0], []

    def plan(q, reads):
        static = mosaic_plan.plan(kernel, q, reads, sinks is not None, float(scale)).static
        seen.append((static.config, static.backward))
        return 0

    jax.eval_shape(plan, q, reads)
    return seen[0]


# --- programs: compiled for shapes or arrays, called with arrays ----------------------------


def is_array_like(leaf) -> bool:
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


# the custom-call targets of Pallas kernels (Mosaic TPU, Triton, Mosaic GPU) in a lowering
KERNEL_CALLS = re.compile(r"custom_call @(tpu_custom_call|__gpu\$xla\.gpu\.triton|mosaic_gpu\w*)")


class Program:
    """``fn(*args)`` jitted over the arrays of ``args`` (every other leaf, a strategy say, is
    baked in) and lowered for them: arrays, or ``jax.ShapeDtypeStruct`` leaves to compile and
    measure before any array exists. The jitted program keeps ``fn``'s name (profiles)."""

    def __init__(self, fn: Callable, args: tuple):
        dynamic, static = eqx.partition(args, is_array_like)

        def run(dynamic):
            return fn(*eqx.combine(dynamic, static))

        run.__name__ = run.__qualname__ = getattr(fn, "__name__", "program")
        self.lowered = jax.jit(run).lower(dynamic)
        # what runs, whatever the strategies say: the Pallas kernels' calls in the program
        self.kernel_calls = len(KERNEL_CALLS.findall(self.lowered.as_text()))
        self.compiled = None
        self.memory: dict = {}

    def compile(self) -> Program:
        self.compiled = self.lowered.compile()
        self.memory = harness.memory(self.compiled)
        return self

    def caller(self, args: tuple) -> Callable[[], Any]:
        """A no-argument blocking call of the compiled program on the arrays of ``args``
        (shaped as the lowering's), returning its outputs."""
        dynamic = eqx.partition(args, is_array_like)[0]
        return lambda: jax.block_until_ready(self.compiled(dynamic))


def first_call(fn: Callable, args: tuple, rec: dict) -> tuple[Callable[[], Any], Any] | None:
    """``fn(*args)`` compiled (``Program``) and called once where it fits the device's free
    memory (its arguments resident), for the A/B scripts: its compiled ``memory``,
    ``kernel_calls``, ``compile_s``, ``first_s`` and an empty ``times_s`` recorded in ``rec``.

    **Returns:** ``(run, outputs)``, ``run`` the blocking call; ``None`` with ``rec``'s
    ``error`` or ``skipped`` saying why."""
    t0 = time.perf_counter()
    try:
        program = Program(fn, args).compile()
    except Exception as err:  # noqa: BLE001 - recorded, the caller goes on
        rec["error"] = describe_error(err) if "RESOURCE" not in str(err) else str(err)[:300]
        return None
    rec.update(memory=program.memory, kernel_calls=program.kernel_calls)
    rec["compile_s"] = time.perf_counter() - t0
    need, free = needed_bytes(program.memory, resident=True), jax_free_bytes()
    if need > free:
        rec["skipped"] = f"memory ({need / 2**30:.2f} GiB > {free / 2**30:.2f} GiB free)"
        return None
    run = program.caller(args)
    out = called_once(run, rec)
    return None if out is None else (run, out)


def called_once(run: Callable[[], Any], rec: dict) -> Any:
    """``run()`` once: its ``first_s`` and an empty ``times_s`` in ``rec``. **Returns:** its
    outputs, or ``None`` with ``rec["error"]`` saying why."""
    t0 = time.perf_counter()
    try:
        out = run()
    except Exception as err:  # noqa: BLE001 - recorded, the caller goes on
        rec["error"] = describe_error(err)
        return None
    rec["first_s"], rec["times_s"] = time.perf_counter() - t0, []
    return out


def alternating_rounds(runs: dict, records: dict, reps: int, save: Callable = lambda: None):
    """``reps`` rounds of one call of each of ``runs`` (by name) in turn, each call's seconds
    appended to ``records[name]["times_s"]``, ``save()`` after each round."""
    for _ in range(reps):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            records[name]["times_s"].append(time.perf_counter() - t0)
        save()


# --- the anchor: V3.2-style indexer alone ------------------------------------------------------


def anchor_inputs(seq: int, heads: int, dim: int):
    """bf16 queries ``[1,S,H,D]`` and token keys ``[1,S,D]``, float32 head weights."""
    kq, kw, kk = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, seq, heads, dim), jnp.bfloat16)
    w = jax.random.normal(kw, (1, seq, heads), jnp.float32) * heads**-0.5
    return q, w, jax.random.normal(kk, (1, seq, dim), jnp.bfloat16)


def anchor_problem(q, w, keys) -> ce.SelectionProblem:
    """The selection problem on token keys (V3.2), causal, one segment, with the backend's
    tiles (``csa_eqx._backend.backend_tiles``, as a layer's problem has them)."""
    b, s = q.shape[:2]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segment = jnp.zeros((b, s), jnp.int32)
    visibility = ce.Visibility(index, segment, entry_layout(segment, 1))
    return ce.SelectionProblem.from_queries(q, w, keys, visibility, tiles=backend_tiles())


def anchor_select(q, w, keys, k: int, strategy):
    """``strategy``'s selection of the anchor's problem: ``[B,S,k]``."""
    return strategy.select(anchor_problem(q, w, keys), k)


def anchor_reference(q, w, keys, picks, k: int, block: int, margin: float = 1e-5):
    """The anchor's exact top-k by plain XLA, ``block`` queries at a time (true float32 scores
    ``d^-1/2 sum_h w relu(q.k)``, causal, ``lax.top_k``: ties to the lower index), compared
    with ``picks [1,S,k]`` as sets.

    **Returns:** bool ``(same [S], untied [S])``: the row's picks equal the reference's; the
    row is untied: fewer than ``k + 1`` visible keys, or its k-th and (k+1)-th scores differ by
    more than ``margin`` of its largest ``|score|`` (float rounding cannot swap them)."""
    s, d = q.shape[1], q.shape[-1]
    scale = w[0].astype(jnp.float32) * d**-0.5

    def one(start):
        rows = start + jnp.arange(block)
        qb = jax.lax.dynamic_slice_in_dim(q[0], start, block)
        logits = jnp.einsum("qhd,td->qht", qb, keys[0], preferred_element_type=jnp.float32)
        wb = jax.lax.dynamic_slice_in_dim(scale, start, block)
        hi = jax.lax.Precision.HIGHEST
        scores = jnp.einsum("qht,qh->qt", jax.nn.relu(logits), wb, precision=hi)
        visible = jnp.arange(s)[None, :] <= rows[:, None]
        scores = jnp.where(visible, scores, -jnp.inf)
        values, index = jax.lax.top_k(scores, k + 1)
        want = jnp.sort(jnp.where(values[:, :k] > -jnp.inf, index[:, :k], -1), axis=-1)
        got = jnp.sort(jax.lax.dynamic_slice_in_dim(picks[0], start, block), axis=-1)
        size = jnp.max(jnp.where(visible, jnp.abs(scores), 0.0), axis=-1)
        gap = values[:, k - 1] - values[:, k]
        untied = (values[:, k] == -jnp.inf) | (gap > margin * size)
        return jnp.all(want == got, axis=-1), untied

    same, untied = jax.lax.map(one, jnp.arange(0, s, block))
    return same.reshape(-1), untied.reshape(-1)


def scoring_flops(pairs: float, heads: int, dim: int) -> float:
    """q.k (2 d per head and pair) and the head weighting (2 per head and pair)."""
    return pairs * (2 * heads * dim + 2 * heads)


# --- profiles ----------------------------------------------------------------------------------


def summarise_trace(path: Path, top: int = 8) -> dict:
    """Kernel count, busy time and top kernels per XLA program of a Perfetto trace
    (``jax.profiler.trace(..., create_perfetto_trace=True)``): on a GPU the events of the
    device's stream threads (not derived timelines such as "XLA Ops"), on a CPU the XLA op
    events (those naming an ``hlo_op``)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data

    def names(kind: str, key) -> dict:
        return {
            key(e): e.get("args", {}).get("name", "")
            for e in events
            if e.get("ph") == "M" and e.get("name") == kind
        }

    process = names("process_name", lambda e: e["pid"])
    device = {pid for pid, name in process.items() if "/device:" in name}
    threads = names("thread_name", lambda e: (e["pid"], e.get("tid")))
    streams = {t for t, name in threads.items() if t[0] in device and name.startswith("Stream")}
    ops = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if streams:
        ops = [e for e in ops if (e["pid"], e.get("tid")) in streams]
    elif device:
        ops = [e for e in ops if e["pid"] in device]
    else:
        ops = [e for e in ops if "hlo_op" in e.get("args", {})]
    programs: dict[str, dict] = defaultdict(lambda: dict(kernels=0, busy_us=0.0, by_name={}))
    for e in ops:
        args = e.get("args", {})
        p = programs[args.get("hlo_module", "unknown")]
        p["kernels"] += 1
        p["busy_us"] += e["dur"]
        name = e.get("name") or args.get("hlo_op", "?")
        count, us = p["by_name"].get(name, (0, 0.0))
        p["by_name"][name] = (count + 1, us + e["dur"])
    out = {}
    for module, p in sorted(programs.items(), key=lambda kv: -kv[1]["busy_us"]):
        ranked = sorted(p["by_name"].items(), key=lambda kv: -kv[1][1])
        out[module] = dict(
            kernels=p["kernels"],
            distinct=len(p["by_name"]),
            busy_ms=p["busy_us"] / 1e3,
            top=[dict(name=n[:120], calls=c, ms=us / 1e3) for n, (c, us) in ranked[:top]],
        )
    return dict(device_events=bool(device), programs=out)


def capture_profile(runs: dict[str, Callable], out: Path, seq: int) -> dict:
    """One ``jax.profiler`` trace of one call of each run (compiled and warm already)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python call events: smaller traces, less overhead
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True, profiler_options=options):
            for fn in runs.values():
                fn()
        traces = sorted(Path(tmp).rglob("perfetto_trace.json.gz"))
        if not traces:
            return {"error": "the profiler wrote no perfetto_trace.json.gz"}
        summary = summarise_trace(traces[-1])
        size = traces[-1].stat().st_size
        if size <= MAX_TRACE_BYTES:
            saved = out / f"profile_{seq}.json.gz"
            shutil.copyfile(traces[-1], saved)
            summary["saved"] = saved.name
        else:
            summary["saved"] = f"not saved ({size / 2**20:.0f} MiB > {MAX_TRACE_BYTES >> 20} MiB)"
    return summary


# --- the run -----------------------------------------------------------------------------------


def new_result(args, meta: dict) -> dict:
    """The records of a fresh run (``runs``: each run's command and settings)."""
    return dict(
        meta=meta, hf={}, mode="quick" if args.quick else "full", layer=None, gemm={},
        layers=[], anchor=None, released=[], tiles=[], skipped=[], runs=[], peak_tflops=None,
    )  # fmt: skip


class Bench:
    """State of one run: results, time budget, and what earlier steps measured (to predict
    the time and memory of later ones)."""

    def __init__(self, args, mode: dict, res: dict, stem: str):
        self.args, self.mode, self.out, self.stem = args, mode, args.out, stem
        self.start = time.perf_counter()
        self.deadline = self.start + args.budget
        # (run name, dtype) -> dict(seq, compile_s, call_s, temp) of its last measurement
        self.seen: dict[tuple[str, str], dict] = {}
        self.pending = 0.0  # predicted seconds of the timed rounds still to come in this step
        self.res = res
        self.run = dict(
            command=command_line(), date=res["meta"].get("date"), part=args.part,
            reps=args.reps, settle=args.settle, slow_s=args.slow, budget_s=args.budget,
            elapsed_s=0.0,
        )  # fmt: skip
        res["runs"].append(self.run)

    def left(self) -> float:
        """Seconds of the budget left for new work (the pending timed rounds reserved)."""
        return self.deadline - time.perf_counter() - self.pending

    def save(self) -> None:
        """Write the three files (a report that fails to build says why in its file)."""
        self.run["elapsed_s"] = time.perf_counter() - self.start
        text = json.dumps(self.res, indent=1, default=str)
        (self.out / f"{self.stem}_raw.json").write_text(text)
        for suffix, build in ((".json", figure_text), (".md", markdown)):
            try:
                text = build(self.res)
            except Exception as err:  # noqa: BLE001 - the raw records are written already
                text = f"failed to build this report: {describe_error(err)}\n"
                log(text)
            (self.out / f"{self.stem}{suffix}").write_text(text)

    def skip(self, what: str, why: str) -> None:
        self.res["skipped"].append(f"{what}: {why}")
        log(f"  skipped {what}: {why}")

    def calls(self, call_s: float) -> int:
        """Calls of a run whose calls take ``call_s``: the first (in ``first_calls``), then the
        harness's warm-up and ``reps`` x (settle + timed), or for a slow run one timed call."""
        if call_s > self.args.slow:
            return 2
        return 2 + self.args.reps * (1 + self.args.settle)

    def predict(self, key: str, dtype: str, seq: int, memory_power: int) -> tuple:
        """(compile seconds, seconds of all its calls, temp bytes) of run ``key`` at ``seq``,
        scaled from its last measurement (calls x (S / S')^2, memory x (S / S')^memory_power;
        the first time: nothing known but the compile, ``None``)."""
        last = self.seen.get((key, dtype))
        if last is None:
            return None, 0.0, 0.0
        grow = seq / last["seq"]
        call_s = last["call_s"] * grow**2
        return last["compile_s"], self.calls(call_s) * call_s, last["temp"] * grow**memory_power

    def compile_programs(
        self,
        programs: dict,
        dtype: str,
        seq: int,
        rec: dict,
        family: str = "",
        first_compile_s: float | None = None,
        memory_power: int | None = 2,
    ) -> dict[str, Program]:
        """Lower and compile the programs ``{name: (function, arguments)}`` predicted to fit the
        time and memory left (the compiles in parallel threads: XLA's release the GIL) and
        record their compiled memory; arguments given as shapes must fit with their
        arguments. Returns the compiled ``Program``s that fit; why the others did not is in
        ``rec[name]``. ``family`` prefixes the names the predictions are kept under.
        ``memory_power`` ``None``: no memory prediction, every program is compiled (time
        permitting) and the compiled memory alone decides (part 2: a layer's memory does not
        scale by a power of S, V3.2's head groups past 16k); a compile the compiler refuses
        for the device's memory (``RESOURCE_EXHAUSTED``) is recorded as skipped for memory."""
        first = self.mode["first_compile_s"] if first_compile_s is None else first_compile_s
        t0, lowered = time.perf_counter(), {}
        compile_s, calls_s = 0.0, 0.0  # planned: the compiles run in parallel, calls in turn
        for name, (fn, args) in programs.items():
            c, secs, temp = self.predict(family + name, dtype, seq, memory_power or 0)
            temp = temp if memory_power else 0.0
            c = first if c is None else c
            if max(compile_s, c) + calls_s + secs > self.left():
                why = f"time budget (~{c + secs:.0f} s, {self.left():.0f} s left)"
                rec[name] = {"skipped": why}
            elif temp > jax_free_bytes():
                rec[name] = {"skipped": f"memory (~{temp / harness.GIB:.1f} GiB predicted)"}
            else:
                try:
                    lowered[name] = Program(fn, args)
                    compile_s, calls_s = max(compile_s, c), calls_s + secs
                except Exception as err:  # noqa: BLE001 - recorded, the others go on
                    rec[name] = {"error": describe_error(err)}
                    log(f"  {name}: {rec[name]['error']}")
        with ThreadPoolExecutor(max(len(lowered), 1)) as pool:
            futures = {name: pool.submit(p.compile) for name, p in lowered.items()}
        batch = time.perf_counter() - t0
        log(f"  compiled {len(lowered)} programs in {batch:.1f} s")
        compiled = {}
        for name, future in futures.items():
            try:
                program = future.result()
            except Exception as err:  # noqa: BLE001
                rec[name] = {"error": describe_error(err)}
                if "RESOURCE_EXHAUSTED" in str(err):  # the compiler: past the device's memory
                    first = str(err).strip().splitlines()[0][:200]
                    rec[name] = {"skipped": f"memory (the compiler refused it: {first})"}
                log(f"  {name}: {rec[name]}")
                continue
            rec[name] = dict(
                memory=program.memory, compile_s=batch, kernel_calls=program.kernel_calls
            )
            resident = not any(
                isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(programs[name][1])
            )
            self.seen[(family + name, dtype)] = dict(
                seq=seq, compile_s=batch, call_s=0.0, temp=program.memory["temp"]
            )
            if self.fits(program, rec[name], resident):
                compiled[name] = program
        return compiled

    def fits(self, program: Program, rec: dict, resident: bool) -> bool:
        """Whether ``program`` fits the device's free memory (its arguments already there if
        ``resident``); if not, says so in ``rec``."""
        need, free = needed_bytes(program.memory, resident), jax_free_bytes()
        if need <= free:
            return True
        rec["skipped"] = (
            f"memory ({need / harness.GIB:.2f} GiB > {free / harness.GIB:.2f} GiB free)"
        )
        log(f"  skipped: {rec['skipped']}")
        return False

    def first_calls(
        self, compiled: dict[str, Program], args: dict, dtype: str, seq: int, rec: dict,
        family: str = "",
    ) -> dict[str, Callable]:  # fmt: skip
        """Call each compiled program once on its arrays ``args[name]`` (where it fits);
        returns the blocking calls of those that ran."""
        runs = {}
        for name, program in compiled.items():
            if not self.fits(program, rec[name], resident=True):
                continue
            try:
                run = program.caller(args[name])
                t1 = time.perf_counter()
                run()
                call_s = time.perf_counter() - t1
            except Exception as err:  # noqa: BLE001 - recorded in the table, the others go on
                rec[name]["error"] = describe_error(err)
                log(f"  {name}: {rec[name]['error']}")
                free_memory()
                continue
            self.seen[(family + name, dtype)]["call_s"] = call_s
            self.pending += (self.calls(call_s) - 1) * call_s
            temp = program.memory["temp"] / harness.GIB
            log(f"  {name}: temp {temp:.2f} GiB, first call {call_s:.2f} s")
            runs[name] = run
        return runs

    def compile_runs(self, programs: dict, dtype: str, seq: int, rec: dict) -> dict:
        """``compile_programs`` then ``first_calls`` of programs given arrays."""
        compiled = self.compile_programs(programs, dtype, seq, rec)
        args = {name: programs[name][1] for name in compiled}
        return self.first_calls(compiled, args, dtype, seq, rec)

    def time_runs(self, runs: dict[str, Callable], rec: dict, dtype: str = "", family="") -> None:
        """Interleaved rounds of the runs that ran once (one timed call each for a run slower
        than ``--slow`` seconds, which its first call warmed); medians and minima into ``rec``
        (and the minimum into the predictions of later steps)."""
        seen = {n: self.seen.get((family + n, dtype), {}) for n in runs}
        slow = {n for n in runs if seen[n].get("call_s", 0.0) > self.args.slow}
        try:
            times = harness.interleaved(
                {n: f for n, f in runs.items() if n not in slow}, self.args.reps, self.args.settle
            )
            for name in slow:
                t0 = time.perf_counter()
                runs[name]()
                times[name] = [time.perf_counter() - t0]
        except Exception as err:  # noqa: BLE001
            why = describe_error(err)
            log(f"  timed rounds failed: {why}")
            for name in runs:
                rec[name] = dict(rec.get(name, {}), error=why)
            return
        finally:
            self.pending = 0.0
        for name, t in times.items():
            rec[name] = dict(rec.get(name, {}), rounds=len(t), **harness.summary(t))
            seen = self.seen.get((family + name, dtype))
            if seen is not None:
                seen["call_s"] = rec[name]["min"]

    # --- steps ---

    def gemm(self) -> None:
        n, rec = self.mode["gemm_n"], self.res["gemm"]
        runs = {name: harness.gemm(n, dtype, prec) for name, (dtype, prec) in GEMMS.items()}
        self.time_runs(runs, rec)
        for v in rec.values():
            if "min" in v:
                v.update(tflops_best=2 * n**3 / v["min"] / 1e12, n=n)

    def layer(self, dtype_name: str, seq: int, layer, torch_layer, hf_config, hf: dict) -> None:
        """Every implementation at one dtype and S (the module docstring's item 2)."""
        jlayer = cast(layer, DTYPES[dtype_name])
        jlayer = jlayer.with_execution(platform_execution(jlayer.execution))
        x_np = np.random.default_rng(0).normal(size=(1, seq, jlayer.config.hidden_size))
        x_np = x_np.astype(np.float32)
        x = jnp.asarray(x_np, DTYPES[dtype_name])
        choice = resolve(jlayer, x)
        rec: dict = dict(
            dtype=dtype_name,
            seq=seq,
            runs={},
            strategies=choice.names,
            xla_strategies=choice.xla_names,
            path=choice.path,
            automatic_is_xla=choice.automatic_is_xla,
            indexer_flops=layer_speed.indexer_flops(1, seq, jlayer.config),
        )
        self.res["layers"].append(rec)
        xla = jlayer.with_execution(choice.xla_execution(jlayer.execution))
        programs = layer_speed.jax_layer_programs(jlayer, x)
        for name, xla_name in AUTOMATIC_RUNS.items():
            programs[xla_name] = (programs[name][0], (xla, x))
        programs = {name: programs[name] for name in PRIORITY}
        if choice.automatic_is_xla:
            for name, xla_name in AUTOMATIC_RUNS.items():
                del programs[name]
                rec["runs"][name] = {"same_as": xla_name}
        runs = self.compile_runs(programs, dtype_name, seq, rec["runs"])
        self.save()
        if torch_layer is not None:
            runs |= self.hf_runs(torch_layer, hf_config, hf, dtype_name, x_np, rec)
        self.time_runs(runs, rec["runs"], dtype_name)
        stats = jax.devices()[0].memory_stats() or {}
        rec["jax_peak_bytes"] = stats.get("peak_bytes_in_use")
        check = seq == self.mode["seqs"][0] and dtype_name == "float32" and torch_layer is not None
        if check and self.left() < 30:
            self.skip(f"HF output check S={seq}", f"time budget ({self.left():.0f} s left)")
        elif check:
            try:
                rec["hf_check"] = layer_speed.output_check(torch_layer, hf_config, jlayer, x)
            except Exception as err:  # noqa: BLE001
                rec["hf_check"] = {"error": describe_error(err)}
        self.save()
        profile = dtype_name == self.args.dtypes[0] and seq in self.mode["profile"]
        if profile and not self.args.no_profile:
            names = next((p for p in PROFILED if p[0] in runs), ())
            profiled = {name: runs[name] for name in names if name in runs}
            if self.left() < 20:
                self.skip(f"profile S={seq}", f"time budget ({self.left():.0f} s left)")
            elif profiled:
                log(f"  profile S={seq}: {', '.join(profiled)}")
                try:
                    rec["profile"] = capture_profile(profiled, self.out, seq)
                except Exception as err:  # noqa: BLE001
                    rec["profile"] = {"error": describe_error(err)}

    def hf_runs(self, torch_layer, hf_config, hf: dict, dtype_name: str, x_np, rec: dict):
        """Warm, measured (peak memory) HF runs that are predicted to fit, as blocking calls."""
        import torch

        from csa_eqx.testing import hf_v4_runner

        device, seq = hf["device"], x_np.shape[1]
        tdtype = getattr(torch, dtype_name)
        # A copy: the float32 master weights on the CPU stay as loaded into csa_eqx.
        tl = copy.deepcopy(torch_layer).to(device=device, dtype=tdtype)
        fwd, fwd_bwd = hf_v4_runner(tl, hf_config, x_np, device=device, dtype=tdtype)
        cuda = device == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        runs = {}
        for name, fn in (("HF eager fwd+bwd", fwd_bwd), ("HF eager fwd", fwd)):
            _, secs, peak = self.predict(name, dtype_name, seq, 2)
            free = torch.cuda.mem_get_info()[0] if cuda else float("inf")
            if secs > self.left():
                rec["runs"][name] = {"skipped": f"time budget (~{secs:.0f} s)"}
                continue
            if peak > free:
                gib = peak / harness.GIB
                rec["runs"][name] = {"skipped": f"memory (~{gib:.0f} GiB predicted)"}
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                fn(), sync()
            except Exception as err:  # noqa: BLE001 - torch's OOM, say
                rec["runs"][name] = {"error": describe_error(err)}
                log(f"  {name}: {rec['runs'][name]['error']}")
                free_memory()
                continue
            call_s = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() if cuda else 0
            rec["runs"][name] = {"torch_peak_bytes": peak} if cuda else {}
            self.seen[(name, dtype_name)] = dict(seq=seq, compile_s=0.0, call_s=call_s, temp=peak)
            self.pending += (self.calls(call_s) - 1) * call_s
            runs[name] = lambda fn=fn: (fn(), sync())
        return runs

    def anchor(self) -> None:
        a = self.mode["anchor"]
        seq, heads, dim, k = a["seq"], a["heads"], a["dim"], a["k"]
        q, w, keys = anchor_inputs(seq, heads, dim)
        problem = anchor_problem(q, w, keys)
        strategies = {
            "indexer": automatic_selection(platform_execution(ce.Execution()).selection, problem),
            "indexer XLA": xla_selection(problem),
        }
        rec: dict = dict(a, runs={}, checks={})
        rec["strategies"] = {name: type(s).__name__ for name, s in strategies.items()}
        rec["path"] = "kernel" if is_kernel(strategies["indexer"]) else "xla"
        rec["flops"] = dict(visible=scoring_flops(seq * (seq + 1) / 2, heads, dim))
        self.res["anchor"] = rec
        if repr(strategies["indexer"]) == repr(strategies["indexer XLA"]):
            del strategies["indexer"]
            rec["runs"]["indexer"] = {"same_as": "indexer XLA"}
        programs = {
            name: (anchor_select, (q, w, keys, k, strategy))
            for name, strategy in strategies.items()
        }
        runs = self.compile_runs(programs, "bfloat16", seq, rec["runs"])
        if not runs:
            return
        self.time_runs(runs, rec["runs"], "bfloat16")
        self.save()
        if self.left() < 30:
            self.skip("anchor reference check", f"time budget ({self.left():.0f} s left)")
            return
        try:
            reference = None
            for name, run in runs.items():
                picks = run()
                args = (q, w, keys, picks, k, a["block"])
                reference = reference or Program(anchor_reference, args).compile()
                same, untied = (np.asarray(v) for v in reference.caller(args)())
                rec["checks"][name] = dict(
                    rows=int(same.size),
                    same=float(same.mean()),
                    untied=float(untied.mean()),
                    same_untied=float(same[untied].mean()) if untied.any() else None,
                )
        except Exception as err:  # noqa: BLE001
            rec["checks"]["error"] = describe_error(err)

    def released(self, kind: str, seq: int) -> None:
        """One layer at released sizes (part 2): compiled for shapes first, then run where
        its compiled memory fits: fwd, fwd+bwd, then the attention call alone."""
        config, build = released_layer(kind, self.res["mode"])
        layer = eqx.filter_eval_shape(build, jax.random.key(0))
        layer = layer.with_execution(platform_execution(layer.execution))
        x = jax.ShapeDtypeStruct((1, seq, config.hidden_size), jnp.bfloat16)
        choice = resolve(layer, x)
        rec: dict = dict(
            kind=kind,
            seq=seq,
            dtype="bfloat16",
            runs={},
            config=repr(config),
            strategies=choice.names,
            path=choice.path,
            costs=flops.layer_costs(layer, seq, jnp.dtype(jnp.bfloat16).itemsize),
        )
        self.res["released"].append(rec)
        programs = {"fwd": (forward, (layer, x)), "fwd+bwd": (harness.fwd_bwd(forward), (layer, x))}
        runs = rec["runs"]
        groups = config.num_heads // choice.inputs[0].shape[2]
        try:  # the kernels' dense work, from the Mosaic attention's configuration
            kernel_configs = mosaic_config(choice)
            if kernel_configs is not None:
                recomputed = recomputed_groups(layer, choice, groups)
                rec["hardware"] = dict(
                    calls=groups,
                    recomputed=recomputed,
                    config=repr(kernel_configs[0]),
                    backward=repr(kernel_configs[1]),
                )
                rec["costs"].update(
                    flops.hardware_costs(
                        layer, seq, rec["costs"], kernel_configs, groups, recomputed
                    )
                )
        except Exception as err:  # noqa: BLE001 - a figure fewer, recorded
            rec["hardware"] = dict(error=describe_error(err))
        if groups > 1:  # V3.2's heads in groups: the attention call runs inside a lax.map
            why = f"its heads run in {groups} groups (a lax.map): the call alone is not captured"
            runs.update({name: dict(skipped=why) for name in attention_programs(layer, choice)})
        else:
            programs["attention inputs"] = (attention_inputs, (layer, x))
            for name, fn in attention_programs(layer, choice).items():
                programs[name] = (fn, choice.inputs)
        family = kind + " "  # the predictions of later steps are kept per layer
        first_compile = self.mode["released_first_compile_s"]
        # no prediction: the compiled memory decides (V3.2's head groups past 16k need less
        # than 16k's temporaries scaled; tools/tpu_compile.py gives the same figures)
        compiled = self.compile_programs(
            programs, "bfloat16", seq, runs, family, first_compile, memory_power=None
        )
        self.save()
        if not set(compiled) & set(RELEASED_RUNS):
            return
        layer = eqx.filter_jit(build)(jax.random.key(0))  # one program, not one per op
        layer = layer.with_execution(platform_execution(layer.execution))
        x = jax.random.normal(jax.random.key(1), x.shape, x.dtype)
        self.timed(compiled, ("fwd", "fwd+bwd"), (layer, x), seq, runs, family)
        self.save()
        capture = compiled.get("attention inputs")
        attention = ("attention fwd", "attention fwd+bwd")
        if not set(compiled) & set(attention):
            return
        if capture is None:
            why = runs["attention inputs"].get("skipped") or runs["attention inputs"].get("error")
            for name in set(compiled) & set(attention):
                runs[name]["skipped"] = f"its inputs: {why}"
            return
        if not self.fits(capture, runs["attention inputs"], resident=True):
            for name in set(compiled) & set(attention):
                runs[name]["skipped"] = f"its inputs: {runs['attention inputs']['skipped']}"
            return
        inputs = capture.caller((layer, x))()
        del layer, x
        self.timed(compiled, attention, inputs, seq, runs, family)

    def timed(self, compiled: dict, names, args: tuple, seq: int, rec: dict, family: str) -> None:
        """First calls, then timed rounds, of the ``compiled`` programs among ``names``, each
        on ``args`` (bf16)."""
        chosen = {n: compiled[n] for n in names if n in compiled}
        runs = self.first_calls(chosen, dict.fromkeys(chosen, args), "bfloat16", seq, rec, family)
        self.time_runs(runs, rec, "bfloat16", family)

    def tiles(self, layer) -> None:
        """The selection stage at several ``indexer_key_block`` values, bf16, the first S
        above 4k (query blocks and row buffers automatic)."""
        seq = ([s for s in self.mode["seqs"] if s > 4096] or self.mode["seqs"])[0]
        jlayer = cast(layer, jnp.bfloat16)
        x = jax.random.normal(jax.random.key(0), (1, seq, jlayer.config.hidden_size), jnp.bfloat16)
        rec: dict = dict(dtype="bfloat16", seq=seq, runs={})
        self.res["tiles"].append(rec)
        programs = {}
        for kb in TILE_KEY_BLOCKS:
            variant = jlayer.with_execution(ce.Execution.from_options(indexer_key_block=kb))
            programs[f"key_block={kb or 'auto'}"] = (layer_speed.selection_stage, (variant, x))
        runs = self.compile_runs(programs, "bfloat16", seq, rec["runs"])
        self.time_runs(runs, rec["runs"], "bfloat16")


def plan(part: str, seqs, dtypes, released_seqs, tiles: bool, kinds=tuple(RELEASED)) -> list:
    """Steps in priority order. Part 1: GEMM; every dtype at the shortest S; the first dtype
    at the other S up to ``LARGEST_MAIN_SEQ``; the anchor; the other dtypes there; longer S
    last. Part 2: the released-size layers ``kinds`` (both by default), each at each of
    ``released_seqs`` in turn. All: both parts, then the key-tile sweep when asked for."""
    main = sorted(s for s in seqs if s <= LARGEST_MAIN_SEQ)
    extra = sorted(s for s in seqs if s > LARGEST_MAIN_SEQ)
    first: list[tuple] = [("gemm",)]
    first += [("layer", d, main[0]) for d in dtypes] if main else []
    first += [("layer", dtypes[0], s) for s in main[1:]]
    first += [("anchor",)]
    first += [("layer", d, s) for s in main[1:] for d in dtypes[1:]]
    first += [("layer", d, s) for s in extra for d in dtypes]
    second = [("released", kind, s) for s in released_seqs for kind in RELEASED if kind in kinds]
    steps = {"1": first, "2": second, "all": first + second}[part]
    return steps + ([("tiles",)] if tiles and part != "2" else [])


def command_line() -> str:
    return "python -m benchmarks.accelerator_table " + shlex.join(sys.argv[1:])


# --- main --------------------------------------------------------------------------------------


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the files")
    parts = "1: GEMM, benchmark layer, anchor; 2: released sizes; all: both"
    parser.add_argument("--part", choices=("1", "2", "all"), default="all", help=parts)
    parser.add_argument("--resume", type=Path, help="an earlier part's _raw.json to add to")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a CPU smoke test")
    parser.add_argument("--allow-cpu", action="store_true", help="full sizes on a CPU backend")
    parser.add_argument("--budget", type=float, default=400, help="seconds for all steps")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--settle", type=int, default=1, help="untimed calls before each timed")
    slow = "seconds: a run whose first call takes longer is timed once"
    parser.add_argument("--slow", type=float, default=1.0, help=slow)
    parser.add_argument("--seqs", type=int, nargs="+", help="benchmark layer's S")
    parser.add_argument("--released-seqs", type=int, nargs="+", help="released sizes' S")
    kinds = "released-size layers (default: all; one alone has the device to itself)"
    parser.add_argument("--released-kinds", nargs="+", choices=list(RELEASED), help=kinds)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--gemm-n", type=int, help="GEMM matrix side (default 8192)")
    parser.add_argument("--peak-tflops", type=float, help="the chip's bf16 peak (for MFU)")
    parser.add_argument("--no-hf", action="store_true", help="skip torch and transformers")
    parser.add_argument("--no-anchor", action="store_true", help="skip the indexer anchor")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler traces")
    parser.add_argument("--tiles", action="store_true", help="add the key-tile sweep (last)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    # Before JAX starts its backend: JAX and torch share a GPU, so JAX must not take 75% of it
    # up front, and its pool (which never shrinks) is capped so that HF's eager layer keeps room.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not args.no_hf:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    mode = dict(MODES["quick" if args.quick else "full"])
    for key in ("seqs", "released_seqs", "gemm_n"):
        if getattr(args, key):
            mode[key] = getattr(args, key)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = machine()  # initialises JAX's backend before torch loads its CUDA libraries
    res = json.loads(args.resume.read_text()) if args.resume else new_result(args, meta)
    res["meta"] = meta
    res["peak_tflops"] = args.peak_tflops or PEAK_TFLOPS.get(meta["device"])
    bench = Bench(args, mode, res, f"benchmarks_{meta['backend']}")
    hf = dict(ok=False, why="--no-hf") if args.no_hf else torch_setup(args.quick or args.allow_cpu)
    res["hf"] = hf
    config = harness.speed_layer(args.quick)
    res["layer"] = (
        f"hidden {config.hidden_size}, {config.num_heads} heads x {config.head_dim}, indexer "
        f"{config.index_n_heads} heads x {config.index_head_dim}, k = {config.index_topk}, "
        f"m = {config.compress_rate}, window {config.sliding_window}"
    )
    log(f"{meta}\nHF: {hf}")
    bench.save()
    if meta["backend"] == "cpu" and not (args.quick or args.allow_cpu):
        log("JAX found no accelerator: stopping (use --quick, or --allow-cpu to insist)")
        raise SystemExit(2)
    kinds = args.released_kinds or tuple(RELEASED)
    steps = plan(args.part, mode["seqs"], args.dtypes, mode["released_seqs"], args.tiles, kinds)
    torch_layer = hf_config = layer = None
    for step in steps:
        what = " ".join(map(str, step))
        if step[0] == "anchor" and args.no_anchor:
            continue
        if bench.left() <= 0:
            bench.skip(what, "time budget")
            continue
        log(f"{what} ({bench.left():.0f} s left)")
        try:
            if step[0] in ("layer", "tiles") and layer is None:
                if hf["ok"]:
                    torch_layer, hf_config, layer = layer_speed.hf_and_ours(config)
                else:
                    layer = ce.V4Attention(config, key=jax.random.key(0))
            if step[0] == "gemm":
                bench.gemm()
            elif step[0] == "layer":
                with precision(step[1]):
                    bench.layer(step[1], step[2], layer, torch_layer, hf_config, hf)
            elif step[0] == "anchor":
                bench.anchor()
            elif step[0] == "released":
                bench.released(step[1], step[2])
            else:
                bench.tiles(layer)
        except Exception as err:  # noqa: BLE001 - recorded, the next step goes on
            bench.skip(what, f"failed: {describe_error(err)}")
        free_memory()
        jax.clear_caches()
        bench.save()
    bench.save()
    log(f"done in {bench.run['elapsed_s']:.0f} s")
    print(markdown(res), flush=True)


if __name__ == "__main__":
    main()
