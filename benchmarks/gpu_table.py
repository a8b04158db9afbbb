"""One-shot accelerator benchmark: V4 CSA layer wall time, GEMM throughput and compiled memory.

For a single run on a GPU machine (it also runs on CPU, see ``--quick``). Sections, each
written to ``OUT/gpu_table.md`` and ``OUT/gpu_table.json`` as soon as it finishes:

* GEMM throughput: ``jnp.dot`` of two square matrices in float32 at ``'highest'`` matmul
  precision (true fp32), float32 at the default precision (XLA may use TF32 on GPU) and bfloat16.
* Layer wall time (``benchmarks/layer_speed.py``'s layer and weights) for each sequence length,
  in float32 (JAX under ``jax.default_matmul_precision('highest')``, torch with TF32 off) and
  bfloat16 (every float parameter and the input cast): csa_eqx (jit) and the naive dense-mask
  baseline, fwd and fwd+bwd, the indexer's selection stage alone, and HF transformers'
  ``DeepseekV4Attention`` eager in torch. Repetitions are interleaved; a run that fails (out of
  memory, say) is recorded as such and the others go on.
* Compiled temp memory of fwd+bwd (``benchmarks/layer_memory.py``), nothing runs.

    python -m benchmarks.gpu_table --out DIR [--quick] [--reps 5] [--budget 300]
        [--seqs 4096 16384] [--mem-seqs 4096 8192 ...]
"""

from __future__ import annotations

import os

# Before jax is imported: JAX and torch share the GPU, so JAX must not grab 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from csa_eqx import Execution, V4Attention  # noqa: E402

from . import layer_memory, layer_speed  # noqa: E402
from .naive_baseline import naive_v4_csa  # noqa: E402

