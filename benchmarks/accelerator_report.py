"""The accelerator table's report (``benchmarks/accelerator_table.py``): its records as
figures (the JSON page) and as the markdown page.

The JSON page is ``{"device", "jax", "date", "command", "figures", "skipped", "longest"}``: one
figure per measurement, ``{"name", "path", "dtype", "seq", "ms", ...}`` with ``name`` in
``FIGURE_NAMES`` and ``path`` in ``PATHS`` (``"kernel"``: a Pallas / Mosaic kernel class ran,
``"xla"``: XLA's strategies, ``"naive"``: the dense-mask layer); ``ms`` is the median (``None``
where the run was skipped or failed, with ``"skipped"`` or ``"error"`` saying why), beside it
``ms_min``, ``rounds``, ``temp_bytes`` (XLA's compiled temporaries), ``kernel_calls`` (Pallas
kernel calls in the program), ``strategies``, ``automatic`` (the run is the automatic choice's),
and per name: ``vs_naive`` (layer), ``tflops`` and ``gemm_fraction`` (selection stage, anchor:
visible-pair scoring in the minimum time), ``check`` (anchor: its picks against the blocked
``lax.top_k`` reference), ``model_tflop``, ``tflops``, ``mfu``, ``peak_tflops``,
``attention_ms`` and ``bytes_per_s``, ``flop_convention`` and, where the attention is the Mosaic
kernel, ``hardware_tflop``, ``hardware_tflops`` and ``hfu`` (released sizes;
``benchmarks/flops.py``), ``bytes`` (attention alone). ``longest``: the longest S each
released-size layer ran at, fwd and fwd+bwd. For ``gemm``, ``seq`` is the matrix side and
``precision`` says which float32.
"""

from __future__ import annotations

import json
from collections import defaultdict

from . import flops, harness

GEMM_OF = {"bfloat16": "bfloat16", "float32": "float32 (precision highest)"}
IMPLEMENTATIONS = (
    ("csa_eqx", "csa_eqx automatic"),
    ("csa_eqx XLA", "csa_eqx XLA"),
    ("naive", "naive dense-mask"),
    ("HF eager", "HF eager"),
)
SELECTIONS = (("selection stage", "automatic"), ("selection stage XLA", "XLA"))
FIGURE_NAMES = (
    "gemm", "layer_fwd", "layer_fwd_bwd", "selection_stage", "anchor",
    "v4_flash_csa_fwd", "v4_flash_csa_fwd_bwd", "v4_flash_csa_attention_fwd",
    "v4_flash_csa_attention_fwd_bwd", "v32_dsa_fwd", "v32_dsa_fwd_bwd",
    "v32_dsa_attention_fwd", "v32_dsa_attention_fwd_bwd",
)  # fmt: skip
PATHS = ("kernel", "xla", "naive")
FIGURE_KEYS = ("name", "path", "dtype", "seq", "ms")


def figure(name: str, path: str, dtype: str, seq: int, run: dict | None, **extra) -> dict:
    """One measurement: its median ``ms`` (``None`` where it was skipped or failed, with why),
    minimum, rounds and compiled temp bytes, and ``extra``. Its ``path`` is ``"kernel"`` also
    where its program calls a Pallas kernel (``kernel_calls``) whatever the strategies said."""
    run = run or {}
    path = "kernel" if run.get("kernel_calls") else path
    fig = dict(name=name, path=path, dtype=dtype, seq=seq, ms=median_ms(run))
    if "min" in run:
        fig.update(ms_min=run["min"] * 1e3, rounds=run.get("rounds"))
    if "memory" in run:
        fig.update(temp_bytes=run["memory"]["temp"], kernel_calls=run.get("kernel_calls"))
    for why in ("skipped", "error"):
        if why in run:
            fig[why] = run[why]
    return fig | extra


def median_ms(run: dict | None) -> float | None:
    """A run's median in ms, or None."""
    return run["median"] * 1e3 if run and "median" in run else None


def rate(amount: float, run: dict | None, key: str = "median") -> float | None:
    """``amount`` per second of ``run`` (its median, or ``key``'s time), or None."""
    return amount / run[key] if run and key in run else None


