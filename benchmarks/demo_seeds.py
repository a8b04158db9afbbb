"""Seed sweep of the main job: ``csa-eqx train`` with its defaults on several seeds.

``python -m benchmarks.demo_seeds [--seeds 0,1,2,3,4] [--controls] [--out docs/demo_seeds.md]``
runs one ``csa-eqx train`` process per seed, one after the other (each run alone on the machine,
so its wall time is the one a user sees), and writes the success rate, each seed's metrics and
their spread to ``--out``. A finished run found in ``--runs`` is reused when its report's
configuration is the one this command would train (so an interrupted sweep resumes); a report of
another configuration (e.g. older defaults) is deleted and its seed run again. Each seed's run has
its own empty compilation cache. Not part of ``make test``: it takes about ``5 x`` one run's
time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from csa_eqx.demo.cli import build_parser, train_config
from csa_eqx.demo.config import LOSS_WINDOW, TARGETS

from .harness import machine_info, machine_markdown, table


def seed_flags(seed: int, runs: Path, controls: bool, extra: list[str]) -> list[str]:
    """The ``csa-eqx train`` flags of one seed's run."""
    flags = [f"--runs={runs}", f"--name=seed{seed}", f"--seed={seed}", *extra]
    return flags + ([] if controls else ["--controls=none"])


def expected_config(flags: list[str]) -> dict:
    """The ``config`` that a run with ``flags`` writes into its report (as JSON reads it back),
    without ``controls``: whether the controls ran is checked from the report's results."""
    config = dataclasses.asdict(train_config(build_parser().parse_args(["train", *flags])))
    config = json.loads(json.dumps(config))
    del config["controls"]
    return config


def reusable(report: dict, flags: list[str], controls: bool) -> str | None:
    """Why the finished ``report`` found in a seed's folder cannot stand for a run with
    ``flags`` (``None`` when it can): unfinished, without the asked-for controls, or written
    by another configuration (other defaults or flags, e.g. an older recipe)."""
    if not report.get("finished"):
        return "unfinished"
    if controls and not report.get("controls"):
        return "without controls"
    saved = {k: v for k, v in report.get("config", {}).items() if k != "controls"}
    expected = expected_config(flags)
    changed = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
    return f"another configuration (differs in {changed})" if changed else None


def run_seed(seed: int, runs: Path, controls: bool, extra: list[str]) -> dict:
    """The report of ``csa-eqx train --seed SEED``: run now in a fresh folder, or reused when a
    finished run of the same configuration is there (a stale one is deleted and run again).
    Each run gets its own empty compilation cache (``folder/jax-cache``; the main run and its
    controls share it, as in ``make demo``), so its wall time is a fresh clone's."""
    folder = runs / f"seed{seed}"
    report_file = folder / "report.json"
    flags = seed_flags(seed, runs, controls, extra)
    if report_file.exists():
        report = json.loads(report_file.read_text())
        why = reusable(report, flags, controls)
        if why is None:
            return report
        print(f"seed {seed}: not reusing {report_file} ({why}); running it again", flush=True)
    if folder.exists():
        shutil.rmtree(folder)
    cmd = [sys.executable, "-m", "csa_eqx.demo.cli", "train", *flags]
    env = {**os.environ, **compilation_cache_env(folder / "jax-cache")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(report_file.read_text())


def compilation_cache_env(path: Path) -> dict:
    """The environment that points JAX's persistent compilation cache at ``path`` and keeps
    every program there (``make demo`` sets the same for ``build/demo-cache``)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(path),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def _metric(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _loss(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


def _spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"mean {statistics.mean(values):.3f} ± {sd:.3f} (min {min(values):.3f})"


def markdown(reports: dict[int, dict], command: str, info: dict) -> str:
    """The sweep's page: the machine, the command, one row per seed and the summary."""
    rows = []
    for seed, r in reports.items():
        controls = r["controls"]
        rows.append(
            [
                seed,
                _metric(r["retrieval_accuracy"]),
                _metric(r["indexer_recall"]),
                _metric(controls.get("sliding", {}).get("retrieval_accuracy")),
                _metric(controls.get("dense", {}).get("retrieval_accuracy")),
                _loss(r["lm_loss"]["dense_end"]),
                _loss(r["lm_loss"]["final"]),
                f"{r['wall_seconds']:.0f}",
                "yes" if r["targets_met"] else "**no**",
            ]
        )
    header = ["seed", "accuracy", "recall", "sliding-only", "dense"]
    header += ["loss, end of dense", "loss, end of run", "train wall (s)", "met"]
    met = sum(r["targets_met"] for r in reports.values())
    walls = [r["wall_seconds"] for r in reports.values()]
    losses = [r["lm_loss"] for r in reports.values() if r["lm_loss"]["dense_end"] is not None]
    worst = max((loss["final"] / loss["dense_end"] for loss in losses), default=None)
    targets = ", ".join(f"{k} >= {v}" for k, v in TARGETS.items())
    return "\n".join(
        [
            "# The main job across seeds",
            "",
            "`make demo` (`csa-eqx train` with its defaults) on several seeds, one run at a "
            "time. Generated by:",
            "",
            f"```bash\n{command}\n```",
            "",
            machine_markdown(info),
            "",
            table(header, rows),
            "",
            f"- targets ({targets}) met by **{met} of {len(reports)}** seeds",
            f"- retrieval accuracy: {_spread([r['retrieval_accuracy'] for r in reports.values()])}",
            f"- indexer recall: {_spread([r['indexer_recall'] for r in reports.values()])}",
            f"- answer loss at the end of the run / at the end of the dense phase (each the "
            f"mean of {LOSS_WINDOW} steps): at most **{worst:.2f}x** (target <= 2x)"
            if worst is not None
            else "- answer loss: no run had a dense phase",
            f"- training wall time: mean {statistics.mean(walls):.0f} s, max {max(walls):.0f} s "
            "(one run per process: start-up, compiles, training, evaluations and plots; the "
            "control columns, when present, are separate runs and are not counted)",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    parser.add_argument("--runs", type=Path, default=Path("runs/seeds"), help="run folders")
    parser.add_argument("--out", type=Path, default=Path("docs/demo_seeds.md"))
    parser.add_argument("--controls", action="store_true", help="also run each seed's controls")
    args, extra = parser.parse_known_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    info = machine_info()
    reports = {}
    for seed in seeds:
        reports[seed] = run_seed(seed, args.runs, args.controls, extra)
        print(f"seed {seed}: {_metric(reports[seed]['retrieval_accuracy'])}", flush=True)
    command = "python -m benchmarks.demo_seeds " + " ".join(argv or sys.argv[1:])
    args.out.write_text(markdown(reports, command.strip(), info))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
