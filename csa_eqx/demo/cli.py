"""``csa-eqx`` command line: ``train``, ``bench`` and ``inspect``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from .config import (
    CONTROLS,
    LOSS_WINDOW,
    SCHEDULES,
    TARGETS,
    TrainConfig,
    check_learning_rate,
    check_run_name,
)


def _simulated_devices(n: int) -> None:
    """Ask for ``n`` simulated CPU devices (only effective before JAX starts its backend; the
    CPU backend is the only one it changes, so accelerators are used as they are).

    XLA's CPU client runs every device's collectives on one pool of ``max(cores, n)`` threads,
    and does not order a collective inside a loop against one outside it: in the training step
    a sum over the data axis runs beside a loop whose body permutes over every device, so on a
    machine with fewer cores than devices two devices can each hold two threads waiting while
    the other two never start, and XLA aborts after 40 s (2 of 4 fresh runs of a tiny
    configuration on 2 cores with JAX 0.12; docs/testing.md). ``PJRT_NPROC``, which sizes that
    pool, is raised to ``4 n`` unless it is set.
    """
    import jax

    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 4 * n)))
    # a backend that is already running (e.g. in a notebook) keeps its devices
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", n)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {text})")
    return value


def _learning_rate(text: str, what: str = "learning rate") -> float:
    try:
        return check_learning_rate(float(text), what)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _scale(text: str) -> float:
    return _learning_rate(text, "scale")


def _run_name(text: str) -> str:
    try:
        return check_run_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _family(text: str) -> str:
    if text not in SCHEDULES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(SCHEDULES)} (got {text!r})")
    return text


def _layers(text: str) -> tuple[str, ...]:
    return tuple(kind.strip() for kind in text.split(","))


def _controls(text: str) -> tuple[str, ...]:
    names = () if text == "none" else tuple(text.split(","))
    if not set(names) <= set(CONTROLS):
        raise argparse.ArgumentTypeError(
            f"controls must be 'none' or a comma-separated list of {', '.join(CONTROLS)} "
            f"(got {text})"
        )
    return names


def _mesh(text: str) -> tuple[int, int]:
    try:
        data, tensor = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"mesh must look like DATAxTENSOR, e.g. 2x2 (got {text})"
        ) from None
    if data < 0 or tensor < 0 or (data == 0) != (tensor == 0):
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive, or 0x0 (got {text})")
    return data, tensor


TRAIN_FLAGS = [  # flag, TrainConfig field, parser, help
    ("--name", "name", _run_name, "run name; output goes to RUNS/NAME"),
    ("--seq-len", "seq_len", _positive, "tokens per sequence"),
    ("--start-seq-len", "start_seq_len", _positive, "first length of the dense curriculum"),
    ("--batch-size", "batch_size", _positive, "sequences per step"),
    ("--pairs", "n_pairs", _positive, "key/value pairs (and queries) per sequence"),
    ("--keys", "n_keys", _positive, "distinct keys"),
    ("--values", "n_values", _positive, "distinct values"),
    ("--dense-steps", "dense_steps", _non_negative, "dense-attention steps"),
    ("--warmup-steps", "warmup_steps", _non_negative, "indexer-only warm-up steps"),
    ("--sparse-steps", "sparse_steps", _non_negative, "sparse (top-k) steps"),
    ("--lr", "learning_rate", _learning_rate, "AdamW peak learning rate"),
    ("--sparse-lr-scale", "sparse_lr_scale", _scale, "sparse phase's peak, times --lr"),
    ("--lr-warmup", "lr_warmup_steps", _non_negative, "warm-up steps of each phase's schedule"),
    ("--clip", "grad_clip", float, "global gradient-norm clip"),
    ("--short-batch-scale", "short_batch_scale", _positive, "batch growth for short rows"),
    ("--topk", "index_topk", _positive, "indexer top-k"),
    ("--window", "sliding_window", _positive, "sliding window"),
    ("--hidden", "hidden_size", _positive, "model width"),
    (
        "--family",
        "family",
        _family,
        "attention family: v4 (V4 / V3.2 layers) or v41 (a V4.1 stack)",
    ),
    (
        "--layers",
        "layers",
        _layers,
        "attention schedule, comma-separated sliding/csa/hca/dsa (v4) or sliding/full/reindex/"
        "reuse (v41); none = the family's",
    ),
    ("--eval-every", "eval_every", _positive, "steps between evaluations"),
    ("--eval-batches", "eval_batches", _positive, "held-out batches per evaluation"),
    ("--checkpoint-every", "checkpoint_every", _positive, "steps between checkpoints"),
    ("--mesh", "mesh", _mesh, "DATAxTENSOR device mesh, 0x0 = automatic"),
    ("--seed", "seed", int, "data and init seed"),
    ("--controls", "controls", _controls, "control runs after training (or none)"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csa-eqx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a small CSA model on the embedded retrieval task")
    t.add_argument("--runs", type=Path, default=Path("runs"), help="folder for runs")
    t.add_argument(
        "--devices",
        type=_positive,
        default=4,
        help="simulated CPU devices when JAX only finds one CPU (default 4)",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for flag, field, kind, text in TRAIN_FLAGS:
        default = defaults[field]
        shown = ",".join(default) or "none" if field in ("layers", "controls") else default
        shown = "x".join(map(str, default)) if field == "mesh" else shown
        t.add_argument(
            flag, dest=field, type=kind, default=default, help=f"{text} (default {shown})"
        )

    b = sub.add_parser("bench", help="regenerate the benchmark tables and plots")
    b.add_argument("--out", type=Path, default=Path("docs"), help="where tables/plots go")
    b.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    b.add_argument(
        "--repo",
        type=Path,
        default=Path("."),
        help="source checkout holding benchmarks/ (default: the current folder)",
    )

    i = sub.add_parser("inspect", help="a layer's shapes, parameter counts and memory estimate")
    i.add_argument("--layer", choices=["sliding", "csa", "hca", "dsa"], default="csa")
    i.add_argument("--seq-len", type=_positive, default=16384)
    i.add_argument(
        "--preset",
        choices=["v4-flash", "v4-pro", "tiny"],
        default="v4-flash",
        help="layer sizes (dsa uses DeepSeek-V3.2's sizes at v4-flash and v4-pro)",
    )
    i.add_argument("--chunk", type=_non_negative, default=0, help="qk_head_chunk_size")
    return parser


def _missing_demo_extra() -> list[str]:
    """The ``demo`` extra's packages that are not installed."""
    return [name for name in ("optax", "matplotlib") if importlib.util.find_spec(name) is None]


