"""``csa-eqx train``: a small CSA model on the embedded retrieval task (the project's main job).

Three phases, as in DeepSeek's recipe for sparse attention:

1. ``dense`` — the CSA layers attend to *all* visible compressed entries; the model learns the
   task from the LM loss while the indexer is distilled (KL) from that dense attention.
2. ``warmup`` — dense attention, everything frozen except the indexer (KL only).
3. ``sparse`` — CSA layers attend to the indexer's top-k only; the model trains on the LM loss,
   the indexer on the sparse-stage KL loss.

Runs on all local devices with a ``data × tensor`` mesh (batch over ``data``, the indexer's
top-k rows over ``tensor``), with the selection saved for the backward pass. A checkpoint every
``checkpoint_every`` steps (one atomic file with the model, the optimizer state and its phase,
the step and the history; see ``checkpoint.py``) makes a run killed at any instant resume to the
same result as an uninterrupted one. A non-finite loss stops the run with ``RunError``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .checkpoint import (
    RunError,
    kill_point,
    prepare_folder,
    read_checkpoint,
    restore,
    save_checkpoint,
    unusable,
    write_atomic,
)
from .config import LOSS_WINDOW, PHASES, TARGETS, TrainConfig
from .mesh import make_mesh, shard_batch
from .models import DecoderLM
from .models.probe import indexer_recall
from .plots import plot_controls, plot_run

__all__ = ["CHECKPOINT", "RunError", "TrainConfig", "evaluate", "targets_met", "train"]

CHECKPOINT = "checkpoint.eqx"  # in the run folder; see checkpoint.py for its format


def _labels(model: DecoderLM, phase: str):
    """Which leaves train in ``phase`` (warm-up trains the indexers only)."""
    params = eqx.filter(model, eqx.is_array)

    def label(path, _):
        in_indexer = any(getattr(p, "name", None) == "indexer" for p in path)
        return "train" if phase != "warmup" or in_indexer else "freeze"

    return jax.tree_util.tree_map_with_path(label, params)


def _optimizer(model: DecoderLM, cfg: TrainConfig, phase: str):
    """AdamW on ``phase``'s trainable leaves, with a fresh schedule per phase (each phase starts
    a new optimizer state): linear warm-up from 10% of the phase's peak
    (``cfg.peak_learning_rate``), cosine decay to 10%, global-norm clipping."""
    steps = cfg.phase_steps(phase)
    warmup = min(cfg.lr_warmup_steps, steps // 2)
    peak = cfg.peak_learning_rate(phase)
    schedule = optax.warmup_cosine_decay_schedule(
        0.1 * peak, peak, warmup, max(steps, warmup + 1), 0.1 * peak
    )
    adam = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(schedule, weight_decay=0.0)
    )
    labels = _labels(model, phase)  # a DecoderLM of strings: callable, so wrap it
    return optax.multi_transform({"train": adam, "freeze": optax.set_to_zero()}, lambda _: labels)


def _answer_metrics(logits, targets):
    """Cross-entropy and accuracy over the answer positions (``targets >= 0``)."""
    mask = targets >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    n = jnp.maximum(jnp.sum(mask), 1)
    return jnp.sum(ce * mask) / n, jnp.sum((jnp.argmax(logits, -1) == targets) & mask) / n


def _loss(model: DecoderLM, tokens, targets, stage: str):
    logits, aux = model(tokens, return_aux=True, indexer_loss=stage)
    ce, acc = _answer_metrics(logits, targets)
    return ce + aux["indexer_loss"], {"ce": ce, "accuracy": acc, "kl": aux["indexer_loss"]}


def _train_step(opt, stage: str):
    @eqx.filter_jit(donate="all-except-first")
    def step(model, opt_state, tokens, targets):
        loss = eqx.filter_grad(_loss, has_aux=True)
        grads, metrics = loss(model, tokens, targets, stage)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        leaves = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
        return model, opt_state, metrics, finite

    return step


class Progress:
    """A one-line progress bar on stderr-like streams (no dependency)."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.start = total, stream, time.perf_counter()

    def update(self, step: int, text: str) -> None:
        frac = step / max(self.total, 1)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        self.stream.write(f"\r[{bar}] {step}/{self.total} {text}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


EVAL_KEYS = ("retrieval_accuracy", "indexer_recall")  # what ``evaluate`` returns


def lm_loss(history: list[dict]) -> dict:
    """The mean answer loss ``ce`` of the last ``LOSS_WINDOW`` steps of the dense phase
    (``dense_end``) and of the run (``final``); ``None`` where there are no such steps."""

    def mean(records):
        return float(np.mean([h["ce"] for h in records[-LOSS_WINDOW:]])) if records else None

    dense = [h for h in history if h["phase"] == "dense"]
    return {"dense_end": mean(dense), "final": mean(history)}


@eqx.filter_jit
def _eval_accuracy(model: DecoderLM, tokens, targets, stage: str):
    """Answer accuracy of one held-out batch (compiled once per shape and ``stage``)."""
    return _answer_metrics(model(tokens, indexer_loss=stage), targets)[1]


_eval_recall = eqx.filter_jit(indexer_recall)  # compiled once per shape, not run op by op


def evaluate(model: DecoderLM, cfg: TrainConfig, mesh, phase: str = "sparse") -> dict:
    """Retrieval accuracy (attending as in ``phase``) and indexer recall on held-out batches
    (steps < 0 never train)."""
    task = cfg.task()
    accs, recalls = [], []
    stage = cfg.stage(phase)
    for i in range(cfg.eval_batches):
        tokens, targets = (shard_batch(a, mesh) for a in task.batch(-1 - i, cfg.batch_size))
        accs.append(float(_eval_accuracy(model, tokens, targets, stage)))
        recalls.append(float(_eval_recall(model, tokens, targets >= 0)))
    recall = float(np.mean(recalls))
    return {
        "retrieval_accuracy": float(np.mean(accs)),
        "indexer_recall": recall if np.isfinite(recall) else None,  # None: no CSA layer
    }


def _resume(path: Path, cfg: TrainConfig, start: Callable[[str], tuple]):
    """``(step, phase, model, opt, opt_state, history)`` from the checkpoint ``path``; the
    optimizer is rebuilt for the phase the checkpoint was written in (``start(phase)`` gives a
    fresh ``(model, opt, opt_state)`` of that phase's structure)."""
    header, payload = read_checkpoint(path)
    config = json.loads(json.dumps(dataclasses.asdict(cfg)))
    if header["config"] != config:
        keys = set(config) | set(header["config"])
        changed = sorted(k for k in keys if header["config"].get(k) != config.get(k))
        raise unusable(path, f"it was written by a different configuration (differs in {changed})")
    step, phase = header["step"], header["phase"]
    if not (isinstance(step, int) and 0 < step <= cfg.total_steps and phase in PHASES):
        raise unusable(path, f"its step {step!r} / phase {phase!r} do not fit this run")
    model, opt, opt_state = start(phase)
    model, opt_state = restore(path, payload, (model, opt_state))
    return step, phase, model, opt, opt_state, header["history"]


def _check_finite(metrics: dict, weights_finite, step: int, phase: str, ckpt: Path, saved: int):
    """Stop with ``RunError`` when a loss or a weight is no longer finite (nothing is saved)."""
    losses = {k: float(metrics[k]) for k in ("ce", "kl")}
    if all(np.isfinite(v) for v in losses.values()) and bool(weights_finite):
        return
    what = ", ".join(f"{k}={v}" for k, v in losses.items())
    what += "" if bool(weights_finite) else ", non-finite weights after the update"
    kept = (
        f"the last good checkpoint {ckpt} (step {saved}) is kept"
        if saved
        else "no checkpoint was written yet"
    )
    raise RunError(
        f"non-finite training at step {step} ({phase} phase): {what}. Training stopped; "
        f"{kept}. Running the same command again would fail the same way: start over under a "
        "new --name with a smaller --lr (or another --seed)."
    )


def train(cfg: TrainConfig, out_dir: Path, stream, *, stop_after: int | None = None) -> dict:
    """Run (or resume) training, then its control runs; writes checkpoints, ``report.json`` and
    plots to ``out_dir`` (each control in ``out_dir/control-NAME``).

    **Arguments:** ``cfg``: the run; ``out_dir``: its folder (``checkpoint.eqx`` there is
    resumed from); ``stream``: where the progress bar goes; ``stop_after``: end early after
    that many steps in this call (used to test resume; the controls run once the main run
    has finished).

    **Returns:** the report (also written to ``out_dir/report.json``): the final
    ``retrieval_accuracy`` / ``indexer_recall``, ``targets_met``, ``lm_loss`` (the answer loss
    at the end of the dense phase and of the run, see ``lm_loss``), ``wall_seconds``, the
    ``history`` (one record per step; evaluations every ``eval_every`` steps) and ``controls``
    (each control's final metrics and history). Raises ``RunError`` for an unusable checkpoint,
    an unwritable folder or a non-finite loss.
    """
    report = _run(cfg, out_dir, stream, stop_after)
    if report["finished"] and cfg.controls:
        for variant in cfg.controls:
            stream.write(f"control run: {variant}\n")
            control = _run(cfg.control(variant), out_dir / f"control-{variant}", stream)
            report["controls"][variant] = {
                k: control.get(k) for k in (*EVAL_KEYS, "lm_loss", "wall_seconds", "history")
            }
        write_atomic(
            out_dir / "report.json", json.dumps(report, indent=2).encode(), cfg.total_steps
        )
        plot_controls(report, out_dir)
    return report


def _run(cfg: TrainConfig, out_dir: Path, stream, stop_after: int | None = None) -> dict:
    """One run (no controls): writes its files and plots, returns its report."""
    prepare_folder(out_dir)
    mesh = make_mesh(cfg.mesh)
    start_time = time.perf_counter()
    ckpt = out_dir / CHECKPOINT
    config = dataclasses.asdict(cfg)
    with jax.set_mesh(mesh):
        initial = DecoderLM(cfg.model_config(), key=jax.random.key(cfg.seed))

        def start(phase: str, model: DecoderLM = initial):
            opt = _optimizer(model, cfg, phase)
            return model, opt, opt.init(eqx.filter(model, eqx.is_array))

        step, history, phase = 0, [], cfg.phase_at(0)
        if ckpt.exists():
            step, phase, model, opt, opt_state, history = _resume(ckpt, cfg, start)
        else:
            model, opt, opt_state = start(phase)
        saved = step
        step_fn = _train_step(opt, cfg.stage(phase))
        progress = Progress(cfg.total_steps, stream)
        done_here, tokens_seen, t0 = 0, 0, time.perf_counter()
        while step < cfg.total_steps and (stop_after is None or done_here < stop_after):
            if cfg.phase_at(step) != phase:
                phase = cfg.phase_at(step)
                model, opt, opt_state = start(phase, model)
                step_fn = _train_step(opt, cfg.stage(phase))
            seq_len = cfg.seq_len_at(step)
            tokens, targets = cfg.task(seq_len).batch(step, cfg.batch_at(step))
            model, opt_state, metrics, finite = step_fn(
                model, opt_state, shard_batch(tokens, mesh), shard_batch(targets, mesh)
            )
            step += 1
            done_here += 1
            tokens_seen += tokens.size
            _check_finite(metrics, finite, step, phase, ckpt, saved)
            kill_point(step, "step")
            record = {"step": step, "phase": phase, "seq_len": seq_len}
            record.update({k: float(v) for k, v in metrics.items()})
            if step % cfg.eval_every == 0 or step == cfg.total_steps:
                record.update(evaluate(model, cfg, mesh, phase))
                record["tokens_per_second"] = tokens_seen / (time.perf_counter() - t0)
                progress.update(step, _progress_text(record))
            history.append(record)
            if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
                save_checkpoint(
                    ckpt, (model, opt_state), step=step, phase=phase, config=config, history=history
                )
                saved = step
                write_atomic(out_dir / "history.json", json.dumps(history).encode(), step)
        progress.close()
        # the last step's evaluation (every run evaluates at its last step) is the result
        final = {k: history[-1][k] for k in EVAL_KEYS} if step >= cfg.total_steps else {}
    write_atomic(out_dir / "history.json", json.dumps(history).encode(), step)
    report = {
        "name": cfg.name,
        "variant": cfg.variant,
        "finished": step >= cfg.total_steps,
        "step": step,
        **final,
        "targets_met": bool(final) and targets_met(final),
        "lm_loss": lm_loss(history),
        "wall_seconds": time.perf_counter() - start_time,
        "devices": jax.local_device_count(),
        "mesh": dict(mesh.shape),
        "config": config,
        "history": history,
        "controls": {},
    }
    write_atomic(out_dir / "report.json", json.dumps(report, indent=2).encode(), step)
    if history:
        with jax.set_mesh(mesh):
            plot_run(history, model, cfg, out_dir, mesh)
        kill_point(step, "plots")
    return report


def targets_met(metrics: dict) -> bool:
    """Whether ``metrics`` reach every target of ``TARGETS`` (a missing recall misses)."""
    return all((metrics.get(k) or 0.0) >= v for k, v in TARGETS.items())


def _progress_text(record: dict) -> str:
    recall = record["indexer_recall"]
    return (
        f"{record['phase']} loss={record['ce']:.3f} acc={record['retrieval_accuracy']:.2f} "
        f"recall={'-' if recall is None else f'{recall:.2f}'} "
        f"tok/s={record['tokens_per_second']:.0f}"
    )
