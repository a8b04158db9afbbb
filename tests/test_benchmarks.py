"""``benchmarks.run_all`` (what ``csa-eqx bench`` runs) writes every table and plot.

Quick mode only: tiny sizes, so the numbers mean nothing and are not asserted; what is checked
is that each benchmark ran and its section, table and PNG plot were written.
"""

import struct

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


def test_gpu_table_quick_run(tmp_path, monkeypatch):
    """``benchmarks.gpu_table`` (run on a lent GPU machine, never in CI) still runs end to end
    here in its quick CPU mode, without the HF layer: every section written, no run failed."""
    import json
    import sys

    from benchmarks import gpu_table

    argv = ["gpu_table", "--quick", "--no-hf", "--reps", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_table.main()
    page = (tmp_path / "gpu_table.md").read_text()
    titles = (
        "## GEMM throughput",
        "### float32, B = 1, S = 256",
        "### bfloat16",
        "## Selection stage vs streaming key tile",
        "## Compiled temp memory",
    )
    for title in titles:
        assert title in page, title
    result = json.loads((tmp_path / "gpu_table.json").read_text())
    sections = result["layer"] + result["tiles"] + [{"times": result["gemm"]["runs"]}]
    for section in sections:
        for name, timing in section["times"].items():
            assert "error" not in timing, (name, timing)
    assert all(
        "error" not in v for row in result["memory"] for v in row.values() if v != row["seq"]
    )
