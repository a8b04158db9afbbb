"""The timing summary at the end of ``make test``: per pytest run (one per interpreter) its wall
time, test count and outcome, then the slowest tests of each run.

    python tools/test_timing.py build/test/py311.xml build/test/py312.xml [--slowest 10]

Reads the JUnit XML files that ``pytest --junitxml`` writes: the ``testsuite`` element's time is
the run's wall time (collection included) and its ``timestamp`` its start, each ``testcase``
time one test's call, set-up and tear-down. With two workers a run's wall time is about half the
sum of its tests' times. The total is the span from the first run's start to the last one's end
(runs that overlap are not counted twice).
"""

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_run(path: Path) -> tuple[dict, list[tuple[float, str]]]:
    """``(totals, [(seconds, test id), ...])`` of one JUnit XML file."""
    suite = ET.parse(path).getroot()
    if suite.tag == "testsuites":
        (suite,) = suite
    totals = {
        k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time", "timestamp")
    }
    tests = [
        (float(case.get("time")), f"{case.get('classname')}::{case.get('name')}")
        for case in suite.iter("testcase")
    ]
    return totals, tests


def module_seconds(tests: list[tuple[float, str]]) -> dict[str, float]:
    """Summed test seconds per test module file (``test_x.py``)."""
    out: dict[str, float] = {}
    for seconds, name in tests:
        parts = name.split("::")[0].split(".")
        module = next((p for p in parts if p.startswith("test_")), parts[-1]) + ".py"
        out[module] = out.get(module, 0.0) + seconds
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--slowest", type=int, default=8)
    parser.add_argument("--modules", type=int, default=6, help="slowest modules shown per run")
    parser.add_argument(
        "--write-weights",
        type=Path,
        help="write each module's test seconds (JSON) for tests/conftest.py's module order: "
        "from the first report that has the module",
    )
    args = parser.parse_args(argv)
    runs = [(path, *read_run(path)) for path in args.reports]
    if args.write_weights:
        weights: dict[str, float] = {}
        for _, _, tests in runs:
            for module, seconds in module_seconds(tests).items():
                weights.setdefault(module, round(seconds, 1))
        ordered = dict(sorted(weights.items(), key=lambda kv: -kv[1]))
        args.write_weights.write_text(json.dumps(ordered, indent=1) + "\n")
    print("\n== test timing ==")
    for path, totals, tests in runs:
        busy = sum(t for t, _ in tests)
        print(
            f"{path.stem}: {float(totals['time']):7.1f} s wall, {busy:7.1f} s in tests, "
            f"{totals['tests']} tests ({totals['failures']} failed, {totals['errors']} errors, "
            f"{totals['skipped']} skipped)"
        )
    spans = []
    for _, totals, _ in runs:
        start = datetime.datetime.fromisoformat(totals["timestamp"])
        spans.append((start, start + datetime.timedelta(seconds=float(totals["time"]))))
    span = (max(e for _, e in spans) - min(s for s, _ in spans)).total_seconds()
    print(f"total: {span:.1f} s of pytest wall time, from the first run's start to the last's end")
    for path, _, tests in runs:
        print(f"slowest in {path.stem}:")
        for seconds, name in sorted(tests, reverse=True)[: args.slowest]:
            print(f"  {seconds:6.1f} s  {name}")
        modules = sorted(module_seconds(tests).items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{m} {s:.0f} s" for m, s in modules[: args.modules])
        print(f"  slowest modules (a module runs on one worker): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
