"""Program size of the benchmark layer's fwd+bwd: compiled HLO op counts and XLA memory.

Compile only, nothing runs: ``grad(sum(layer(x)))`` w.r.t. the layer's arrays and ``x`` for
the layer of the speed / memory tables (``harness.speed_layer``: hidden 256, 4 heads x 64,
indexer 64 x 128, top-k 512, m = 4, window 128; float32, B = 1), at each S. Counted in
``compiled.as_text()`` (the optimised HLO module):

- instructions: every instruction line of the module (all computations);
- top level: the instructions of the computations that run as a sequence (the entry, while
  bodies and conditions, conditional branches, calls); a fusion counts once there;
- per opcode: instructions of the top level and of the fused computations (not the reducers
  that reduce / scatter / sort apply); ``--json`` keeps every opcode;

and ``memory_analysis()``'s temp / argument / output bytes. Refactors should not grow them.

    python -m benchmarks.program_size [--seqs 4096 16384] [--json PATH] [--baseline PATH]

``--baseline PATH`` (a ``--json`` file of an earlier tree, e.g.
``benchmarks/program_size_9451573.json``) shows each number's change against it and exits 1
if the instructions, the top level or the temp bytes grew. ``--quick``: the tiny layer, S = 128.
Uses only csa_eqx's public API, so the same script measures older trees.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import csa_eqx

from . import harness

SEQS = (4096, 16384)
# the opcodes counted one by one (the rest in the --json file only)
MAIN_OPS = (
    "fusion", "dot", "while", "conditional", "gather", "scatter", "sort", "dynamic-slice",
    "dynamic-update-slice", "copy", "transpose", "reduce", "custom-call", "all-gather",
    "all-reduce",
)  # fmt: skip
SIZE_KEYS = ("instructions", "top_level", "computations")
MEMORY_KEYS = ("temp", "argument", "output")
MUST_NOT_GROW = ("instructions", "top_level", "temp")

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.-]+ = (.*)$")
_CONTROL = re.compile(
    r"\b(?:body|condition|true_computation|false_computation)=%?([\w.-]+)"
    r"|\bbranch_computations=\{([^}]*)\}"
)
_CALLS = re.compile(r"\bcalls=(?:\{([^}]*)\}|%?([\w.-]+))")
_TO_APPLY = re.compile(r"\bto_apply=%?([\w.-]+)")


def _opcode(rest: str) -> str:
    """The opcode of an instruction's right-hand side ``shape opcode(operands), attributes``
    (a tuple shape is parenthesised and may hold spaces)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        rest = rest.split(" ", 1)[1]
    return rest.lstrip().split("(", 1)[0]


def _names(*groups: str | None) -> list[str]:
    return [n.strip().lstrip("%") for g in groups if g for n in g.split(",") if n.strip()]


