"""``benchmarks.run_all`` (what ``csa-eqx bench`` runs) writes every table and plot.

Quick mode only: tiny sizes, so the numbers mean nothing and are not asserted; what is checked
is that each benchmark ran and its section, table and PNG plot were written.
"""

import importlib.util
import os
import struct
from pathlib import Path

import pytest

from benchmarks import run_all

SECTIONS = (
    "## Layer memory",
    "## Layer wall time",
    "## Head-chunked indexer memory",
    "## Selection memory",
    "## Remat",
    "## Decode latency",
)
PLOTS = (
    "layer_memory.png",
    "indexer_chunk_memory.png",
    "kl_chunk_memory.png",
    "selection_memory.png",
    "decode_latency.png",
)


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.torch
def test_quick_run_writes_tables_and_plots(tmp_path):
    assert run_all.main(tmp_path, quick=True) == 0
    page = (tmp_path / "benchmarks.md").read_text()
    positions = [page.index(title) for title in SECTIONS]
    assert positions == sorted(positions)
    for name in PLOTS:
        assert f"](img/{name})" in page
        width, height = png_size(tmp_path / "img" / name)
        assert width >= 300 and height >= 200
    # each table has its header and at least one data row with numbers
    for header in (
        "| S | csa_eqx (GiB) | naive dense-mask (GiB) |",
        "| tensor axis |",
        "| context | sliding | csa | hca | dsa |",
        "| implementation |",
    ):
        start = page.index(header)
        rows = page[start:].split("\n")[2:3]
        assert rows and rows[0].startswith("| ") and any(c.isdigit() for c in rows[0])
    assert "HF transformers eager (torch)" in page
    assert "fraction of best f32 GEMM" in page
    assert "made with `--quick`" in page


def run_table(monkeypatch, *args) -> tuple[str, dict, dict]:
    """``benchmarks.accelerator_table`` in quick mode with ``args``: its page, its figures file
    and its raw records (named by the backend it reports)."""
    import json
    import sys

    from benchmarks import accelerator_table

    out = args[args.index("--out") + 1]
    monkeypatch.setattr(sys, "argv", ["accelerator_table", "--quick", *map(str, args)])
    accelerator_table.main()
    stem = out / f"benchmarks_{accelerator_table.machine()['backend']}"
    raw = json.loads(stem.with_name(stem.name + "_raw.json").read_text())
    return (
        stem.with_suffix(".md").read_text(),
        json.loads(stem.with_suffix(".json").read_text()),
        raw,
    )


def check_figures(page: dict) -> list[dict]:
    """The figures file's schema (docs/benchmarks_gpu.md, "On a TPU"): its keys, and every
    figure's required keys, name and path."""
    from benchmarks.accelerator_report import FIGURE_KEYS, FIGURE_NAMES, PATHS

    assert set(page) == {"device", "jax", "date", "command", "figures", "skipped", "longest"}
    for fig in page["figures"]:
        assert set(FIGURE_KEYS) <= set(fig), fig
        assert fig["name"] in FIGURE_NAMES and fig["path"] in PATHS, fig
        assert fig["ms"] is None or fig["ms"] > 0, fig
        assert fig["ms"] is not None or "skipped" in fig or "error" in fig, fig
    return page["figures"]


