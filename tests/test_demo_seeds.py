"""``python -m benchmarks.demo_seeds``: one tiny seed run end to end, then its page."""

import json

from demo_helpers import TINY

from benchmarks import demo_seeds


def test_sweep_writes_the_success_rate_and_reuses_finished_runs(tmp_path):
    out, runs = tmp_path / "seeds.md", tmp_path / "runs"
    flags = [*TINY, "--layers=csa"]
    assert demo_seeds.main(["--seeds", "3", "--runs", str(runs), "--out", str(out), *flags]) == 0
    report = json.loads((runs / "seed3" / "report.json").read_text())
    assert report["config"]["seed"] == 3 and report["controls"] == {}
    page = out.read_text()
    row = next(line for line in page.splitlines() if line.startswith("| 3 |"))
    assert f"| {report['retrieval_accuracy']:.3f} | {report['indexer_recall']:.3f} | – | – |" in row
    met = sum([report["targets_met"]])
    assert f"met by **{met} of 1** seeds" in page and "python -m benchmarks.demo_seeds" in page
    stamp = (runs / "seed3" / "report.json").stat().st_mtime_ns
    demo_seeds.main(["--seeds", "3", "--runs", str(runs), "--out", str(out), *flags])
    assert (runs / "seed3" / "report.json").stat().st_mtime_ns == stamp  # reused, not rerun
    flags = demo_seeds.seed_flags(3, runs, False, flags)
    assert demo_seeds.reusable(report, flags, controls=False) is None
    assert demo_seeds.reusable(report, flags, controls=True) == "without controls"
    older = {**report, "config": {**report["config"], "dense_steps": 300, "sparse_lr_scale": 1}}
    why = demo_seeds.reusable(older, flags, controls=False)  # e.g. a run of the old defaults
    assert why == "another configuration (differs in ['dense_steps', 'sparse_lr_scale'])"
    assert demo_seeds.reusable({**report, "finished": False}, flags, False) == "unfinished"
