"""``csa-eqx`` command line: ``train``, ``bench`` and ``inspect``."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path


def _simulated_devices(n: int) -> None:
    """Ask for ``n`` simulated CPU devices (only effective before JAX starts its backend; the
    CPU backend is the only one it changes, so accelerators are used as they are)."""
    import jax

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


def _mesh(text: str) -> tuple[int, int]:
    try:
        data, tensor = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"mesh must look like DATAxTENSOR, e.g. 2x2 (got {text})"
        ) from None
    if data <= 0 or tensor <= 0:
        raise argparse.ArgumentTypeError(f"mesh sizes must be positive (got {text})")
    return data, tensor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csa-eqx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a small CSA model on the embedded retrieval task")
    t.add_argument("--name", default="demo", help="run name; output goes to RUNS/NAME")
    t.add_argument("--runs", type=Path, default=Path("runs"), help="folder for runs")
    t.add_argument("--seq-len", type=_positive, default=512)
    t.add_argument("--batch-size", type=_positive, default=16)
    t.add_argument("--pairs", type=_positive, default=16, help="key/value pairs per sequence")
    t.add_argument("--dense-steps", type=_non_negative, default=300)
    t.add_argument("--warmup-steps", type=_non_negative, default=50)
    t.add_argument("--sparse-steps", type=_non_negative, default=150)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--topk", type=_positive, default=8)
    t.add_argument("--window", type=_positive, default=32)
    t.add_argument("--hidden", type=_positive, default=128)
    t.add_argument("--eval-every", type=_positive, default=25)
    t.add_argument("--checkpoint-every", type=_positive, default=50)
    t.add_argument("--mesh", type=_mesh, default=(0, 0), help="DATAxTENSOR (default: automatic)")
    t.add_argument(
        "--devices",
        type=_positive,
        default=4,
        help="simulated CPU devices when JAX only finds one CPU (default 4)",
    )
    t.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bench", help="regenerate the benchmark tables and plots")
    b.add_argument("--out", type=Path, default=Path("docs"), help="where tables/plots go")
    b.add_argument("--quick", action="store_true", help="small sizes (smoke test)")

    i = sub.add_parser("inspect", help="a layer's shapes, parameter counts and memory estimate")
    i.add_argument("--layer", choices=["sliding", "csa", "hca", "dsa"], default="csa")
    i.add_argument("--seq-len", type=_positive, default=16384)
    i.add_argument("--preset", choices=["v4-flash", "tiny"], default="v4-flash")
    i.add_argument("--chunk", type=_non_negative, default=0, help="qk_head_chunk_size")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        if args.lr <= 0:
            build_parser().error(f"--lr must be positive (got {args.lr})")
        _simulated_devices(args.devices)
        from .train import TrainConfig, train

        cfg = TrainConfig(
            name=args.name,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            n_pairs=args.pairs,
            dense_steps=args.dense_steps,
            warmup_steps=args.warmup_steps,
            sparse_steps=args.sparse_steps,
            learning_rate=args.lr,
            index_topk=args.topk,
            sliding_window=args.window,
            hidden_size=args.hidden,
            eval_every=args.eval_every,
            checkpoint_every=args.checkpoint_every,
            mesh=args.mesh,
            seed=args.seed,
        )
        try:
            report = train(cfg, args.runs / args.name, sys.stdout)
        except ValueError as err:
            print(f"csa-eqx train: error: {err}", file=sys.stderr)
            return 2
        print(
            f"retrieval_accuracy={report.get('retrieval_accuracy', float('nan')):.3f} "
            f"indexer_recall={report.get('indexer_recall', float('nan')):.3f} "
            f"wall_seconds={report['wall_seconds']:.0f} -> {args.runs / args.name}"
        )
        return 0
    if args.command == "bench":
        # benchmarks/ is a top-level folder of the source checkout, not part of the package
        root = Path(__file__).resolve().parent.parent
        if not (root / "benchmarks" / "run_all.py").is_file():
            print(
                "csa-eqx bench: error: needs a source checkout (benchmarks/ next to csa_eqx/)",
                file=sys.stderr,
            )
            return 2
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from benchmarks.run_all import main as bench_main

        return bench_main(args.out, quick=args.quick)
    if args.command == "inspect":
        from .inspect import inspect_layer

        print(inspect_layer(args.layer, args.seq_len, args.preset, args.chunk))
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