@pytest.mark.torch
def test_accelerator_table_quick_run(tmp_path, monkeypatch):
    """``benchmarks.accelerator_table`` (run on a lent accelerator, never in CI) runs part 1
    end to end here in its quick CPU mode at one S and dtype, HF included: every section
    written, every run timed (none failed or skipped; the automatic choice is the XLA path on
    a CPU, timed once), the anchor's picks equal to the blocked ``lax.top_k`` reference, the
    profile summarised and saved, every figure well formed."""
    page, result, raw = run_table(
        monkeypatch, "--part", "1", "--seqs", "128", "--dtypes", "float32", "--reps", "1",
        "--out", tmp_path,
    )  # fmt: skip
    for title in (
        "## GEMM rate",
        "### Layer wall time",
        "| 128 | float32 | DenseSelection + XlaAttention | xla | yes",
        "### Selection stage alone",
        "### Compiled temp memory",
        "Output check vs HF",
        "## Anchor: indexer alone",
        "equal, 100.00% of all rows",
        "## Profiles",
    ):
        assert title in page, title
    assert "## Skipped" not in page and result["skipped"] == []
    (layer,) = raw["layers"]
    runs = layer["runs"] | raw["anchor"]["runs"] | raw["gemm"]
    same = {"csa_eqx fwd", "csa_eqx fwd+bwd", "selection stage", "indexer"}
    assert {name: runs.pop(name) for name in same} == {
        "csa_eqx fwd": {"same_as": "csa_eqx XLA fwd"},
        "csa_eqx fwd+bwd": {"same_as": "csa_eqx XLA fwd+bwd"},
        "selection stage": {"same_as": "selection stage XLA"},
        "indexer": {"same_as": "indexer XLA"},
    }
    timed = {"naive fwd", "naive fwd+bwd", "csa_eqx XLA fwd", "csa_eqx XLA fwd+bwd"}
    timed |= {"selection stage XLA", "indexer XLA", "HF eager fwd", "HF eager fwd+bwd"}
    assert timed <= set(runs)
    for name, run in runs.items():
        assert "min" in run and "error" not in run and "skipped" not in run, (name, run)
    for name in timed - {"HF eager fwd", "HF eager fwd+bwd"}:
        assert runs[name]["memory"]["temp"] > 0, name
    assert layer["hf_check"]["err_same"] < 1e-4
    assert raw["anchor"]["checks"]["indexer XLA"]["same_untied"] == 1.0
    programs = layer["profile"]["programs"]
    assert {"jit_selection_stage", "jit_forward", "jit_forward_fwd_bwd"} <= set(programs)
    assert all(p["kernels"] > 0 and p["top"] for p in programs.values())
    assert (tmp_path / layer["profile"]["saved"]).stat().st_size > 0
    figures = check_figures(result)
    named = {(f["name"], f["path"]) for f in figures}
    assert named == {
        ("gemm", "xla"), ("layer_fwd", "xla"), ("layer_fwd", "naive"), ("layer_fwd_bwd", "xla"),
        ("layer_fwd_bwd", "naive"), ("selection_stage", "xla"), ("anchor", "xla"),
    }  # fmt: skip
    for f in figures:
        assert f["ms"] > 0 and f["dtype"] in ("bfloat16", "float32"), f
        if f["path"] == "xla" and f["name"] != "gemm":
            assert f["automatic"] and f["temp_bytes"] > 0, f
    (anchor,) = (f for f in figures if f["name"] == "anchor")
    assert anchor["check"]["same"] == 1.0 and anchor["strategy"] == "DenseSelection"


def test_accelerator_table_on_a_tpu_runs_the_released_sizes(tmp_path, monkeypatch):
    """On a TPU (the backend faked: the lent accelerator is one) part 2 adds to part 1's
    records (``--resume``): stand-ins of the released-size layers (V4 CSA, V3.2 DSA) compiled
    for shapes, then run, fwd and fwd+bwd with their model-FLOP utilisation against the v5e's
    197 TFLOP/s, the attention call alone with its bytes per second, written as
    ``benchmarks_tpu.*`` figures."""
    from benchmarks import accelerator_table

    machine = accelerator_table.machine
    fake = dict(backend="tpu", device="TPU v5 lite")
    monkeypatch.setattr(accelerator_table, "machine", lambda: dict(machine(), **fake))
    run_table(monkeypatch, "--part", "1", "--budget", "0", "--no-hf", "--out", tmp_path)
    page, result, raw = run_table(
        monkeypatch, "--part", "2", "--resume", tmp_path / "benchmarks_tpu_raw.json",
        "--reps", "1", "--settle", "0", "--no-hf", "--out", tmp_path,
    )  # fmt: skip
    assert "gemm: time budget" in result["skipped"]  # part 1's, kept
    assert result["command"].count("benchmarks.accelerator_table") == 2
    assert "--part 1" in result["command"] and "--part 2" in result["command"]
    for title in ("## Layers at released sizes", "### v4_flash_csa", "### v32_dsa"):
        assert title in page, title
    assert "What is counted" in page and "against 197.0 TFLOP/s" in page
    figures = {f["name"]: f for f in check_figures(result)}
    assert len(figures) == 8
    for f in figures.values():
        assert f["path"] == "xla" and f["dtype"] == "bfloat16" and f["seq"] == 256, f
        assert f["strategies"] == {"selection": "DenseSelection", "attention": "XlaAttention"}
        assert f["ms"] > 0 and f["temp_bytes"] > 0 and f["bytes_per_s"] > 0, f
    for kind in ("v4_flash_csa", "v32_dsa"):
        for suffix in ("fwd", "fwd_bwd"):
            f, attention = figures[f"{kind}_{suffix}"], figures[f"{kind}_attention_{suffix}"]
            assert f["tflops"] == pytest.approx(f["model_tflop"] / (f["ms"] / 1e3))
            assert f["mfu"] == pytest.approx(f["tflops"] / 197.0) and f["peak_tflops"] == 197
            assert f["attention_ms"] == attention["ms"]
            seconds = attention["ms"] / 1e3
            assert f["bytes_per_s"] == attention["bytes_per_s"]
            assert attention["bytes_per_s"] == pytest.approx(attention["bytes"] / seconds)
    for r in raw["released"]:
        assert r["runs"]["attention inputs"]["memory"]["output"] > 0


