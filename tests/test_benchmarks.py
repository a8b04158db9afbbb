"""``benchmarks.run_all`` (what ``csa-eqx bench`` runs) writes every table and plot.

Quick mode only: tiny sizes, so the numbers mean nothing and are not asserted; what is checked
is that each benchmark ran and its section, table and PNG plot were written.
"""

import struct

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


def run_gpu_table(monkeypatch, *args) -> tuple[str, dict]:
    import json
    import sys

    from benchmarks import gpu_table

    out = args[args.index("--out") + 1]
    monkeypatch.setattr(sys, "argv", ["gpu_table", "--quick", *map(str, args)])
    gpu_table.main()
    return (out / "gpu_table.md").read_text(), json.loads((out / "gpu_table.json").read_text())


@pytest.mark.torch
def test_gpu_table_quick_run(tmp_path, monkeypatch):
    """``benchmarks.gpu_table`` (run on a lent GPU machine, never in CI) runs end to end here
    in its quick CPU mode at one S and dtype, HF included: every section written, every run
    timed (none failed or skipped) but the Pallas kernels' layer runs, skipped on a CPU with
    the reason (the anchor's fused indexer runs, in interpret mode), the profile summarised
    and saved."""
    from benchmarks import gpu_table

    page, result = run_gpu_table(
        monkeypatch, "--seqs", "128", "--dtypes", "float32", "--reps", "1", "--out", tmp_path
    )
    for title in (
        "## GEMM rate",
        "## Layer wall time",
        "| 128 | float32 |",
        "## Selection stage alone",
        "## Compiled temp memory",
        "Output check vs HF",
        "## Anchor: indexer alone",
        "Rows whose kernel picks equal the dense (materialised-score) path's: 100.00%",
        "## Profiles",
    ):
        assert title in page, title
    assert "## Skipped" not in page
    (layer,) = result["layers"]
    runs = layer["runs"] | result["anchor"]["runs"] | result["gemm"]
    expected = {"csa_eqx fwd", "csa_eqx fwd+bwd", "naive fwd", "naive fwd+bwd", "selection stage"}
    expected |= {"csa_eqx XLA fwd", "csa_eqx XLA fwd+bwd", "selection stage XLA"}
    assert expected | {"HF eager fwd", "HF eager fwd+bwd", "indexer", "indexer XLA"} <= set(runs)
    for name in gpu_table.KERNEL_RUNS:
        assert runs.pop(name) == {"skipped": gpu_table.CPU_KERNELS}
    for name, run in runs.items():
        assert "min" in run and "error" not in run and "skipped" not in run, (name, run)
    for name in expected - set(gpu_table.KERNEL_RUNS):
        assert runs[name]["memory"]["temp"] > 0, name
    assert layer["hf_check"]["err_same"] < 1e-4
    assert "interpret mode only" in page
    programs = layer["profile"]["programs"]
    assert {"jit_selection_stage", "jit_forward", "jit_forward_fwd_bwd"} <= set(programs)
    assert all(p["kernels"] > 0 and p["top"] for p in programs.values())
    assert (tmp_path / layer["profile"]["saved"]).stat().st_size > 0


def test_gpu_table_off_a_gpu_times_the_xla_path(tmp_path, monkeypatch):
    """On a TPU (the backend faked: the lent accelerator may be one) the Triton kernels' runs,
    the anchor's fused indexer included, are skipped with the reason; the XLA path, the naive
    layer and the XLA anchor are timed, and the anchor's picks are checked by the XLA path."""
    from benchmarks import gpu_table

    machine = gpu_table.machine
    monkeypatch.setattr(gpu_table, "machine", lambda: dict(machine(), backend="tpu"))
    page, result = run_gpu_table(
        monkeypatch, "--seqs", "128", "--dtypes", "float32", "--reps", "1", "--settle", "0",
        "--no-hf", "--no-profile", "--gemm-n", "64", "--out", tmp_path,
    )  # fmt: skip
    why = gpu_table.NOT_TRITON.format(backend="TPU")
    (layer,) = result["layers"]
    runs = layer["runs"] | result["anchor"]["runs"]
    assert {runs.pop(name)["skipped"] for name in (*gpu_table.KERNEL_RUNS, "indexer")} == {why}
    assert {"naive fwd+bwd", "csa_eqx XLA fwd+bwd", "indexer XLA"} <= set(runs)
    assert all("min" in run for run in runs.values()), runs
    assert why in page
    assert "Rows whose XLA streaming picks equal the dense (materialised-score) path's: 100" in page


def test_gpu_table_time_budget_keeps_what_finished(tmp_path, monkeypatch):
    """With no time left every step is skipped and listed, and the files are still written."""
    page, result = run_gpu_table(monkeypatch, "--budget", "0", "--no-hf", "--out", tmp_path)
    assert result["layers"] == [] and result["gemm"] == {}
    skipped = page[page.index("## Skipped") :]
    for step in ("gemm", "layer bfloat16 128", "layer float32 256", "anchor"):
        assert f"- {step}: time budget" in skipped, step


def test_gpu_table_skips_what_will_not_fit(tmp_path, monkeypatch):
    """A run predicted (from its last S, x (S/S')^2) to exceed the time left or JAX's free
    memory is not compiled; one whose compiled memory exceeds it is recorded but not run."""
    import argparse

    import jax.numpy as jnp

    from benchmarks import gpu_table

    args = argparse.Namespace(out=tmp_path, budget=100.0, reps=1, settle=0, quick=True)
    bench = gpu_table.Bench(args, gpu_table.MODES["quick"])
    x = jnp.ones((64, 64))
    program = (lambda x: (x @ x).sum(), (x,))
    bench.seen[("slow", "float32")] = dict(seq=128, compile_s=1.0, call_s=10.0, temp=0)
    bench.seen[("big", "float32")] = dict(seq=128, compile_s=0.0, call_s=0.0, temp=1 << 20)
    monkeypatch.setattr(gpu_table, "jax_free_bytes", lambda: 3 << 20)
    rec: dict = {}
    programs = {"slow": program, "big": program, "fits": program}
    runs = bench.compile_runs(programs, "float32", 256, rec)
    assert set(runs) == {"fits"} and "memory" in rec["fits"]
    assert rec["slow"]["skipped"].startswith("time budget (~121 s,")  # 1 + 3 calls x 40 s
    assert rec["big"] == {"skipped": "memory (~0 GiB predicted)"}
    assert bench.seen[("fits", "float32")]["seq"] == 256
    monkeypatch.setattr(gpu_table, "jax_free_bytes", lambda: 0)
    rec = {}
    assert bench.compile_runs({"other": program}, "float32", 256, rec) == {}
    assert rec["other"]["memory"]["argument"] == x.nbytes
    assert rec["other"]["skipped"].startswith("memory (0.0 GiB > 0.0 GiB free)")


def test_gpu_table_plan_puts_the_key_rows_first():
    from benchmarks.gpu_table import plan

    steps = plan((65536, 4096, 16384, 32768), ("bfloat16", "float32"), tiles=False)
    assert [" ".join(map(str, s)) for s in steps] == [
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
    ]


def test_gpu_trace_summary_counts_device_kernels_per_program(tmp_path):
    """A trace shaped like a GPU one (device process, kernels on stream threads tagged with
    their program): host events and derived timelines are left out, kernels counted and
    ranked per program."""
    import gzip
    import json

    from benchmarks.gpu_table import summarise_trace

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
