"""One-shot accelerator benchmark: the whole speed / memory table of a V4 CSA layer in one run.

Made for one run of at most ~8 minutes on a lent GPU (an H200); on a TPU the Triton kernels'
runs are skipped and listed, and the rest (csa_eqx's XLA path, the naive layer, the anchor's
XLA selection) is measured the same way. ``--quick`` runs tiny sizes on any backend (the test
suite does this on the CPU). Work runs in priority order and the results
are rewritten to ``OUT/gpu_table.md`` and ``OUT/gpu_table.json`` after every step, so a run that
is cut off keeps everything that finished; a step (or a single implementation) predicted not to
fit the time budget or the device memory is skipped and listed as such.

1. GEMM rate of an ``n x n`` ``jnp.dot``: bfloat16, float32 at ``'highest'`` precision (true
   fp32) and float32 at the default precision (TF32 on a GPU).
2. Layer steps (``benchmarks/layer_speed.py``'s layer and weights, B = 1) for each sequence
   length S and dtype: csa_eqx with the Pallas kernels (``PallasSelection``,
   ``PallasAttention``: the automatic choice on a GPU), csa_eqx's XLA path
   (``StreamingSelection``, ``XlaAttention``: the automatic choice before the kernels) and the
   naive dense-mask baseline (jit), fwd and fwd+bwd, both selection stages alone, HF
   transformers' eager ``DeepseekV4Attention`` (torch, where it fits); XLA's compiled memory of
   every JAX program; the selection stages' visible-pair scoring FLOP/s as a fraction of the
   GEMM rate of the same dtype. Order: S = 4k (bf16, fp32), bf16
   at 16k and 32k, the anchor, fp32 at 16k and 32k, then 64k (bf16, fp32) when time allows.
   "float32" is true fp32 (JAX ``default_matmul_precision('highest')``, torch TF32 off);
   "bfloat16" casts every float parameter and the input.
3. The anchor: a V3.2-style indexer alone (token keys, causal), Q = K = 32768, 32 heads x 128,
   k = 2048, bf16, the fused kernel and the XLA streaming selection, against a CuTe DSL fused
   score + radix top-k kernel's 16.1 ms on an H200; the kernel's picks are compared with the
   dense (materialised-score) path once.
4. Profiles (bf16, S = 4k and 32k): one ``jax.profiler`` trace per S of one call each of the
   selection stage, csa_eqx fwd and fwd+bwd; summarised (kernel count, busy time, top
   kernels per program) and saved as ``OUT/profile_S.json.gz`` (Perfetto / chrome://tracing).
5. ``--tiles``: the selection stage at several streaming key tiles.

    python -m benchmarks.gpu_table --out DIR [--quick] [--budget 400] [--reps 3]
        [--seqs 4096 16384 32768 65536] [--dtypes bfloat16 float32] [--gemm-n 8192]
        [--no-hf] [--no-anchor] [--no-profile] [--tiles]
"""

from __future__ import annotations

import os

# Before jax is imported: JAX and torch share the GPU, so JAX must not take 75% of it up front,
# and its pool (which never shrinks) is capped so that HF's eager layer keeps room.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import csa_eqx as ce  # noqa: E402
from csa_eqx import V4Attention, entry_layout, entry_visibility, indexer_scores  # noqa: E402
from csa_eqx import select_topk as dense_topk  # noqa: E402
from csa_eqx._backend import backend_tiles  # noqa: E402