def test_accelerator_table_says_why_grouped_attention_is_not_run_alone(tmp_path, monkeypatch):
    """V3.2 with its heads in groups (forced here; the released layer's from 32k) calls its
    attention inside a ``lax.map``, where the call's inputs cannot be captured: part 2 still
    times the layer and records why its attention is not run alone (on the chip it failed
    with a ``TypeError`` instead)."""
    from benchmarks import accelerator_table
    from csa_eqx._layers import v32

    monkeypatch.setattr(v32, "head_groups", lambda shape, width: 2)
    monkeypatch.setattr(
        accelerator_table, "RELEASED", {"v32_dsa": accelerator_table.RELEASED["v32_dsa"]}
    )
    machine = accelerator_table.machine
    fake = dict(backend="tpu", device="TPU v5 lite")
    monkeypatch.setattr(accelerator_table, "machine", lambda: dict(machine(), **fake))
    page, result, raw = run_table(
        monkeypatch, "--part", "2", "--reps", "1", "--settle", "0", "--no-hf", "--out", tmp_path
    )
    (rec,) = raw["released"]
    for name in ("attention fwd", "attention fwd+bwd"):
        assert "heads run in 2 groups" in rec["runs"][name]["skipped"], rec["runs"][name]
    assert rec["runs"]["fwd+bwd"]["median"] > 0 and not result["skipped"]
    figures = {f["name"]: f for f in result["figures"]}
    for suffix in ("fwd", "fwd_bwd"):
        assert figures[f"v32_dsa_{suffix}"]["ms"] > 0
        alone = figures[f"v32_dsa_attention_{suffix}"]
        assert alone["ms"] is None and "2 groups" in alone["skipped"], alone


def test_accelerator_table_time_budget_keeps_what_finished(tmp_path, monkeypatch):
    """With no time left every step is skipped and listed, and the files are still written."""
    page, result, raw = run_table(monkeypatch, "--budget", "0", "--no-hf", "--out", tmp_path)
    assert raw["layers"] == [] and raw["gemm"] == {} and check_figures(result) == []
    skipped = page[page.index("## Skipped") :]
    steps = ("gemm", "layer bfloat16 128", "layer float32 256", "anchor")
    for step in steps + ("released v4_flash_csa 256", "released v32_dsa 256"):
        assert f"- {step}: time budget" in skipped, step
        assert f"{step}: time budget" in result["skipped"], step