def _bench(out: Path, quick: bool, repo: Path) -> int:
    """Run ``python -m benchmarks.run_all`` in the source checkout ``repo`` (the benchmarks
    are a folder of the repository, not part of the installed package)."""
    if not (repo / "benchmarks" / "run_all.py").is_file():
        print(
            f"csa-eqx bench: error: no benchmarks/run_all.py in {repo.resolve()}; the "
            "benchmarks live in a source checkout of csa_eqx: run this from its root or pass "
            "--repo PATH",
            file=sys.stderr,
        )
        return 2
    from .checkpoint import RunError, prepare_folder

    try:
        prepare_folder(out)
    except RunError as err:
        print(f"csa-eqx bench: error: {err} (--out)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "benchmarks.run_all", "--out", str(out.resolve())]
    return subprocess.run([*cmd, "--quick"] if quick else cmd, cwd=repo).returncode


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``csa-eqx train`` arguments (``ValueError`` if invalid)."""
    return TrainConfig(**{field: getattr(args, field) for _, field, _, _ in TRAIN_FLAGS})


def summary(report: dict, folder: Path) -> str:
    """The run's last lines: its metrics, the controls' accuracies, and whether the targets
    (``TARGETS``) were met."""

    def value(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        f"retrieval_accuracy={value(report.get('retrieval_accuracy'))} "
        f"indexer_recall={value(report.get('indexer_recall'))} "
        f"wall_seconds={report['wall_seconds']:.0f} -> {folder}"
    ]
    loss = report.get("lm_loss")  # a report assembled by hand may lack it
    if loss and loss["dense_end"] is not None:
        lines.append(
            f"answer loss (mean of the last {LOSS_WINDOW} steps): end of the dense phase "
            f"{loss['dense_end']:.2e}, end of the run {loss['final']:.2e} "
            f"({loss['final'] / loss['dense_end']:.2f}x)"
        )
    for name, control in report["controls"].items():
        lines.append(f"control {name}: retrieval_accuracy={value(control['retrieval_accuracy'])}")
    wanted = ", ".join(f"{k} >= {v}" for k, v in TARGETS.items())
    verdict = "met" if report["targets_met"] else "NOT met"
    lines.append(f"targets {verdict} ({wanted})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("train", "bench") and (missing := _missing_demo_extra()):
        print(
            f"csa-eqx {args.command}: error: needs the demo extra (missing: "
            f"{', '.join(missing)}); install it with: pip install 'csa_eqx[demo]'",
            file=sys.stderr,
        )
        return 2
    if args.command == "train":
        _simulated_devices(args.devices)
        from .train import RunError, train

        try:
            cfg = train_config(args)
        except ValueError as err:
            print(f"csa-eqx train: error: {err}", file=sys.stderr)
            return 2
        try:
            report = train(cfg, args.runs / cfg.name, sys.stdout)
        except ValueError as err:  # e.g. a --mesh that does not fit the devices
            print(f"csa-eqx train: error: {err}", file=sys.stderr)
            return 2
        except RunError as err:  # unusable checkpoint or folder, non-finite loss
            print(f"\ncsa-eqx train: error: {err}", file=sys.stderr)
            return 1
        print(summary(report, args.runs / args.name))
        return 0
    if args.command == "bench":
        return _bench(args.out, args.quick, args.repo)
    if args.command == "inspect":
        from .inspect import inspect_layer

        print(inspect_layer(args.layer, args.seq_len, args.preset, args.chunk))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