def automatic(runs: dict, name: str) -> dict | None:
    """The automatic choice's run ``name``, or the XLA path's run where that is the same."""
    run = runs.get(name)
    return runs.get(run["same_as"]) if run and "same_as" in run else run


def tflops(flop: float, run: dict | None, key: str = "median") -> float | None:
    """TFLOP/s of ``flop`` in ``run``'s median (or ``key``) time, or None."""
    per_s = rate(flop, run, key)
    return None if per_s is None else per_s / 1e12


def fraction(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def layer_figures(res: dict, r: dict) -> list[dict]:
    """The benchmark layer's figures at one S and dtype: the automatic choice's (where it is
    not the XLA path), the XLA path's and the naive layer's fwd and fwd+bwd, and the selection
    stages alone (visible-pair scoring TFLOP/s in the minimum time, and its fraction of the
    GEMM rate of the same dtype)."""
    runs, out, at = r["runs"], [], (r["dtype"], r["seq"])
    paths = [("csa_eqx", r["path"], r["strategies"]), ("csa_eqx XLA", "xla", r["xla_strategies"])]
    if r["automatic_is_xla"]:
        paths = paths[1:]  # the XLA path's runs are the automatic choice's
    for name, p in (("layer_fwd", "fwd"), ("layer_fwd_bwd", "fwd+bwd")):
        naive = runs.get(f"naive {p}")
        for key, path, strategies in paths:
            run = runs.get(f"{key} {p}")
            speedup = fraction(median_ms(naive), median_ms(run))
            automatic_run = key == "csa_eqx" or r["automatic_is_xla"]
            extra = dict(strategies=strategies, automatic=automatic_run, vs_naive=speedup)
            out.append(figure(name, path, *at, run, **extra))
        out.append(figure(name, "naive", *at, naive))
    gemm = gemm_rate(res, r["dtype"])
    for key, path, strategies in paths:
        run = runs.get(key.replace("csa_eqx", "selection stage"))
        rate_ = tflops(r["indexer_flops"]["visible"], run, "min")
        extra = dict(strategies=strategies, automatic=key == "csa_eqx" or r["automatic_is_xla"])
        extra.update(tflops=rate_, gemm_fraction=fraction(rate_, gemm))
        out.append(figure("selection_stage", path, *at, run, **extra))
    return out


def anchor_figures(res: dict, a: dict) -> list[dict]:
    """The anchor's figures: its automatic selection (where it is not the XLA path's) and
    the XLA path's, each with its scoring rate and its reference check."""
    out, gemm = [], gemm_rate(res, "bfloat16")
    automatic_is_xla = "same_as" in a["runs"].get("indexer", {})
    for name, path in (("indexer", a["path"]), ("indexer XLA", "xla")):
        run = a["runs"].get(name)
        if run and "same_as" in run:
            continue
        rate_ = tflops(a["flops"]["visible"], run, "min")
        extra = dict(strategy=a["strategies"][name], heads=a["heads"], dim=a["dim"], k=a["k"])
        extra.update(automatic=name == "indexer" or automatic_is_xla, tflops=rate_)
        extra.update(gemm_fraction=fraction(rate_, gemm))
        extra["check"] = a["checks"].get(name) or a["checks"].get("error")
        out.append(figure("anchor", path, "bfloat16", a["seq"], run, **extra))
    return out


def released_figures(res: dict, r: dict) -> list[dict]:
    """A released-size layer's figures at one S: fwd and fwd+bwd with their model-FLOP
    utilisation (median time) and the attention alone's bytes per second beside them, and the
    attention alone's own."""
    out, costs, runs, peak = [], r["costs"], r["runs"], res.get("peak_tflops")
    at = (r["path"], r["dtype"], r["seq"])
    for p, suffix in (("fwd", "fwd"), ("fwd+bwd", "fwd_bwd")):
        run, attention = runs.get(p), runs.get(f"attention {p}")
        moved = costs[f"attention_bytes_{suffix}"]
        model = tflops(costs[suffix], run)
        extra = dict(strategies=r["strategies"], model_tflop=costs[suffix] / 1e12, tflops=model)
        extra.update(mfu=fraction(model, peak), peak_tflops=peak)
        extra["flop_convention"] = costs.get("convention")
        hardware = costs.get(f"hardware_{suffix}")
        if hardware is not None:  # the kernels' dense work and recomputation (flops.py)
            rate_ = tflops(hardware, run)
            extra.update(hardware_tflop=hardware / 1e12, hardware_tflops=rate_)
            extra["hfu"] = fraction(rate_, peak)
        extra.update(attention_ms=median_ms(attention), bytes_per_s=rate(moved, attention))
        out.append(figure(f"{r['kind']}_{suffix}", *at, run, **extra))
        flop = costs["attention_fwd_bwd" if p == "fwd+bwd" else "attention"]
        extra = dict(strategies=r["strategies"], bytes=moved, bytes_per_s=rate(moved, attention))
        extra["tflops"] = tflops(flop, attention)
        out.append(figure(f"{r['kind']}_attention_{suffix}", *at, attention, **extra))
    return out


def figures(res: dict) -> list[dict]:
    """Every measurement of ``res`` as a figure (module docstring; docs/benchmarks_gpu.md)."""
    out = []
    for name, v in res["gemm"].items():
        extra = dict(precision="highest" if "highest" in name else "default")
        if "tflops_best" in v:
            extra["tflops"] = v["tflops_best"]
        out.append(figure("gemm", "xla", name.split()[0], v.get("n"), v, **extra))
    for r in res["layers"]:
        out += layer_figures(res, r)
    if res["anchor"]:
        out += anchor_figures(res, res["anchor"])
    for r in res["released"]:
        out += released_figures(res, r)
    return out


def longest(res: dict) -> dict[str, dict[str, int | None]]:
    """The longest S each released-size layer ran at (timed), fwd and fwd+bwd: ``{kind:
    {"fwd": S or None, "fwd+bwd": S or None}}``."""
    out: dict = {}
    for r in res.get("released", []):
        seen = out.setdefault(r["kind"], {"fwd": None, "fwd+bwd": None})
        for p in seen:
            if "median" in r["runs"].get(p, {}):
                seen[p] = max(seen[p] or 0, r["seq"])
    return out


def figure_text(res: dict) -> str:
    return json.dumps(figure_file(res), indent=1)


def figure_file(res: dict) -> dict:
    """The JSON page: the device, JAX, the latest run's date, every run's command, the figures
    and what was skipped."""
    m = res["meta"]
    return dict(
        device=f"{m.get('device_count')} x {m.get('device')} ({m.get('backend')})",
        jax=m.get("jax"),
        date=res["runs"][-1]["date"] if res["runs"] else m.get("date"),
        command=" ; ".join(r["command"] for r in res["runs"]),
        figures=figures(res),
        skipped=res["skipped"],
        longest=longest(res),
    )


# --- markdown ----------------------------------------------------------------------------------


def ms(v: dict | None, key: str = "median") -> str:
    """A run's time in ms, or why it has none."""
    if not v:
        return "-"
    if key in v:
        return f"{v[key] * 1e3:.2f}"
    if "same_as" in v:
        return f"= {v['same_as']}"
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


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def gemm_rate(res: dict, dtype_name: str) -> float | None:
    return res["gemm"].get(GEMM_OF[dtype_name], {}).get("tflops_best")


def markdown(res: dict) -> str:
    """The whole result as markdown (rewritten after every step)."""
    m, hf = res["meta"], res["hf"]
    title = f"# csa_eqx on {m.get('device_count')} x {m.get('device')} ({m.get('backend')})"
    how = '[Benchmarks (GPU), "Rerunning it"](benchmarks_gpu.md#rerunning-it)'
    lines = [title, "", f"Made by these commands ({how} says how to run them):", ""]
    for r in res["runs"]:
        lines += [
            f"- `{r['command']}` ({r['date']}; part {r['part']}, {r['elapsed_s']:.0f} s of a "
            f"{r['budget_s']:.0f} s budget; {r['reps']} rounds, settle {r['settle']}, slow "
            f"{r['slow_s']:g} s)"
        ]
    lines += [
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
        f"- Mode: {res['mode']}; B = 1. Times: median (min) in ms of the run's interleaved "
        "rounds, each timed call after `settle` untimed calls of the same run, after two "
        "warm-up calls; a run whose first call took over `slow` seconds: one timed call after "
        "that first. The machine-readable figures: the `.json` beside this page.",
        "",
    ]
    if m.get("nvidia_smi") and "not available" not in m["nvidia_smi"]:
        lines += ["```", m["nvidia_smi"], "```", ""]
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
        lines += [f"## The benchmark layer: {res['layer']}", ""]
        lines += strategy_lines(layers)
        lines += speed_tables(layers) + selection_table(res, layers) + memory_table(layers)
        lines += checks(layers)
    if res["anchor"]:
        lines += anchor_lines(res)
    if res["released"]:
        lines += released_lines(res)
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
    return "\n".join(lines) + "\n"


def strategy_lines(layers: list[dict]) -> list[str]:
    """Which strategies the automatic choice took, per S and dtype."""
    rows = [
        [
            r["seq"],
            r["dtype"],
            f"{r['strategies']['selection']} + {r['strategies']['attention']}",
            r["path"],
            "yes: timed once, as the XLA path" if r["automatic_is_xla"] else "no",
            f"{r['xla_strategies']['selection']} + XlaAttention",
        ]
        for r in layers
    ]
    header = ["S", "dtype", "automatic choice", "path", "= XLA path?", "XLA path"]
    return ["What the automatic choice ran (`Execution()`):", "", harness.table(header, rows), ""]


def speed_tables(layers: list[dict]) -> list[str]:
    header = ["S", "dtype"]
    for _, label in IMPLEMENTATIONS:
        header += [f"{label} fwd", f"{label} fwd+bwd"]
    header += [
        "automatic's speed-up vs naive (fwd / fwd+bwd)",
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
                    ratio(t.get(f"{key} {p}"), automatic(t, f"csa_eqx {p}"))
                    for p in ("fwd", "fwd+bwd")
                )
            )
        rows.append(row)
    return ["### Layer wall time, ms: median (min)", "", harness.table(header, rows), ""]