def test_accelerator_table_skips_what_will_not_fit(tmp_path, monkeypatch):
    """A program predicted (from its last S: time x (S/S')^2, one timed call past ``--slow``
    seconds; memory x (S/S')^power) to exceed the time left or the free memory is not
    compiled; one whose compiled memory (with its arguments, when given as shapes) exceeds
    the free memory is recorded but not run."""
    import argparse

    import jax
    import jax.numpy as jnp

    from benchmarks import accelerator_table as at

    args = argparse.Namespace(
        out=tmp_path, budget=50.0, reps=1, settle=0, slow=1.0, quick=True, part="all"
    )
    bench = at.Bench(args, at.MODES["quick"], at.new_result(args, {}), "x")
    x = jnp.ones((64, 64))
    program = (lambda x: (x @ x).sum(), (x,))
    bench.seen[("slow", "float32")] = dict(seq=128, compile_s=1.0, call_s=10.0, temp=0)
    bench.seen[("fast", "float32")] = dict(seq=128, compile_s=1.0, call_s=0.1, temp=0)
    bench.seen[("big", "float32")] = dict(seq=128, compile_s=0.0, call_s=0.0, temp=1 << 20)
    monkeypatch.setattr(at, "jax_free_bytes", lambda: 3 << 20)
    rec: dict = {}
    programs = {"slow": program, "fast": program, "big": program, "fits": program}
    runs = bench.compile_runs(programs, "float32", 256, rec)
    assert set(runs) == {"fast", "fits"} and "memory" in rec["fits"]
    assert rec["slow"]["skipped"].startswith("time budget (~81 s,")  # 1 + 2 calls x 40 s
    assert rec["big"] == {"skipped": "memory (~0.0 GiB predicted)"}  # 4 MiB > 3 MiB
    assert bench.seen[("fits", "float32")]["seq"] == 256
    rec = {}
    bench.compile_programs({"big": program}, "float32", 256, rec, memory_power=1)
    assert "memory" in rec["big"] and "skipped" not in rec["big"]  # 2 MiB <= 3 MiB
    # given as shapes, its argument must fit too; given arrays, it is on the device already
    mem = at.Program(*program).compile().memory
    free = mem["temp"] + mem["output"] - mem["alias"] + x.nbytes // 2
    monkeypatch.setattr(at, "jax_free_bytes", lambda: free)
    shapes = (program[0], (jax.ShapeDtypeStruct(x.shape, x.dtype),))
    rec = {}
    compiled = bench.compile_programs({"shapes": shapes, "arrays": program}, "float32", 64, rec)
    assert set(compiled) == {"arrays"} and rec["shapes"]["memory"] == mem == rec["arrays"]["memory"]
    assert rec["shapes"]["skipped"].startswith("memory (")


def test_accelerator_table_released_sizes_decide_by_compiled_memory(tmp_path, monkeypatch):
    """Part 2 (``memory_power=None``) predicts no memory: a program whose last S's temporaries,
    scaled, would not fit is compiled all the same and its compiled memory decides; one the
    compiler refuses for memory (``RESOURCE_EXHAUSTED``) is recorded as skipped for memory;
    the longest S each layer ran at is reported (``longest``)."""
    import argparse

    import jax
    import jax.numpy as jnp

    from benchmarks import accelerator_report as report
    from benchmarks import accelerator_table as at

    args = argparse.Namespace(
        out=tmp_path, budget=50.0, reps=1, settle=0, slow=1.0, quick=True, part="2"
    )
    bench = at.Bench(args, at.MODES["quick"], at.new_result(args, {}), "x")
    program = (lambda x: (x @ x).sum(), (jnp.ones((64, 64)),))
    bench.seen[("v32 fwd+bwd", "bfloat16")] = dict(seq=64, compile_s=0.0, call_s=0.0, temp=1 << 30)
    monkeypatch.setattr(at, "jax_free_bytes", lambda: 3 << 20)
    rec: dict = {}
    compiled = bench.compile_programs(
        {"fwd+bwd": program}, "bfloat16", 128, rec, "v32 ", memory_power=None
    )
    assert set(compiled) == {"fwd+bwd"} and "skipped" not in rec["fwd+bwd"], rec  # 2 GiB scaled
    monkeypatch.setattr(at, "jax_free_bytes", lambda: 1)
    rec = {}
    assert bench.compile_programs({"fwd": program}, "bfloat16", 128, rec, memory_power=None) == {}
    assert rec["fwd"]["skipped"].startswith("memory (") and "memory" in rec["fwd"], rec

    def refused(self):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in hbm: 17.6G")

    monkeypatch.setattr(at.Program, "compile", refused)
    rec = {}
    assert bench.compile_programs({"fwd": program}, "bfloat16", 128, rec, memory_power=None) == {}
    assert rec["fwd"] == {
        "skipped": "memory (the compiler refused it: RESOURCE_EXHAUSTED: Ran out of memory in "
        "hbm: 17.6G)"
    }
    timed, skipped = {"median": 1.0}, {"skipped": "memory"}
    res = dict(
        released=[
            dict(kind="v32_dsa", seq=16384, runs={"fwd": timed, "fwd+bwd": timed}),
            dict(kind="v32_dsa", seq=65536, runs={"fwd": timed, "fwd+bwd": skipped}),
            dict(kind="v32_dsa", seq=32768, runs={"fwd": timed, "fwd+bwd": timed}),
            dict(kind="v4_flash_csa", seq=16384, runs={"fwd": skipped}),
        ]
    )
    assert report.longest(res) == {
        "v32_dsa": {"fwd": 65536, "fwd+bwd": 32768},
        "v4_flash_csa": {"fwd": None, "fwd+bwd": None},
    }


