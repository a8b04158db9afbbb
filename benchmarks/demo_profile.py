"""Where the main job's time goes: ``csa-eqx train`` in this process, timed per section.

``python -m benchmarks.demo_profile [csa-eqx train flags]`` (e.g. ``--controls none``) runs the
training (with its controls, as ``make demo`` does) and prints, for the run and each control,
the wall time and XLA compile time of the training steps per (stage, row length, batch), of
the evaluations, the checkpoints and the plots (wall and process CPU seconds: CPU time moves
less with other work on the machine), plus the machine's load average at the start
and the end (the 2-core machines are shared: compare runs only at similar load). The sections
are timed by wrapping ``csa_eqx.demo.train``'s step function, ``evaluate``,
``save_checkpoint`` and ``plot_run``; each step is waited for, so a step's time includes its
compile; compile time is JAX's ``backend_compile_duration`` event.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

import jax
from jax import monitoring

from csa_eqx.demo import train as trainer
from csa_eqx.demo.cli import build_parser, train_config

TOTAL = "the whole run"


class Profile:
    """Wall seconds, compile seconds and calls per section ``(variant, what)``."""

    def __init__(self):
        self.section = ("start-up", "")
        self.wall = collections.defaultdict(float)
        self.cpu = collections.defaultdict(float)
        self.compile = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.variant = "csa"
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compile[self.section] += duration

    def timed(self, what: str, fn, *args, **kwargs):
        outer, self.section = self.section, (self.variant, what)
        start, cpu = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self.wall[self.section] += time.perf_counter() - start
        self.cpu[self.section] += time.process_time() - cpu
        self.calls[self.section] += 1
        self.section = outer
        return out

    def install(self) -> None:
        """Wrap the trainer's step function, evaluation, checkpoints, plots and runs."""
        step_factory, run = trainer._train_step, trainer._run

        def train_step(opt, stage):
            step = step_factory(opt, stage)

            def timed_step(model, opt_state, tokens, targets):
                b, s = tokens.shape
                return self.timed(
                    f"steps: {stage}, {s} tokens x {b}", step, model, opt_state, tokens, targets
                )

            return timed_step

        def wrap(what, fn):
            return lambda *a, **k: self.timed(what, fn, *a, **k)

        def timed_run(cfg, *args, **kwargs):
            self.variant = cfg.variant
            return self.timed(TOTAL, run, cfg, *args, **kwargs)

        trainer._train_step = train_step
        trainer.evaluate = wrap("evaluations", trainer.evaluate)
        trainer.save_checkpoint = wrap("checkpoints", trainer.save_checkpoint)
        trainer.plot_run = wrap("plots", trainer.plot_run)
        trainer._run = timed_run

    def markdown(self) -> str:
        """One table row per section; "rest" is the run's time outside them (model set-up,
        data, reports)."""
        rows = ["| run | section | calls | wall (s) | CPU (s) | compile (s) |"]
        rows.append("|---|---|---|---|---|---|")
        for variant in dict.fromkeys(v for v, _ in self.wall):
            keys = [k for k in self.wall if k[0] == variant and k[1] != TOTAL]
            total = (variant, TOTAL)
            rest = [t[total] - sum(t[k] for k in keys) for t in (self.wall, self.cpu)]
            for key in sorted(keys):
                rows.append(
                    f"| {variant} | {key[1]} | {self.calls[key]} | {self.wall[key]:.1f} | "
                    f"{self.cpu[key]:.1f} | {self.compile[key]:.1f} |"
                )
            rows.append(
                f"| {variant} | rest | | {rest[0]:.1f} | {rest[1]:.1f} | "
                f"{self.compile[total]:.1f} |"
            )
            compiled = sum(v for k, v in self.compile.items() if k[0] == variant)
            rows.append(
                f"| {variant} | **{TOTAL}** | | {self.wall[total]:.1f} | {self.cpu[total]:.1f} | "
                f"{compiled:.1f} |"
            )
        return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(["train", *argv])
    jax.config.update("jax_num_cpu_devices", args.devices)  # as `csa-eqx train --devices N`
    cfg = train_config(args)
    profile = Profile()
    profile.install()
    load = os.getloadavg()[0]
    start = time.perf_counter()
    report = trainer.train(cfg, Path(args.runs) / cfg.name, sys.stderr)
    total = time.perf_counter() - start
    print(f"\ncommand: python -m benchmarks.demo_profile {' '.join(argv)}")
    print(
        f"load average: {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"{os.cpu_count()} cores; JAX {jax.__version__}"
    )
    print(
        f"total (training and controls, without interpreter start-up): {total:.0f} s; "
        f"retrieval_accuracy={report.get('retrieval_accuracy')} "
        f"indexer_recall={report.get('indexer_recall')} lm_loss={report['lm_loss']}"
    )
    print(profile.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