def hlo_counts(text: str) -> dict:
    """Instruction counts of an HLO module's text (module docstring): ``instructions``,
    ``top_level``, ``computations`` and ``opcodes`` (``{opcode: count}``)."""
    computations: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            if header := _HEADER.match(line):
                current = header.group(1)
                computations[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif instruction := _INSTRUCTION.match(line):
            rest = instruction.group(1)
            computations[current].append((_opcode(rest), rest))
    # walk from the entry: what runs in sequence (control) and what is fused into its kernels
    control, fused, todo = set(), set(), [(entry, False)]
    while todo:
        name, is_fused = todo.pop()
        if name in control | fused or name not in computations:
            continue
        (fused if is_fused else control).add(name)
        for opcode, rest in computations[name]:
            for m in _CONTROL.finditer(rest):
                todo += [(n, is_fused) for n in _names(*m.groups())]
            for m in _CALLS.finditer(rest):
                todo += [(n, is_fused or opcode == "fusion") for n in _names(*m.groups())]
            if opcode == "call":
                todo += [(n, is_fused) for n in _names(*_TO_APPLY.findall(rest))]
    opcodes = collections.Counter(op for name in control | fused for op, _ in computations[name])
    return dict(
        instructions=sum(map(len, computations.values())),
        top_level=sum(len(computations[name]) for name in control),
        computations=len(computations),
        opcodes=dict(opcodes.most_common()),
    )


def measure(seq: int, quick: bool = False) -> dict:
    """Op counts and memory of the benchmark layer's compiled fwd+bwd at ``seq``."""
    layer, x = harness.layer_shapes(harness.speed_layer(quick), seq)
    start = time.perf_counter()
    compiled = harness.compile_for(harness.fwd_bwd(harness.forward), layer, x)
    seconds = time.perf_counter() - start
    counts = hlo_counts(compiled.as_text())
    return dict(seq=seq, compile_s=round(seconds, 1), **counts, **harness.memory(compiled))


def source_tree() -> str:
    """The git commit of the csa_eqx being measured (``+dirty`` with uncommitted changes)."""
    root = Path(csa_eqx.__file__).resolve().parents[1]
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        git = ["git", "-C", str(root)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True)
        status = subprocess.run([*git, "status", "--porcelain", "csa_eqx"], capture_output=True)
        if head.returncode == 0:
            return head.stdout.decode().strip() + ("+dirty" if status.stdout.strip() else "")
    return "unknown"


def _value(row: dict, key: str) -> int:
    return row["opcodes"].get(key, 0) if key in MAIN_OPS else row[key]


def _cell(row: dict, key: str, before: dict | None) -> str:
    value, mib = _value(row, key), key in MEMORY_KEYS
    text = f"{value / 2**20:.2f}" if mib else str(value)
    if before is not None and (old := _value(before, key)) != value:
        text += f" ({value / old - 1:+.1%})" if mib and old else f" ({value - old:+d})"
    return text


def markdown(result: dict, baseline: dict | None = None) -> str:
    """Two markdown tables (size and memory; main opcodes), changes against ``baseline``."""
    before = {r["seq"]: r for r in baseline["rows"]} if baseline else {}
    rows = result["rows"]
    sizes = [
        [r["seq"], *(_cell(r, k, before.get(r["seq"])) for k in SIZE_KEYS + MEMORY_KEYS)]
        + [r["compile_s"]]
        for r in rows
    ]
    header = ["S", "instructions", "top level", "computations"]
    header += [f"{k} (MiB)" for k in MEMORY_KEYS] + ["compile (s)"]
    ops = [[r["seq"], *(_cell(r, k, before.get(r["seq"])) for k in MAIN_OPS)] for r in rows]
    lines = [f"csa_eqx tree {result['tree']}, JAX {result['jax']} ({result['backend']})"]
    if baseline:
        lines[0] += f"; (changes) against tree {baseline['tree']}"
    lines += ["", harness.table(header, sizes), "", harness.table(["S", *MAIN_OPS], ops)]
    return "\n".join(lines)


def grown(result: dict, baseline: dict) -> list[str]:
    """``"S=...: key old -> new"`` for each ``MUST_NOT_GROW`` number larger than the baseline's."""
    before = {r["seq"]: r for r in baseline["rows"]}
    return [
        f"S={r['seq']}: {k} {before[r['seq']][k]} -> {r[k]}"
        for r in result["rows"]
        if r["seq"] in before
        for k in MUST_NOT_GROW
        if r[k] > before[r["seq"]][k]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="default: 4096 16384")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--baseline", type=Path, help="a --json file to compare against")
    parser.add_argument("--quick", action="store_true", help="tiny layer, S = 128 (smoke test)")
    args = parser.parse_args(argv)
    seqs = args.seqs or ((128,) if args.quick else SEQS)
    info = harness.machine_info()
    result = dict(
        tree=source_tree(),
        quick=args.quick,
        jax=info["jax"],
        backend=info["backend"],
        machine=info,
        rows=[measure(seq, args.quick) for seq in seqs],
    )
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    print(harness.machine_markdown(info))
    print()
    print(markdown(result, baseline))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if baseline:
        growth = grown(result, baseline)
        print("\n" + ("grown: " + "; ".join(growth) if growth else "no growth against baseline"))
        return int(bool(growth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