from . import harness, layer_speed  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
GEMMS = {  # name: (dtype, matmul precision)
    "bfloat16": (jnp.bfloat16, None),
    "float32 (precision highest)": (jnp.float32, jax.lax.Precision.HIGHEST),
    "float32 (default precision)": (jnp.float32, None),
}
GEMM_OF = {"bfloat16": "bfloat16", "float32": "float32 (precision highest)"}
LARGEST_MAIN_SEQ = 32768  # longer sequences run last, when time allows
# csa_eqx's Pallas kernels, forced whatever the backend would choose (the automatic choice on
# a GPU; interpret mode on a CPU); the XLA path is ``xla_execution``'s
KERNELS = ce.Execution(selection=ce.PallasSelection(), attention=ce.PallasAttention())
IMPLEMENTATIONS = (
    ("csa_eqx", "csa_eqx kernels"),
    ("csa_eqx XLA", "csa_eqx XLA"),
    ("naive", "naive dense-mask"),
    ("HF eager", "HF eager"),
)
# profiled: the kernels' runs, or (off a GPU, where they are not timed) the XLA path's
PROFILED = (
    ("selection stage", "csa_eqx fwd", "csa_eqx fwd+bwd"),
    ("selection stage XLA", "csa_eqx XLA fwd", "csa_eqx XLA fwd+bwd"),
)
KERNEL_RUNS = ("csa_eqx fwd+bwd", "csa_eqx fwd", "selection stage")
CPU_KERNELS = (
    "a CPU runs the Pallas kernels in interpret mode only (tests/test_pallas_*.py prove them "
    "there); a layer's timing would measure the interpreter"
)
NOT_TRITON = (
    "the Pallas kernels are Triton (GPU) kernels: a {backend} runs csa_eqx's XLA path, its "
    "automatic choice (docs/kernels.md)"
)


def kernels_not_timed(backend: str) -> str | None:
    """Why the Pallas kernels' layer runs are not timed on JAX's ``backend``; None on a GPU."""
    if backend == "gpu":
        return None
    return CPU_KERNELS if backend == "cpu" else NOT_TRITON.format(backend=backend.upper())


