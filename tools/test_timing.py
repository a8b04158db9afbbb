"""The timing summary at the end of ``make test``: per pytest run (one per interpreter) its wall
time, test count and outcome, then the slowest tests of each run.

    python tools/test_timing.py build/test/py311.xml build/test/py312.xml [--slowest 10]

Reads the JUnit XML files that ``pytest --junitxml`` writes: the ``testsuite`` element's time is
the run's wall time (collection included), each ``testcase`` time one test's call, set-up and
tear-down. With two workers a run's wall time is about half the sum of its tests' times.
"""

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_run(path: Path) -> tuple[dict, list[tuple[float, str]]]:
    """``(totals, [(seconds, test id), ...])`` of one JUnit XML file."""
    suite = ET.parse(path).getroot()
    if suite.tag == "testsuites":
        (suite,) = suite
    totals = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
    tests = [
        (float(case.get("time")), f"{case.get('classname')}::{case.get('name')}")
        for case in suite.iter("testcase")
    ]
    return totals, tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--slowest", type=int, default=8)
    args = parser.parse_args(argv)
    runs = [(path, *read_run(path)) for path in args.reports]
    print("\n== test timing ==")
    for path, totals, tests in runs:
        busy = sum(t for t, _ in tests)
        print(
            f"{path.stem}: {float(totals['time']):7.1f} s wall, {busy:7.1f} s in tests, "
            f"{totals['tests']} tests ({totals['failures']} failed, {totals['errors']} errors, "
            f"{totals['skipped']} skipped)"
        )
    print(f"total: {sum(float(totals['time']) for _, totals, _ in runs):.1f} s of pytest wall time")
    for path, _, tests in runs:
        print(f"slowest in {path.stem}:")
        for seconds, name in sorted(tests, reverse=True)[: args.slowest]:
            print(f"  {seconds:6.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