def test_hardware_flops_are_the_kernels_dense_work():
    """``benchmarks.flops.hardware_costs`` against a hand count at a tiny shape, on the
    configurations ``MosaicAttention``'s plan gives (``mosaic_config`` of a resolved layer,
    float32: heads padded to 8, 128-lane key and value blocks, query blocks of 8, S = 40):
    V3.2 reading its 5 picks by rows (one chunk of 8 rows per query), forward and backward or
    (gradients in HBM) the backward as tiles (one 128-row tile per query block), V4 CSA its
    picks as tiles (one 128-row tile per query block: the causal frontier's 2..10 entries) and
    its window as a band (a 16 + 8 row slab per block); forward ``2 R (K + V)``, backward
    ``2 R (3 K + 2 V)`` over the pairs ``R``; V4's ``q_b_proj`` recomputed; V3.2's head groups
    that recompute (one of two here) add their forward once more. And the FLOP convention is
    stated."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import csa_eqx as ce
    from benchmarks import flops
    from benchmarks.accelerator_table import mosaic_config
    from benchmarks.chosen import resolve
    from csa_eqx import presets

    seq, heads, lanes = 40, 8, 128
    blocks = seq // 8
    v32, v4, tiles = presets.tiny_v32(index_topk=5), presets.tiny_v4("csa", index_topk=3), 128
    cases = (  # (layer, config, gather, gradients, pairs per head forward, backward)
        (ce.V32Attention, v32, "rows", "auto", seq * 8, seq * 8),
        (ce.V32Attention, v32, "rows", "hbm", seq * 8, blocks * 8 * tiles),
        (ce.V4Attention, v4, "tiles", "auto", *[blocks * 8 * (tiles + 24)] * 2),
    )
    for cls, c, gather, gradients, per_head, per_head_bwd in cases:
        layer = eqx.filter_eval_shape(cls, c, key=jax.random.key(0))
        kernel = ce.MosaicAttention(8, 0, 8, tiles, gather, gradients=gradients)
        layer = layer.with_execution(ce.Execution(attention=kernel))
        configs = mosaic_config(
            resolve(layer, jax.ShapeDtypeStruct((1, seq, c.hidden_size), jnp.float32))
        )
        config = configs[0]
        assert (config.heads, config.key_blocks, config.value_blocks) == (heads, 1, 1)
        fwd = 2 * heads * per_head * 2 * lanes
        bwd = 2 * heads * per_head_bwd * 5 * lanes
        costs = flops.layer_costs(layer, seq, 4)
        again = 2 * seq * np.prod(layer.block.q_b_proj.shape) if cls is ce.V4Attention else 0
        for calls, recompute in ((1, 0), (2, 1)):
            hw = flops.hardware_costs(layer, seq, costs, configs, calls, recompute)
            rest = costs["projections"] + costs["indexer_projections"] + costs["scoring"]
            assert hw["hardware_attention_fwd"] == calls * fwd
            assert hw["hardware_attention_bwd"] == calls * bwd
            assert hw["hardware_recompute"] == again + recompute * fwd
            assert hw["hardware_fwd"] == rest + calls * fwd
            want = rest + 2 * costs["projections"] + calls * (fwd + bwd) + hw["hardware_recompute"]
            assert hw["hardware_fwd_bwd"] == want
    assert "MLA absorbed" in flops.convention(presets.v32()) and "512 + 64" in flops.convention(
        presets.v32()
    )


def test_accelerator_table_plan_puts_the_key_rows_first():
    from benchmarks.accelerator_table import plan

    dtypes = ("bfloat16", "float32")
    first = plan("1", (65536, 4096, 16384, 32768), dtypes, (32768, 8192), tiles=True)
    assert [" ".join(map(str, s)) for s in first] == [
        "gemm",
        "layer bfloat16 4096",
        "layer float32 4096",
        "layer bfloat16 16384",
        "layer bfloat16 32768",
        "anchor",
        "layer float32 16384",
        "layer float32 32768",
        "layer bfloat16 65536",
        "layer float32 65536",
        "tiles",
    ]
    second = plan("2", (4096,), dtypes, (32768, 8192), tiles=True)
    assert [" ".join(map(str, s)) for s in second] == [
        "released v4_flash_csa 32768",
        "released v32_dsa 32768",
        "released v4_flash_csa 8192",
        "released v32_dsa 8192",
    ]
    assert plan("all", (4096,), dtypes, (8192,), tiles=False) == (
        plan("1", (4096,), dtypes, (8192,), tiles=False) + second[2:]
    )
    # one kind alone (``--released-kinds``): the device to itself
    alone = plan("2", (4096,), dtypes, (65536, 8192), tiles=False, kinds=("v32_dsa",))
    assert alone == [("released", "v32_dsa", 65536), ("released", "v32_dsa", 8192)]


def test_trace_summary_counts_device_kernels_per_program(tmp_path):
    """A trace shaped like a GPU one (device process, kernels on stream threads tagged with
    their program): host events and derived timelines are left out, kernels counted and
    ranked per program."""
    import gzip
    import json

    from benchmarks.accelerator_table import summarise_trace

    def kernel(pid, name, dur, module, tid=1):
        args = dict(hlo_module=module)
        return dict(ph="X", pid=pid, tid=tid, ts=0, dur=dur, name=name, args=args)

    def thread(pid, tid, name):
        return dict(ph="M", pid=pid, tid=tid, name="thread_name", args=dict(name=name))

    events = [
        dict(ph="M", pid=1, name="process_name", args=dict(name="/host:CPU")),
        dict(ph="M", pid=2, name="process_name", args=dict(name="/device:GPU:0")),
        thread(2, 1, "Stream #13(Compute)"),
        thread(2, 9, "XLA Modules"),
        kernel(1, "host op", 1000.0, "jit_a"),
        kernel(2, "jit_a(1)", 2000.0, "jit_a", tid=9),
        kernel(2, "fusion_1", 30.0, "jit_a"),
        kernel(2, "fusion_1", 30.0, "jit_a"),
        kernel(2, "gemm_2", 50.0, "jit_a"),
        kernel(2, "sort_3", 500.0, "jit_b"),
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=events), f)
    summary = summarise_trace(path)
    assert summary["device_events"]
    a, b = summary["programs"]["jit_a"], summary["programs"]["jit_b"]
    assert list(summary["programs"]) == ["jit_b", "jit_a"]  # most busy first
    assert (a["kernels"], a["distinct"], a["busy_ms"]) == (3, 2, 0.11)
    assert a["top"][0] == dict(name="fusion_1", calls=2, ms=0.06)
    assert b["kernels"] == 1


def test_flops_count_the_weights_and_reads_of_a_layer():
    """``benchmarks.flops`` against counts written out from the architecture: every weight
    matrix of each layer kind, and per query its visible entries, picks and window rows by
    brute force over (query, entry) pairs."""
    import equinox as eqx
    import jax
    import numpy as np

    import csa_eqx as ce
    from benchmarks import flops
    from csa_eqx import presets

    seq = 40
    c4 = presets.tiny_v4("csa", index_topk=3)
    c32 = presets.tiny_v32(index_topk=5)
    h, hd, d, ih, id_ = c4.hidden_size, c4.num_heads * c4.head_dim, c4.head_dim, 4, 16
    v4 = (
        h * c4.q_lora_rank + c4.q_lora_rank * hd + h * d + hd * c4.o_lora_rank
        + c4.o_groups * c4.o_lora_rank * h + 2 * (2 * d) * h,  # compressor: 2d values, gates
        2 * (2 * id_) * h + c4.q_lora_rank * ih * id_ + h * ih,
    )  # fmt: skip
    qk, n, latent = c32.qk_nope_head_dim + c32.qk_rope_head_dim, c32.num_heads, c32.kv_lora_rank
    v32 = (
        h * c32.q_lora_rank + c32.q_lora_rank * n * qk + h * (latent + c32.qk_rope_head_dim)
        + latent * n * (c32.qk_nope_head_dim + c32.v_head_dim) + n * c32.v_head_dim * h,
        c32.q_lora_rank * ih * id_ + h * id_ + h * ih,
    )  # fmt: skip
    for cls, c, weights in ((ce.V4Attention, c4, v4), (ce.V32Attention, c32, v32)):
        layer = eqx.filter_eval_shape(cls, c, key=jax.random.key(0))
        assert flops.weight_elements(layer) == weights
        m = getattr(c, "compress_rate", 1)
        visible = np.array([sum((j + 1) * m - 1 <= i for j in range(seq)) for i in range(seq)])
        picks = np.minimum(visible, c.index_topk)
        window = np.array(
            [sum(0 <= i - j < c4.sliding_window for j in range(seq)) for i in range(seq)]
        )
        window = window if cls is ce.V4Attention else 0 * window
        got = flops.reads_per_query(c, seq)
        for a, b in zip(got, (visible, picks, window), strict=True):
            np.testing.assert_array_equal(a, b)
        costs = flops.layer_costs(layer, seq, itemsize=2)
        d_qk, d_v = (
            (d, d)
            if cls is ce.V4Attention
            else (c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank)
        )
        row = d if cls is ce.V4Attention else d_qk
        rows = (picks + window).sum()
        attention = rows * 2 * c.num_heads * (d_qk + d_v)
        scoring = visible.sum() * (2 * ih * id_ + 2 * ih)
        assert costs["fwd"] == 2 * seq * sum(weights) + scoring + attention
        assert (
            costs["fwd_bwd"]
            == 3 * (2 * seq * weights[0] + attention) + 2 * seq * weights[1] + scoring
        )
        moved = 2 * (rows * row + seq * c.num_heads * (d_qk + d_v))
        assert (
            costs["attention_bytes_fwd"] == moved and costs["attention_bytes_fwd_bwd"] == 3 * moved
        )


def test_anchor_reference_catches_a_wrong_pick_and_ties():
    """The anchor's blocked ``lax.top_k`` reference: a selection's picks equal it on every row;
    one row given a wrong pick is the one it flags; with every key the same, every row past k
    is tied (and the picks still equal: ties go to the lower index on both sides)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import csa_eqx as ce
    from benchmarks import accelerator_table as at

    k, seq = 8, 128
    q, w, keys = at.anchor_inputs(seq, 2, 16)
    select = jax.jit(lambda q, w, keys: at.anchor_select(q, w, keys, k, ce.DenseSelection()))
    reference = jax.jit(at.anchor_reference, static_argnums=(4, 5))
    picks = select(q, w, keys)
    same, untied = (np.asarray(a) for a in reference(q, w, keys, picks, k, 32))
    assert same.all() and untied[:k].all() and untied.mean() > 0.5  # 2 heads: zero scores tie
    row = np.asarray(picks[0, 100])
    other = next(j for j in range(101) if j not in row)
    same, _ = reference(q, w, keys, picks.at[0, 100, 0].set(other), k, 32)
    assert np.flatnonzero(~np.asarray(same)).tolist() == [100]
    flat = jnp.ones_like(keys)
    same, untied = (np.asarray(a) for a in reference(q, w, flat, select(q, w, flat), k, 32))
    assert same.all() and untied[:k].all() and not untied[k:].any()