SELECTIONS = (("selection stage", "kernel"), ("selection stage XLA", "XLA"))
# JAX runs of a layer step, most important first (the first to get the time that is left)
PRIORITY = (
    "csa_eqx fwd+bwd", "csa_eqx fwd", "selection stage", "naive fwd+bwd", "naive fwd",
    "csa_eqx XLA fwd+bwd", "csa_eqx XLA fwd", "selection stage XLA",
)  # fmt: skip
TILE_KEY_BLOCKS = (0, 512, 1024, 2048)  # indexer_key_block values of --tiles (0 = automatic)
MAX_TRACE_BYTES = 15 << 20  # a trace larger than this is summarised but not copied to OUT
MODES = {
    "full": dict(
        seqs=(4096, 16384, 32768, 65536),
        profile=(4096, 32768),
        gemm_n=8192,
        # CuTe DSL fused indexer score + exact radix top-k on an H200 (TileLang: 28.6 ms)
        anchor=dict(seq=32768, heads=32, dim=128, k=2048, reference_ms=16.1),
    ),
    "quick": dict(
        seqs=(128, 256),
        profile=(128, 256),
        gemm_n=256,
        anchor=dict(seq=256, heads=4, dim=16, k=16, reference_ms=None),
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


def needed_bytes(mem: dict) -> int:
    return mem["temp"] + mem["argument"] + mem["output"] - mem["alias"]


# --- the anchor: V3.2-style indexer alone (the one place that names the selection API) -------


def xla_execution(config, seq: int) -> ce.Execution:
    """The XLA path of a layer at ``seq`` tokens (B = 1): the dense or streaming top-k the
    automatic rule picks without the kernels (``AutoSelection.choose``) and ``XlaAttention``."""
    entries = -(-seq // config.compress_rate)
    sizes = (1, seq, entries, config.index_n_heads, backend_tiles())
    return ce.Execution(selection=ce.AutoSelection().choose(*sizes), attention=ce.XlaAttention())


def anchor_select(q, w, keys, k: int, strategy):
    """``strategy``'s selection on token keys (V3.2), causal, one segment: ``[B,S,k]``."""
    b, s = q.shape[:2]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segment = jnp.zeros((b, s), jnp.int32)
    visibility = ce.Visibility(index, segment, entry_layout(segment, 1))
    return strategy.select(ce.SelectionProblem.from_queries(q, w, keys, visibility), k)


def anchor_dense(q, w, keys, k: int):
    """The same selection through the materialised ``[B,S,T]`` scores (one head at a time)."""
    b, s = q.shape[:2]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segment = jnp.zeros((b, s), jnp.int32)
    visible = entry_visibility(index, segment, entry_layout(segment, 1))
    return dense_topk(indexer_scores(q, w, keys, head_chunk=1), visible, k)


def anchor_inputs(seq: int, heads: int, dim: int):
    """bf16 queries ``[1,S,H,D]`` and token keys ``[1,S,D]``, float32 head weights."""
    kq, kw, kk = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, seq, heads, dim), jnp.bfloat16)
    w = jax.random.normal(kw, (1, seq, heads), jnp.float32) * heads**-0.5
    return q, w, jax.random.normal(kk, (1, seq, dim), jnp.bfloat16)


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


class Bench:
    """State of one run: results, time budget, and what earlier steps measured (to predict
    the time and memory of later ones)."""

    def __init__(self, args, mode: dict):
        self.args, self.mode, self.out = args, mode, args.out
        self.start = time.perf_counter()
        self.deadline = self.start + args.budget
        # (run name, dtype) -> dict(seq, compile_s, call_s, temp) of its last measurement
        self.seen: dict[tuple[str, str], dict] = {}
        self.pending = 0.0  # predicted seconds of the timed rounds still to come in this step
        self.res: dict = dict(
            meta={}, hf={}, mode="quick" if args.quick else "full", reps=args.reps,
            settle=args.settle, budget_s=args.budget, layer=None, gemm={}, layers=[],
            anchor=None, tiles=[], skipped=[], elapsed_s=0.0,
        )  # fmt: skip

    def left(self) -> float:
        """Seconds of the budget left for new work (the pending timed rounds reserved)."""
        return self.deadline - time.perf_counter() - self.pending

    def save(self) -> None:
        self.res["elapsed_s"] = time.perf_counter() - self.start
        (self.out / "gpu_table.json").write_text(json.dumps(self.res, indent=1, default=str))
        (self.out / "gpu_table.md").write_text(markdown(self.res))

    def skip(self, what: str, why: str) -> None:
        self.res["skipped"].append(f"{what}: {why}")
        log(f"  skipped {what}: {why}")

    def calls(self) -> int:
        """Calls of each timed run: the first (in ``compile_runs``), the harness's warm-up and
        ``reps`` x (settle + timed)."""
        return 2 + self.args.reps * (1 + self.args.settle)

    def predict(self, name: str, dtype: str, seq: int) -> tuple[float, float, float]:
        """(compile seconds, seconds of all its calls, temp bytes) of run ``name`` at ``seq``,
        scaled from its last measurement (calls and memory x (S / S')^2; the first time:
        30 s to compile, nothing else known)."""
        last = self.seen.get((name, dtype))
        if last is None:
            return 30.0, 0.0, 0.0
        grow = (seq / last["seq"]) ** 2
        return last["compile_s"], self.calls() * last["call_s"] * grow, last["temp"] * grow

    def compile_runs(self, programs: dict, dtype: str, seq: int, rec: dict) -> dict:
        """Compile the programs ``{name: (function, arguments)}`` predicted to fit the time
        and memory left (in parallel threads: XLA's compiles release the GIL), record their
        compiled memory and call each once. Returns the blocking calls of those that ran; why
        the others did not is in ``rec[name]``."""
        t0, lowered = time.perf_counter(), {}
        compile_s, calls_s = 0.0, 0.0  # planned: the compiles run in parallel, calls in turn
        for name, (fn, args) in programs.items():
            c, secs, temp = self.predict(name, dtype, seq)
            if max(compile_s, c) + calls_s + secs > self.left():
                why = f"time budget (~{c + secs:.0f} s, {self.left():.0f} s left)"
                rec[name] = {"skipped": why}
            elif temp > jax_free_bytes():
                rec[name] = {"skipped": f"memory (~{temp / harness.GIB:.0f} GiB predicted)"}
            else:
                try:
                    lowered[name] = jax.jit(fn).lower(*args)
                    compile_s, calls_s = max(compile_s, c), calls_s + secs
                except Exception as err:  # noqa: BLE001 - recorded, the others go on
                    rec[name] = {"error": describe_error(err)}
        with ThreadPoolExecutor(max(len(lowered), 1)) as pool:
            futures = {name: pool.submit(low.compile) for name, low in lowered.items()}
        batch = time.perf_counter() - t0
        log(f"  compiled {len(lowered)} programs in {batch:.1f} s")
        runs = {}
        for name, future in futures.items():
            try:
                compiled = future.result()
                mem = harness.memory(compiled)
                rec[name] = {"memory": mem}
                if needed_bytes(mem) > jax_free_bytes():
                    need, free = needed_bytes(mem) / harness.GIB, jax_free_bytes() / harness.GIB
                    rec[name]["skipped"] = f"memory ({need:.1f} GiB > {free:.1f} GiB free)"
                    continue
                run = harness.blocking(compiled, *programs[name][1])
                t1 = time.perf_counter()
                run()
                call_s = time.perf_counter() - t1
            except Exception as err:  # noqa: BLE001 - recorded in the table, the others go on
                rec[name] = dict(rec.get(name, {}), error=describe_error(err))
                log(f"  {name}: {rec[name]['error']}")
                free_memory()
                continue
            self.seen[(name, dtype)] = dict(
                seq=seq, compile_s=batch, call_s=call_s, temp=mem["temp"]
            )
            self.pending += (self.calls() - 1) * call_s
            log(f"  {name}: temp {mem['temp'] / harness.GIB:.2f} GiB, first call {call_s:.2f} s")
            runs[name] = run
        return runs

    def time_runs(self, runs: dict[str, Callable], rec: dict, dtype: str = "") -> None:
        """Interleaved rounds of the runs that compiled; medians and minima into ``rec``
        (and the minimum into the predictions of later steps)."""
        if not runs:
            self.pending = 0.0
            return
        try:
            times = harness.interleaved(runs, self.args.reps, settle=self.args.settle)
        except Exception as err:  # noqa: BLE001
            why = describe_error(err)
            log(f"  interleaved rounds failed: {why}")
            for name in runs:
                rec[name] = dict(rec.get(name, {}), error=why)
            return
        finally:
            self.pending = 0.0
        for name, t in times.items():
            rec[name] = dict(rec.get(name, {}), **harness.summary(t))
            seen = self.seen.get((name, dtype))
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
        """All implementations at one dtype and S (see the module docstring, item 2)."""
        jlayer = cast(layer, DTYPES[dtype_name])
        x_np = np.random.default_rng(0).normal(size=(1, seq, jlayer.config.hidden_size))
        x_np = x_np.astype(np.float32)
        x = jnp.asarray(x_np, DTYPES[dtype_name])
        rec: dict = dict(dtype=dtype_name, seq=seq, runs={})
        self.res["layers"].append(rec)
        kernels = jlayer.with_execution(KERNELS)
        xla = jlayer.with_execution(xla_execution(jlayer.config, seq))
        programs = layer_speed.jax_layer_programs(kernels, x)
        for name, program in layer_speed.jax_layer_programs(xla, x).items():
            if name.startswith("csa_eqx"):
                programs[name.replace("csa_eqx", "csa_eqx XLA")] = program
        programs["selection stage XLA"] = (layer_speed.selection_stage, (xla, x))
        programs = {name: programs[name] for name in PRIORITY}
        not_timed = kernels_not_timed(self.res["meta"]["backend"])
        if not_timed:
            for name in KERNEL_RUNS:
                del programs[name]
                rec["runs"][name] = {"skipped": not_timed}
        runs = self.compile_runs(programs, dtype_name, seq, rec["runs"])
        self.save()
        if torch_layer is not None:
            runs |= self.hf_runs(torch_layer, hf_config, hf, dtype_name, x_np, rec)
        self.time_runs(runs, rec["runs"], dtype_name)
        stats = jax.devices()[0].memory_stats() or {}
        rec["jax_peak_bytes"] = stats.get("peak_bytes_in_use")
        c = jlayer.config
        rec["indexer_flops"] = layer_speed.indexer_flops(1, seq, c)
        check = seq == self.mode["seqs"][0] and dtype_name == "float32" and torch_layer is not None
        if check and self.left() < 30:
            self.skip(f"HF output check S={seq}", f"time budget ({self.left():.0f} s left)")
        elif check:
            try:
                checked = xla if not_timed else kernels  # the layer's output, by the timed path
                rec["hf_check"] = layer_speed.output_check(torch_layer, hf_config, checked, x)
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
            _, secs, peak = self.predict(name, dtype_name, seq)
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
            self.pending += (self.calls() - 1) * call_s
            runs[name] = lambda fn=fn: (fn(), sync())
        return runs

    def anchor(self) -> None:
        a = self.mode["anchor"]
        seq, heads, dim, k = a["seq"], a["heads"], a["dim"], a["k"]
        q, w, keys = anchor_inputs(seq, heads, dim)
        rec: dict = dict(a, runs={})
        self.res["anchor"] = rec
        strategies = {"indexer": ce.PallasSelection(), "indexer XLA": ce.StreamingSelection()}
        backend = self.res["meta"]["backend"]
        if backend not in ("gpu", "cpu"):  # a CPU runs the fused kernel interpreted (--quick)
            del strategies["indexer"]
            rec["runs"]["indexer"] = {"skipped": kernels_not_timed(backend)}
        programs = {
            name: (lambda q, w, keys, st=strategy: anchor_select(q, w, keys, k, st), (q, w, keys))
            for name, strategy in strategies.items()
        }
        runs = self.compile_runs(programs, "bfloat16", seq, rec["runs"])
        if not runs:
            return
        self.time_runs(runs, rec["runs"], "bfloat16")
        pairs = seq * (seq + 1) / 2
        rec["flops"] = dict(visible=scoring_flops(pairs, heads, dim))
        self.save()
        if self.left() < 30:
            self.skip("anchor exactness check", f"time budget ({self.left():.0f} s left)")
            return
        rec["checked"] = "indexer" if "indexer" in runs else "indexer XLA"
        try:
            ours = runs[rec["checked"]]()
            dense = jax.jit(lambda q, w, keys: anchor_dense(q, w, keys, k))(q, w, keys)
            same = np.asarray(jnp.all(ours == dense, axis=-1))
            rec["same_rows_as_dense"] = float(same.mean())
        except Exception as err:  # noqa: BLE001
            rec["same_rows_as_dense"] = describe_error(err)

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


def plan(seqs, dtypes, tiles: bool) -> list[tuple]:
    """Steps in priority order: GEMM; every dtype at the shortest S; the first dtype at the
    other S up to ``LARGEST_MAIN_SEQ``; the anchor; the other dtypes there; longer S last."""
    main = sorted(s for s in seqs if s <= LARGEST_MAIN_SEQ)
    extra = sorted(s for s in seqs if s > LARGEST_MAIN_SEQ)
    steps: list[tuple] = [("gemm",)]
    steps += [("layer", d, main[0]) for d in dtypes] if main else []
    steps += [("layer", dtypes[0], s) for s in main[1:]]
    steps += [("anchor",)]
    steps += [("layer", d, s) for s in main[1:] for d in dtypes[1:]]
    steps += [("layer", d, s) for s in extra for d in dtypes]
    return steps + ([("tiles",)] if tiles else [])


# --- markdown ----------------------------------------------------------------------------------


def ms(v: dict | None, key: str = "median") -> str:
    """A run's time in ms, or why it has none."""
    if not v:
        return "-"
    if key in v:
        return f"{v[key] * 1e3:.2f}"
    return v.get("error") or v.get("skipped") or "-"


def cell(v: dict | None) -> str:
    """'median (min)' in ms, or why there is none."""
    return f"{ms(v)} ({ms(v, 'min')})" if v and "min" in v else ms(v)


def ratio(num: dict | None, den: dict | None) -> str:
    if not num or not den or "median" not in num or "median" not in den:
        return "-"
    return f"{num['median'] / den['median']:.2f}x"


def gib(v: dict | None) -> str:
    if not v or "memory" not in v:
        return "-"
    return f"{v['memory']['temp'] / harness.GIB:.3f}"


def gemm_rate(res: dict, dtype_name: str) -> float | None:
    return res["gemm"].get(GEMM_OF[dtype_name], {}).get("tflops_best")


def markdown(res: dict) -> str:
    """The whole result as markdown (rewritten after every step)."""
    m, hf = res["meta"], res["hf"]
    lines = [
        "# csa_eqx accelerator benchmark",
        "",
        harness.machine_markdown(m) if m else "",
        f"- XLA_PYTHON_CLIENT_PREALLOCATE={m.get('xla_preallocate')}, "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={m.get('xla_mem_fraction')}; global "
        f"jax_default_matmul_precision: {m.get('jax_default_matmul_precision')}",
        "- HF transformers layer: "
        + (
            f"torch {hf.get('torch')} on {hf.get('device')} ({hf.get('gpu', 'CPU')})"
            if hf.get("ok")
            else f"not run: {hf.get('why')}"
        ),
        f"- Mode: {res['mode']}; layer: {res['layer']}; B = 1. Times: median (min) in ms of "
        f"{res['reps']} interleaved rounds, each timed call after {res['settle']} untimed "
        f"call(s) of the same run, after two warm-up calls. Time budget {res['budget_s']:.0f} s.",
        "",
        "```",
        str(m.get("nvidia_smi", "")),
        "```",
        "",
    ]
    if res["gemm"]:
        rows = [
            [name, cell(v), f"{v['tflops_best']:.3g}" if "tflops_best" in v else "-"]
            for name, v in res["gemm"].items()
        ]
        n = next((v["n"] for v in res["gemm"].values() if "n" in v), "?")
        lines += [f"## GEMM rate (`jnp.dot`, {n} x {n})", ""]
        lines += [harness.table(["dtype", "ms", "TFLOP/s (best)"], rows), ""]
    layers = sorted(res["layers"], key=lambda r: (r["seq"], r["dtype"]))
    if layers:
        lines += speed_tables(layers) + selection_table(res, layers) + memory_table(layers)
        lines += checks(layers)
    if res["anchor"]:
        lines += anchor_lines(res)
    if any("profile" in r for r in layers):
        lines += profile_lines(layers)
    if res["tiles"]:
        lines += ["## Selection stage vs streaming key tile (bf16)", ""]
        for r in res["tiles"]:
            names = list(r["runs"])
            lines += [
                harness.table(["S"] + names, [[r["seq"]] + [cell(r["runs"][k]) for k in names]])
            ]
        lines.append("")
    if res["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s}" for s in res["skipped"]] + [""]
    lines.append(f"Total wall time of the script: {res['elapsed_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def speed_tables(layers: list[dict]) -> list[str]:
    header = ["S", "dtype"]
    for _, label in IMPLEMENTATIONS:
        header += [f"{label} fwd", f"{label} fwd+bwd"]
    header += [
        "kernels' speed-up vs naive (fwd / fwd+bwd)",
        "vs csa_eqx XLA (fwd / fwd+bwd)",
        "vs HF eager (fwd / fwd+bwd)",
    ]
    rows = []
    for r in layers:
        t = r["runs"]
        row = [r["seq"], r["dtype"]]
        for key, _ in IMPLEMENTATIONS:
            row += [cell(t.get(f"{key} fwd")), cell(t.get(f"{key} fwd+bwd"))]
        for key in ("naive", "csa_eqx XLA", "HF eager"):
            row.append(
                " / ".join(
                    ratio(t.get(f"{key} {p}"), t.get(f"csa_eqx {p}")) for p in ("fwd", "fwd+bwd")
                )
            )
        rows.append(row)
    return ["## Layer wall time, ms: median (min)", "", harness.table(header, rows), ""]


def selection_table(res: dict, layers: list[dict]) -> list[str]:
    rows = []
    for r in layers:
        flops = r.get("indexer_flops", {})
        rate = gemm_rate(res, r["dtype"])
        for name, path in SELECTIONS:
            sel = r["runs"].get(name)
            cells = ["-", "-", "-"]
            if sel and "min" in sel and flops:
                visible = flops["visible"] / sel["min"] / 1e12
                full = flops["with_projections"] / sel["min"] / 1e12
                cells = [
                    f"{visible:.3g}",
                    f"{visible / rate:.1%}" if rate else "-",
                    f"{full / rate:.1%}" if rate else "-",
                ]
            gflop = f"{flops.get('visible', 0) / 1e9:.4g}"
            rows.append([r["seq"], r["dtype"], path, cell(sel), gflop] + cells)
    header = [
        "S", "dtype", "path", "selection stage ms", "visible-pair scoring GFLOP", "TFLOP/s",
        "of the GEMM rate (same dtype)", "counting the stage's projections too",
    ]  # fmt: skip
    return [
        "## Selection stage alone (compressor, indexer queries, scoring, top-k)",
        "",
        "Paths: the fused Pallas indexer (`PallasSelection`) and the XLA streaming selection. "
        "GEMM rate: bf16 rows against the bf16 GEMM, fp32 rows against the true-fp32 GEMM.",
        "",
        harness.table(header, rows),
        "",
    ]


def memory_table(layers: list[dict]) -> list[str]:
    names = [
        "csa_eqx fwd", "csa_eqx fwd+bwd", "selection stage", "csa_eqx XLA fwd",
        "csa_eqx XLA fwd+bwd", "selection stage XLA", "naive fwd", "naive fwd+bwd",
    ]  # fmt: skip
    rows = [[r["seq"], r["dtype"]] + [gib(r["runs"].get(n)) for n in names] for r in layers]
    peaks = [
        f"S={r['seq']} {r['dtype']}: JAX peak {r['jax_peak_bytes'] / harness.GIB:.1f} GiB"
        for r in layers
        if r.get("jax_peak_bytes")
    ]
    lines = [
        "## Compiled temp memory of the timed programs, GiB (XLA `memory_analysis`)",
        "",
        harness.table(["S", "dtype"] + names, rows),
        "",
    ]
    return lines + ([f"Device memory so far: {'; '.join(peaks)}.", ""] if peaks else [])


def checks(layers: list[dict]) -> list[str]:
    lines = []
    for r in layers:
        c = r.get("hf_check")
        if c and "same_rows" in c:
            lines += [
                f"Output check vs HF (S = {r['seq']}, {r['dtype']}; csa_eqx with the Pallas "
                "kernels on a GPU, its XLA path on a CPU; HF on the CPU in float32, same weights "
                f"and input): {c['same_rows']:.2%} of query rows pick the same "
                f"top-k set; on them max |ours - HF| / max |HF| = {c['err_same']:.1e} (all rows "
                f"{c['err']:.1e}).",
                "",
            ]
        elif c:
            lines += [f"Output check vs HF failed: {c['error']}", ""]
    return lines


def anchor_lines(res: dict) -> list[str]:
    a = res["anchor"]
    lines = [
        f"## Anchor: indexer alone, Q = K = {a['seq']} token keys, {a['heads']} heads x "
        f"{a['dim']}, k = {a['k']}, bf16, causal (V3.2-style)",
        "",
    ]
    rate = gemm_rate(res, "bfloat16")
    for name, label in (("indexer", "Fused kernel"), ("indexer XLA", "XLA streaming")):
        run = a["runs"].get(name)
        line = f"{label}: {cell(run)} ms." if run and "min" in run else f"{label}: {ms(run)}."
        if run and "min" in run:
            best = run["min"] * 1e3
            if a.get("reference_ms"):
                ref = a["reference_ms"]
                line += f" Reference kernel {ref} ms: {best / ref:.2f}x."
            tflops = a["flops"]["visible"] / run["min"] / 1e12
            frac = f", {tflops / rate:.1%} of the bf16 GEMM rate" if rate else ""
            line += (
                f" Visible-pair scoring: {a['flops']['visible'] / 1e12:.3g} TFLOP, "
                f"{tflops:.3g} TFLOP/s{frac}."
            )
        lines.append(line)
    same = a.get("same_rows_as_dense")
    if same is not None:
        text = f"{same:.2%}" if isinstance(same, float) else same
        which = "XLA streaming" if a.get("checked") == "indexer XLA" else "kernel"
        lines.append(
            f"Rows whose {which} picks equal the dense (materialised-score) path's: {text}."
        )
    return lines + [""]


def profile_lines(layers: list[dict]) -> list[str]:
    lines = ["## Profiles (one call each, bf16)", ""]
    for r in layers:
        p = r.get("profile")
        if not p:
            continue
        if "error" in p:
            lines += [f"S = {r['seq']}: {p['error']}", ""]
            continue
        where = "device kernels" if p["device_events"] else "XLA ops (no device events)"
        lines += [f"### S = {r['seq']}: {where}; trace: {p['saved']}", ""]
        for module, v in p["programs"].items():
            lines += [
                f"`{module}`: {v['kernels']} launches of {v['distinct']} kernels, "
                f"{v['busy_ms']:.2f} ms busy.",
                "",
            ]
            rows = [[t["name"], t["calls"], f"{t['ms']:.3f}"] for t in v["top"]]
            lines += [harness.table(["kernel", "calls", "ms"], rows), ""]
    return lines


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the .md and .json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a CPU smoke test")
    parser.add_argument("--allow-cpu", action="store_true", help="full sizes on a CPU backend")
    parser.add_argument("--budget", type=float, default=400, help="seconds for all steps")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--settle", type=int, default=1, help="untimed calls before each timed")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--gemm-n", type=int, help="GEMM matrix side (default 8192)")
    parser.add_argument("--no-hf", action="store_true", help="skip torch and transformers")
    parser.add_argument("--no-anchor", action="store_true", help="skip the indexer anchor")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler traces")
    parser.add_argument("--tiles", action="store_true", help="add the key-tile sweep (last)")
    args = parser.parse_args()
    mode = dict(MODES["quick" if args.quick else "full"])
    if args.seqs:
        mode["seqs"] = tuple(args.seqs)
    if args.gemm_n:
        mode["gemm_n"] = args.gemm_n
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, mode)
    res = bench.res
    res["meta"] = machine()  # initialises JAX's backend before torch loads its CUDA libraries
    hf = dict(ok=False, why="--no-hf") if args.no_hf else torch_setup(args.quick or args.allow_cpu)
    res["hf"] = hf
    config = harness.speed_layer(args.quick)
    res["layer"] = (
        f"hidden {config.hidden_size}, {config.num_heads} heads x {config.head_dim}, indexer "
        f"{config.index_n_heads} heads x {config.index_head_dim}, k = {config.index_topk}, "
        f"m = {config.compress_rate}, window {config.sliding_window}"
    )
    log(f"{res['meta']}\nHF: {hf}")
    bench.save()
    if res["meta"]["backend"] == "cpu" and not (args.quick or args.allow_cpu):
        log("JAX found no accelerator: stopping (use --quick, or --allow-cpu to insist)")
        raise SystemExit(2)
    if hf["ok"]:
        torch_layer, hf_config, layer = layer_speed.hf_and_ours(config)
    else:
        torch_layer, hf_config, layer = None, None, V4Attention(config, key=jax.random.key(0))
    for step in plan(mode["seqs"], args.dtypes, args.tiles):
        what = " ".join(map(str, step))
        if step[0] == "anchor" and args.no_anchor:
            continue
        if bench.left() <= 0:
            bench.skip(what, "time budget")
            continue
        log(f"{what} ({bench.left():.0f} s left)")
        if step[0] == "gemm":
            bench.gemm()
        elif step[0] == "layer":
            with precision(step[1]):
                bench.layer(step[1], step[2], layer, torch_layer, hf_config, hf)
        elif step[0] == "anchor":
            bench.anchor()
        else:
            bench.tiles(layer)
        free_memory()
        jax.clear_caches()
        bench.save()
    bench.save()
    log(f"done in {res['elapsed_s']:.0f} s")
    print(markdown(res), flush=True)


if __name__ == "__main__":
    main()