def selection_table(res: dict, layers: list[dict]) -> list[str]:
    rows = []
    for r in layers:
        flops_count = r.get("indexer_flops", {})
        gemm = gemm_rate(res, r["dtype"])
        for name, path in SELECTIONS:
            sel = r["runs"].get(name)
            cells = ["-", "-", "-"]
            if sel and "min" in sel and flops_count:
                visible = flops_count["visible"] / sel["min"] / 1e12
                full = flops_count["with_projections"] / sel["min"] / 1e12
                cells = [
                    f"{visible:.3g}",
                    pct(visible / gemm) if gemm else "-",
                    pct(full / gemm) if gemm else "-",
                ]
            gflop = f"{flops_count.get('visible', 0) / 1e9:.4g}"
            rows.append([r["seq"], r["dtype"], path, cell(sel), gflop] + cells)
    header = [
        "S", "dtype", "path", "selection stage ms", "visible-pair scoring GFLOP",
        "TFLOP/s (min time)", "of the GEMM rate (same dtype)",
        "counting the stage's projections too",
    ]  # fmt: skip
    return [
        "### Selection stage alone (compressor, indexer queries, scoring, top-k)",
        "",
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
    rows = [[r["seq"], r["dtype"]] + [gib(automatic(r["runs"], n)) for n in names] for r in layers]
    peaks = [
        f"S={r['seq']} {r['dtype']}: JAX peak {r['jax_peak_bytes'] / harness.GIB:.1f} GiB"
        for r in layers
        if r.get("jax_peak_bytes")
    ]
    lines = [
        "### Compiled temp memory of the timed programs, GiB (XLA `memory_analysis`)",
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
                f"Output check vs HF (S = {r['seq']}, {r['dtype']}; csa_eqx as the automatic "
                "choice runs it; HF on the CPU in float32, same weights and input): "
                f"{c['same_rows']:.2%} of query rows pick the same top-k set; on them "
                f"max |ours - HF| / max |HF| = {c['err_same']:.1e} (all rows {c['err']:.1e}).",
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
        f"Automatic choice: `{a['strategies']['indexer']}` (path {a['path']}); XLA path: "
        f"`{a['strategies']['indexer XLA']}`. Visible-pair scoring: "
        f"{a['flops']['visible'] / 1e12:.3g} TFLOP.",
        "",
    ]
    gemm = gemm_rate(res, "bfloat16")
    for name, label in (("indexer", "Automatic"), ("indexer XLA", "XLA path")):
        run = a["runs"].get(name)
        line = f"- {label}: {cell(run)}" + (" ms." if run and "min" in run else ".")
        if run and "min" in run:
            best = run["min"] * 1e3
            if a.get("reference_ms"):
                ref = a["reference_ms"]
                line += f" (A CuTe DSL kernel on an H200: {ref} ms; {best / ref:.2f}x that.)"
            tflops = a["flops"]["visible"] / run["min"] / 1e12
            line += f" {tflops:.3g} TFLOP/s" + (
                f", {tflops / gemm:.1%} of the bf16 GEMM." if gemm else "."
            )
        check = a["checks"].get(name)
        if check:
            untied = "-" if check["same_untied"] is None else f"{check['same_untied']:.2%}"
            line += (
                f" Picks vs the blocked `lax.top_k` reference: {untied} of the untied rows "
                f"({check['untied']:.2%} of {check['rows']} rows) equal, {check['same']:.2%} "
                "of all rows."
            )
        lines.append(line)
    if "error" in a["checks"]:
        lines.append(f"- Reference check failed: {a['checks']['error']}")
    return lines + [
        "",
        "Untied: the reference's k-th and (k+1)-th scores differ by more than 1e-5 of the "
        "row's largest |score| (float32 rounding cannot swap them), or the row sees at most k "
        "keys. The reference scores in true float32 (`anchor_reference`).",
        "",
    ]


def released_lines(res: dict) -> list[str]:
    peak = res.get("peak_tflops")
    lines = [
        "## Layers at released sizes (bf16, B = 1, random weights)",
        "",
        f"Model-FLOP utilisation against {peak} TFLOP/s (the chip's dense bf16 peak), from the "
        "median time"
        + ("." if peak else " (no peak known for this device: `--peak-tflops` gives it).")
        + " Attention alone: the layer's own attention call on the inputs its "
        "forward gives it. Temp: XLA's compiled temporaries (a program runs only where its "
        "compiled memory fits the device).",
        "",
    ]
    by_kind = defaultdict(list)
    for r in res["released"]:
        by_kind[r["kind"]].append(r)
    for kind, recs in by_kind.items():
        r0 = recs[0]
        lines += [f"### {kind}: `{r0['config']}`", ""]
        if r0["costs"].get("convention"):
            lines += [f"FLOP convention (model FLOPs): {r0['costs']['convention']}.", ""]
        rows = []
        for r in sorted(recs, key=lambda r: r["seq"]):
            figs = {f["name"]: f for f in released_figures(res, r)}
            row = [
                r["seq"],
                r["path"],
                f"{r['strategies']['selection']} + {r['strategies']['attention']}",
            ]
            for suffix, p in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
                f = figs[f"{kind}_{suffix}"]
                att = figs[f"{kind}_attention_{suffix}"]
                bps = att.get("bytes_per_s")
                hw = f.get("hardware_tflop")
                row += [
                    cell(r["runs"].get(p)),
                    pct(f.get("mfu")),
                    f"{f['model_tflop']:.3g}",
                    "-" if hw is None else f"{hw:.3g} ({pct(f.get('hfu'))})",
                    gib(r["runs"].get(p)),
                    cell(r["runs"].get(f"attention {p}")),
                    "-" if bps is None else f"{bps / 1e9:.3g}",
                ]
            rows.append(row)
        header = ["S", "path", "strategies"]
        for p in ("fwd", "fwd+bwd"):
            header += [
                f"{p} ms", f"{p} MFU", f"{p} model TFLOP", f"{p} hardware TFLOP (of peak)",
                f"{p} temp GiB",
                f"attention {p} ms", f"attention {p} GB/s",
            ]  # fmt: skip
        lines += [harness.table(header, rows), ""]
    ran = longest(res)
    if ran:
        lines += [
            "Longest S run (the compiled memory decides; `-`: none): "
            + "; ".join(
                f"{kind} fwd {v['fwd'] or '-'}, fwd+bwd {v['fwd+bwd'] or '-'}"
                for kind, v in ran.items()
            )
            + ".",
            "",
        ]
    doc = (flops.__doc__ or "").split("\n\n", 1)[1]
    return lines + ["### What is counted (`benchmarks/flops.py`)", "", doc.strip(), ""]


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