GIB = 1 << 30
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Sizes per mode: timed sequence lengths, memory lengths (csa_eqx, naive), GEMM side.
FULL = dict(seqs=(4096, 16384), mem=(4096, 8192, 16384, 32768, 65536), naive_mem=16384, n=8192)
QUICK = dict(seqs=(256,), mem=(256, 512), naive_mem=256, n=256)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def describe_error(err: BaseException) -> str:
    """'OOM' for an out-of-memory error of either framework, else the error's first line."""
    text = f"{type(err).__name__}: {err}"
    if any(s in text for s in ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemory")):
        return "OOM"
    return text.splitlines()[0][:200]


def torch_setup(cpu_ok: bool) -> dict:
    """torch, transformers and the device the HF layer runs on (the CPU only if ``cpu_ok``), or
    why it cannot run."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - ImportError, or a CUDA library that fails to load
        return dict(ok=False, why=f"torch not importable ({describe_error(err)})")
    info = dict(ok=True, torch=torch.__version__, cuda=torch.cuda.is_available())
    try:
        import transformers
        from transformers.models.deepseek_v4 import modeling_deepseek_v4  # noqa: F401

        info["transformers"] = transformers.__version__
    except Exception as err:  # noqa: BLE001
        why = f"transformers has no DeepseekV4Attention ({describe_error(err)})"
        return dict(info, ok=False, why=why)
    if info["cuda"]:
        info.update(device="cuda", gpu=torch.cuda.get_device_name(0))
    elif cpu_ok:
        info["device"] = "cpu"
    else:
        return dict(info, ok=False, why="torch has no CUDA device; HF eager skipped")
    # True fp32 in the float32 table (these are torch's defaults, set to be sure).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if info["device"] == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    return info


def machine() -> dict:
    """Accelerator, driver and library versions of this run."""
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(),
        jax=jax.__version__,
        backend=jax.default_backend(),
        jax_device=jax.devices()[0].device_kind,
        cpus=os.cpu_count(),
        jax_default_matmul_precision=str(jax.config.jax_default_matmul_precision),
        xla_preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
    )
    try:
        meta["jax_env"] = jax.print_environment_info(return_string=True)
    except Exception as err:  # noqa: BLE001
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


def precision(dtype_name: str):
    """True fp32 matmuls for the float32 runs; the default precision for bfloat16."""
    if dtype_name == "float32":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def guarded(runs: dict[str, Callable]) -> tuple[dict[str, Callable], dict[str, str]]:
    """Call each run once (compile + first warm-up); keep those that succeed, and the errors."""
    ok, failed = {}, {}
    for name, fn in runs.items():
        start = time.perf_counter()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - recorded in the table, the others go on
            failed[name] = describe_error(err)
            log(f"  {name}: {failed[name]}")
            free_memory()
            continue
        ok[name] = fn
        log(f"  {name}: first call {time.perf_counter() - start:.1f} s")
    return ok, failed


def free_memory() -> None:
    """Collect garbage and hand torch's cached CUDA blocks back (JAX keeps its pool)."""
    gc.collect()
    torch = sys.modules.get("torch")  # only if the HF layer imported it
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(runs: dict[str, Callable], reps: int) -> dict:
    """Two warm-up calls (one in ``guarded``) and ``reps`` interleaved rounds per run."""
    ok, failed = guarded(runs)
    out: dict = {name: {"error": why} for name, why in failed.items()}
    try:
        times = layer_speed.interleaved(ok, reps)
    except Exception as err:  # noqa: BLE001
        why = describe_error(err)
        log(f"  interleaved rounds failed: {why}")
        return out | {name: {"error": why} for name in ok}
    for name, t in times.items():
        out[name] = dict(median=statistics.median(t), min=min(t))
    return out


def gemm_section(n: int, reps: int) -> dict:
    """Seconds and TFLOP/s of an ``n x n`` ``jnp.dot``: fp32 highest, fp32 default, bf16."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)

    def dot_at(prec, x, y):
        f = jax.jit(lambda x, y: jnp.dot(x, y, precision=prec))
        return lambda: jax.block_until_ready(f(x, y))

    runs = {
        "float32 (precision highest)": dot_at(jax.lax.Precision.HIGHEST, a, b),
        "float32 (default precision)": dot_at(None, a, b),
        "bfloat16": dot_at(None, a16, b16),
    }
    res = timed(runs, reps)
    for v in res.values():
        if "min" in v:
            v["tflops_best"] = 2 * n**3 / v["min"] / 1e12
            v["tflops_median"] = 2 * n**3 / v["median"] / 1e12
    return dict(n=n, runs=res)


def build_layers(quick: bool, hf: dict):
    """(csa_eqx layer, torch layer or None, HF config or None): the same weights in both."""
    if hf["ok"]:
        cfg = layer_speed.hf_config(layer_speed.QUICK_SIZES if quick else layer_speed.SIZES)
        torch_layer = layer_speed.hf_layer(cfg)
        state = {k: v.detach().numpy() for k, v in torch_layer.state_dict().items()}
        from csa_eqx.hf import load_v4_attention

        return load_v4_attention(state, cfg, 0), torch_layer, cfg
    return V4Attention(memory_config(quick), key=jax.random.key(0)), None, None


def memory_config(quick: bool):
    """``layer_memory.CONFIG``; in quick mode with ``layer_speed.QUICK_SIZES``'s indexer."""
    if not quick:
        return layer_memory.CONFIG
    q = layer_speed.QUICK_SIZES
    return dataclasses.replace(
        layer_memory.CONFIG,
        index_n_heads=q["index_n_heads"],
        index_head_dim=q["index_head_dim"],
        index_topk=q["index_topk"],
        sliding_window=q["sliding_window"],
    )


def cast(layer, dtype):
    """Every float array of ``layer`` in ``dtype`` (as torch's ``module.to(dtype)`` does)."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, layer)


def hf_runs(torch_layer, cfg, device: str, dtype_name: str, x_np: np.ndarray):
    """A ``device``/``dtype_name`` copy of the HF layer and its synchronised fwd, fwd+bwd runs."""
    import torch

    tdtype = getattr(torch, dtype_name)
    # A copy: the float32 master weights on the CPU stay as loaded into the csa_eqx layer.
    tl = copy.deepcopy(torch_layer).to(device=device, dtype=tdtype)
    hf_f, hf_fb = layer_speed.hf_runner(tl, cfg, x_np, device=device, dtype=tdtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = {"HF eager fwd": lambda: (hf_f(), sync()), "HF eager fwd+bwd": lambda: (hf_fb(), sync())}
    return tl, hf_f, runs


def layer_section(
    layer, torch_layer, cfg, hf: dict, dtype_name: str, seq: int, reps: int, check: bool
) -> dict:
    """Wall times of every implementation at one dtype and sequence length; with ``check``
    (float32 only) also ``layer_speed.output_check`` against the HF layer."""
    jlayer = cast(layer, DTYPES[dtype_name])
    x_np = np.random.default_rng(0).normal(size=(1, seq, jlayer.config.hidden_size))
    x_np = x_np.astype(np.float32)
    x = jnp.asarray(x_np, DTYPES[dtype_name])
    runs = layer_speed.jax_layer_runs(jlayer, x)
    hf_check, on_cuda = None, torch_layer is not None and hf["device"] == "cuda"
    if torch_layer is not None:
        tl, hf_f, more = hf_runs(torch_layer, cfg, hf["device"], dtype_name, x_np)
        runs |= more
        if check and dtype_name == "float32":
            try:
                hf_check = layer_speed.output_check(tl, hf_f, jlayer, x)
                log(f"  output check vs HF: {hf_check}")
            except Exception as err:  # noqa: BLE001
                hf_check = {"error": describe_error(err)}
    if on_cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
    times = timed(runs, reps)
    stats = jax.devices()[0].memory_stats() or {}
    peaks = {"jax process peak so far": stats.get("peak_bytes_in_use")}
    if on_cuda:
        peaks["torch this section"] = torch.cuda.max_memory_allocated()
    c = jlayer.config
    return dict(
        dtype=dtype_name,
        seq=seq,
        matmul_precision=str(jax.config.jax_default_matmul_precision),
        times=times,
        indexer_flops=layer_speed.indexer_flops(1, seq, c),
        hf_check=hf_check,
        peak_bytes=peaks,
    )


TILE_KEY_BLOCKS = (0, 512, 1024, 2048)  # indexer_key_block values tried (0 = automatic)


def tiles_section(layer, dtype_name: str, seq: int, reps: int) -> dict:
    """The selection stage alone at several ``indexer_key_block`` values (query blocks and row
    buffers automatic): which streaming tile suits this machine."""
    jlayer = cast(layer, DTYPES[dtype_name])
    x = jax.random.normal(jax.random.key(0), (1, seq, jlayer.config.hidden_size))
    x = x.astype(DTYPES[dtype_name])
    runs = {}
    for kb in TILE_KEY_BLOCKS:
        variant = jlayer.with_execution(Execution.from_options(indexer_key_block=kb))
        select = jax.jit(layer_speed.selection_stage)
        runs[f"key_block={kb or 'auto'}"] = lambda select=select, variant=variant: (
            jax.block_until_ready(select(variant, x))
        )
    return dict(dtype=dtype_name, seq=seq, times=timed(runs, reps))


def memory_section(quick: bool, sizes: dict, deadline: float) -> list[dict]:
    """Compiled fwd+bwd temp bytes of csa_eqx (and naive up to ``sizes['naive_mem']``)."""
    config, rows = memory_config(quick), []
    for seq in sizes["mem"]:
        row: dict = dict(seq=seq)
        variants = [("csa_eqx", lambda m, x: m(x))]
        if seq <= sizes["naive_mem"]:
            variants.append(("naive", naive_v4_csa))
        for name, forward in variants:
            if time.perf_counter() > deadline:
                row[name] = {"error": "skipped (time budget)"}
                continue
            try:
                temp, secs = layer_memory.fwd_bwd_temp_bytes(config, forward, seq)
                row[name] = dict(temp_bytes=temp, compile_s=secs)
            except Exception as err:  # noqa: BLE001
                row[name] = {"error": describe_error(err)}
            log(f"  memory S={seq} {name}: {row[name]}")
        rows.append(row)
    return rows


def fmt_time(v: dict | None, key: str) -> str:
    if v is None:
        return "-"
    return f"{v[key] * 1e3:.2f}" if key in v else v["error"]


def ratio(num: dict | None, den: dict | None, key: str) -> str:
    if num is None or den is None or key not in num or key not in den:
        return "-"
    return f"{num[key] / den[key]:.2f}x"


def layer_markdown(r: dict, gemm: dict) -> list[str]:
    t = r["times"]
    head = f"### {r['dtype']}, B = 1, S = {r['seq']}"
    if r["dtype"] == "float32":
        head += " (JAX matmul precision 'highest', torch TF32 off: true fp32)"
    lines = [
        head,
        "",
        "| implementation | fwd median (ms) | fwd min (ms) | fwd+bwd median (ms) "
        "| fwd+bwd min (ms) | csa_eqx speed-up fwd / fwd+bwd (median) |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("csa_eqx", "csa_eqx (jit)"),
        ("naive", "naive dense-mask (JAX jit)"),
        ("HF eager", "HF transformers eager (torch)"),
    ):
        f, fb = t.get(f"{key} fwd"), t.get(f"{key} fwd+bwd")
        if f is None and fb is None:
            continue
        up = "-"
        if key != "csa_eqx":
            up = (
                f"{ratio(f, t.get('csa_eqx fwd'), 'median')} / "
                f"{ratio(fb, t.get('csa_eqx fwd+bwd'), 'median')}"
            )
        lines.append(
            f"| {label} | {fmt_time(f, 'median')} | {fmt_time(f, 'min')} | "
            f"{fmt_time(fb, 'median')} | {fmt_time(fb, 'min')} | {up} |"
        )
    sel = t.get("selection stage", {})
    gemm_key = "float32 (precision highest)" if r["dtype"] == "float32" else "bfloat16"
    best = gemm.get("runs", {}).get(gemm_key, {}).get("tflops_best")
    if "min" in sel:
        lines += [
            "",
            f"Selection stage alone (compressor, indexer queries, scoring, top-k): "
            f"{sel['median'] * 1e3:.2f} ms median, {sel['min'] * 1e3:.2f} ms min.",
            "",
            f"| indexer FLOPs counted | GFLOP | achieved TFLOP/s (min time) "
            f"| fraction of best {gemm_key} GEMM |",
            "|---|---|---|---|",
        ]
        for key, label in layer_speed.FLOP_ROWS:
            flops = r["indexer_flops"][key]
            rate = flops / sel["min"] / 1e12
            frac = f"{rate / best:.1%}" if best else "-"
            lines.append(f"| {label} | {flops / 1e9:.4g} | {rate:.3g} | {frac} |")
    elif sel:
        lines += ["", f"Selection stage alone: {sel.get('error')}"]
    c = r.get("hf_check")
    if c and "same_rows" in c:
        lines += [
            "",
            f"Output check vs HF (same weights and input): {c['same_rows']:.2%} of query rows "
            f"pick the same top-k set; on them max |ours - HF| / max |HF| = {c['err_same']:.1e} "
            f"(all rows {c['err']:.1e}).",
        ]
    elif c:
        lines += ["", f"Output check vs HF failed: {c['error']}"]
    known = {k: v for k, v in r.get("peak_bytes", {}).items() if v is not None}
    if known:
        cells = ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in known.items())
        lines += ["", f"Device memory peaks: {cells}."]
    return lines + [""]


def markdown(res: dict) -> str:
    """The whole result as markdown."""
    m, hf = res["meta"], res["hf"]
    lines = [
        "# csa_eqx accelerator benchmark",
        "",
        f"Date: {m['date']}. JAX {m['jax']} (backend {m['backend']}, device "
        f"{m['jax_device']}), Python {m['python']}, {m['cpus']} CPU cores. "
        f"XLA_PYTHON_CLIENT_PREALLOCATE={m['xla_preallocate']}. "
        f"Global jax_default_matmul_precision: {m['jax_default_matmul_precision']}.",
        "",
        "```",
        m["nvidia_smi"],
        "",
        m.get("jax_env", ""),
        "```",
        "",
        "HF transformers layer: "
        + (
            f"torch {hf.get('torch')}, transformers {hf.get('transformers')}, on "
            f"{hf.get('device')} ({hf.get('gpu', 'CPU')})."
            if hf["ok"]
            else f"not run: {hf['why']}."
        ),
        "",
        f"Mode: {'quick (tiny sizes, smoke test)' if res['quick'] else 'full'}; "
        f"{res['reps']} timed interleaved rounds after two warm-up calls per run; times in ms. "
        f"Layer: {res['sizes']}, compress rate {layer_speed.RATE}.",
        "",
    ]
    gemm = res.get("gemm")
    if gemm:
        lines += [
            f"## GEMM throughput (`jnp.dot`, {gemm['n']} x {gemm['n']})",
            "",
            "| dtype | median (ms) | min (ms) | TFLOP/s (median) | TFLOP/s (best) |",
            "|---|---|---|---|---|",
        ]
        for name, v in gemm["runs"].items():
            if "min" in v:
                lines.append(
                    f"| {name} | {v['median'] * 1e3:.2f} | {v['min'] * 1e3:.2f} | "
                    f"{v['tflops_median']:.1f} | {v['tflops_best']:.1f} |"
                )
            else:
                lines.append(f"| {name} | {v['error']} | | | |")
        lines.append("")
    if res["layer"]:
        lines += ["## Layer wall time (V4 CSA layer)", ""]
        for r in res["layer"]:
            lines += layer_markdown(r, gemm or {})
    if res.get("tiles"):
        lines += [
            "## Selection stage vs streaming key tile (`indexer_key_block`)",
            "",
            "| dtype | S | "
            + " | ".join(f"key_block={kb or 'auto'} (ms)" for kb in TILE_KEY_BLOCKS)
            + " |",
            "|---|---|" + "---|" * len(TILE_KEY_BLOCKS),
        ]
        for r in res["tiles"]:
            cells = [
                fmt_time(r["times"].get(f"key_block={kb or 'auto'}"), "min")
                for kb in TILE_KEY_BLOCKS
            ]
            lines.append(f"| {r['dtype']} | {r['seq']} | " + " | ".join(cells) + " |")
        lines += ["", "(min over the timed rounds; automatic = 128-entry tiles)", ""]
    if res["memory"]:
        lines += [
            "## Compiled temp memory of fwd+bwd (float32, `memory_analysis`, nothing runs)",
            "",
            "| S | csa_eqx (GiB) | naive dense-mask (GiB) | compile s (csa_eqx / naive) |",
            "|---|---|---|---|",
        ]
        for row in res["memory"]:
            cells, secs = [], []
            for name in ("csa_eqx", "naive"):
                v = row.get(name)
                cells.append(
                    "-" if v is None else v.get("error", f"{v.get('temp_bytes', 0) / GIB:.3f}")
                )
                secs.append("-" if v is None or "compile_s" not in v else f"{v['compile_s']:.0f}")
            lines.append(f"| {row['seq']} | {cells[0]} | {cells[1]} | {' / '.join(secs)} |")
        lines.append("")
    if res["skipped"]:
        lines += ["Skipped (time budget): " + ", ".join(res["skipped"]), ""]
    lines.append(f"Total wall time of the script: {res['elapsed_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the .md and .json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a CPU smoke test")
    parser.add_argument("--allow-cpu", action="store_true", help="full sizes on a CPU backend")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--seqs", type=int, nargs="+", help="timed sequence lengths")
    parser.add_argument("--mem-seqs", type=int, nargs="+", help="compiled-memory lengths")
    parser.add_argument("--gemm-n", type=int, help="GEMM matrix side")
    parser.add_argument("--no-hf", action="store_true", help="skip torch and transformers")
    parser.add_argument("--no-tiles", action="store_true", help="skip the key-tile comparison")
    parser.add_argument(
        "--budget",
        type=float,
        default=300,
        help="seconds after which no layer section starts (memory items: 90 s more)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.budget
    sizes = dict(QUICK if args.quick else FULL)
    sizes.update({k: tuple(v) for k, v in (("seqs", args.seqs), ("mem", args.mem_seqs)) if v})
    sizes["n"] = args.gemm_n or sizes["n"]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = machine()  # initialises JAX's backend before torch loads its CUDA libraries
    hf = dict(ok=False, why="--no-hf") if args.no_hf else torch_setup(args.quick or args.allow_cpu)
    res: dict = dict(
        meta=meta,
        hf=hf,
        quick=args.quick,
        reps=args.reps,
        sizes=layer_speed.QUICK_SIZES if args.quick else layer_speed.SIZES,
        gemm=None,
        layer=[],
        tiles=[],
        memory=[],
        skipped=[],
        elapsed_s=0.0,
    )
    log(f"{res['meta']}\nHF: {hf}")

    def save() -> None:
        res["elapsed_s"] = time.perf_counter() - start
        (args.out / "gpu_table.json").write_text(json.dumps(res, indent=1, default=str))
        (args.out / "gpu_table.md").write_text(markdown(res))
        log(f"wrote {args.out}/gpu_table.md ({res['elapsed_s']:.0f} s elapsed)")

    save()
    if meta["backend"] == "cpu" and not (args.quick or args.allow_cpu):
        log("JAX found no accelerator: stopping (use --quick, or --allow-cpu to insist)")
        raise SystemExit(2)
    log(f"GEMM {sizes['n']}^3")
    res["gemm"] = gemm_section(sizes["n"], args.reps)
    save()
    layer, torch_layer, cfg = build_layers(args.quick, hf)
    for seq in sizes["seqs"]:
        for dtype_name in DTYPES:
            step = f"layer {dtype_name} S={seq}"
            if time.perf_counter() > deadline:
                res["skipped"].append(step)
                continue
            log(step)
            with precision(dtype_name):
                first = seq == sizes["seqs"][0]
                res["layer"].append(
                    layer_section(layer, torch_layer, cfg, hf, dtype_name, seq, args.reps, first)
                )
            free_memory()
            jax.clear_caches()
            save()
    for dtype_name in () if args.no_tiles else DTYPES:
        step = f"tiles {dtype_name} S={sizes['seqs'][-1]}"
        if time.perf_counter() > deadline:
            res["skipped"].append(step)
            continue
        log(step)
        with precision(dtype_name):
            try:
                res["tiles"].append(tiles_section(layer, dtype_name, sizes["seqs"][-1], args.reps))
            except Exception as err:  # noqa: BLE001
                res["skipped"].append(f"{step}: {describe_error(err)}")
        jax.clear_caches()
        save()
    log("compiled memory")
    with precision("float32"):
        # Compile-only and cheap: it may start items up to 90 s past the budget.
        res["memory"] = memory_section(args.quick, sizes, deadline + 90)
    save()
    print(markdown(res), flush=True)


if __name__ == "__main__":
    main()