def test_chosen_names_the_strategies_that_run():
    """``benchmarks.chosen.resolve`` says what a layer's execution runs: on the CPU the
    automatic choice is XLA's (the XLA path itself, path "xla"); with the Pallas kernels
    forced, they are what runs (path "kernel"), and the XLA path is still the dense top-k;
    the attention call's inputs are the layer's queries and reads."""
    import jax

    import csa_eqx as ce
    from benchmarks import chosen
    from csa_eqx import presets

    layer = ce.V4Attention(presets.tiny_v4("csa"), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, 64, layer.config.hidden_size))
    choice = chosen.resolve(layer, x)
    assert choice.names == {"selection": "DenseSelection", "attention": "XlaAttention"}
    assert choice.path == "xla" and choice.automatic_is_xla
    q, reads, sinks = choice.inputs
    assert q.shape == (1, 64, 4, 32) and reads.band.window == 16 and sinks.shape == (4,)
    kernels = ce.Execution(selection=ce.TritonSelection(), attention=ce.TritonAttention())
    forced = chosen.resolve(layer.with_execution(kernels), x)
    assert forced.names == {"selection": "TritonSelection", "attention": "TritonAttention"}
    assert forced.path == "kernel" and not forced.automatic_is_xla
    assert forced.xla_names == {"selection": "DenseSelection", "attention": "XlaAttention"}


def test_kernel_calls_are_found_in_a_lowering():
    """A program's Pallas kernel calls, which label a figure's path "kernel" whatever the
    strategies said, are counted in its lowering: a Mosaic TPU kernel's lowered for a TPU on
    the CPU, a Triton kernel's by its target's name; plain XLA has none."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from benchmarks.accelerator_table import KERNEL_CALLS

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def kernel(x):
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x) + 1

    x = jnp.ones((8, 128))
    for fn, calls in ((kernel, ["tpu_custom_call"]), (lambda x: x * 2 + 1, [])):
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("tpu",)).as_text()
        assert KERNEL_CALLS.findall(text) == calls
    triton = 'stablehlo.custom_call @__gpu$xla.gpu.triton(%0) {backend_config = ""}'
    assert KERNEL_CALLS.findall(triton) == ["__gpu$xla.gpu.triton"]


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here"
)
def test_tpu_compile_without_libtpu_says_how_to_install_it(capsys, monkeypatch):
    # the tool refuses before importing JAX and leaves the environment alone
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    tool = _tpu_compile_tool()
    assert tool.main(["--seqs", "4096", "--programs", "stage"]) == 2
    err = capsys.readouterr().err
    assert "libtpu is not importable" in err
    assert "pip install --no-deps --target /tmp/libtpu libtpu==0.0.42.1" in err
    assert "JAX_PLATFORMS" not in os.environ


def _tpu_compile_tool():
    path = Path(__file__).resolve().parents[1] / "tools" / "tpu_compile.py"
    spec = importlib.util.spec_from_file_location("tpu_compile", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_tpu_compile_layers_are_the_accelerator_tables(capsys):
    """``--layer`` names the benchmark layer and the accelerator table's released layers (the
    tool builds them with the table's own ``released_layer``); the selection stage is a V4
    layer's only, refused before anything is compiled."""
    import jax
    import jax.numpy as jnp

    import csa_eqx as ce
    from benchmarks.accelerator_table import RELEASED, released_layer

    tool = _tpu_compile_tool()
    assert set(tool.LAYERS) == {"speed", *RELEASED}
    assert tool.parse(["--layer", "v32_dsa", "--programs", "fwdbwd"]).layer == "v32_dsa"
    with pytest.raises(SystemExit):
        tool.parse(["--layer", "v32_dsa", "--programs", "stage"])
    assert "the stage program is a V4 layer's" in capsys.readouterr().err
    config, build = released_layer("v32_dsa", "full")
    assert (config.num_heads, config.kv_lora_rank, config.index_topk) == (128, 512, 2048)
    config, build = released_layer("v4_flash_csa", "quick")
    layer = build(jax.random.key(0))
    assert isinstance(layer, ce.V4Attention) and layer.config == config
    assert layer.block.q_b_proj.dtype == jnp.bfloat16


def test_the_table_measures_the_triton_kernels_on_a_gpu(monkeypatch):
    """The library's automatic choice on a GPU is the XLA path; the accelerator table forces the
    Triton kernels there (what it measures), and leaves every other backend's choice alone."""
    import csa_eqx as ce
    from benchmarks import chosen

    ex = ce.Execution(qk_head_chunk_size=2)
    assert chosen.platform_execution(ex) is ex  # the CPU
    monkeypatch.setattr(chosen.jax, "default_backend", lambda: "gpu")
    forced = chosen.platform_execution(ex)
    assert forced.selection == ce.TritonSelection() and forced.attention == ce.TritonAttention()
    assert forced.qk_head_chunk_size == 2
