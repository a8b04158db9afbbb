"""``csa-eqx train``: a small CSA model on the embedded retrieval task (the project's main job).

Three phases, as in DeepSeek's recipe for sparse attention:

1. ``dense`` — the CSA layers attend to *all* visible compressed entries; the model learns the
   task from the LM loss while the indexer is distilled (KL) from that dense attention.
2. ``warmup`` — dense attention, everything frozen except the indexer (KL only).
3. ``sparse`` — CSA layers attend to the indexer's top-k only; the model trains on the LM loss,
   the indexer on the sparse-stage KL loss.

Runs on all local devices with a ``data × tensor`` mesh (batch over ``data``, the indexer's
top-k rows over ``tensor``), with the selection saved for the backward pass. Checkpoints every
``checkpoint_every`` steps make an interrupted run resume where it stopped.
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

from .config import TrainConfig
from .mesh import make_mesh, shard_batch
from .models import DecoderLM
from .models.probe import indexer_recall
from .plots import plot_run

__all__ = ["TrainConfig", "train"]


def _labels(model: DecoderLM, phase: str):
    """Which leaves train in ``phase`` (warm-up trains the indexers only)."""
    params = eqx.filter(model, eqx.is_array)

    def label(path, _):
        in_indexer = any(getattr(p, "name", None) == "indexer" for p in path)
        return "train" if phase != "warmup" or in_indexer else "freeze"

    return jax.tree_util.tree_map_with_path(label, params)


def _optimizer(model: DecoderLM, cfg: TrainConfig, phase: str):
    adam = optax.adamw(cfg.learning_rate, weight_decay=0.0)
    labels = _labels(model, phase)  # a DecoderLM of strings: callable, so wrap it
    return optax.multi_transform({"train": adam, "freeze": optax.set_to_zero()}, lambda _: labels)


def _answer_metrics(logits, targets):
    """Cross-entropy and accuracy over the answer positions (``targets >= 0``)."""
    mask = targets >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    n = jnp.maximum(jnp.sum(mask), 1)
    return jnp.sum(ce * mask) / n, jnp.sum((jnp.argmax(logits, -1) == targets) & mask) / n


def _stage(phase: str) -> str:
    """The indexers' training stage in ``phase``: dense until the sparse phase."""
    return "sparse" if phase == "sparse" else "dense"


def _loss(model: DecoderLM, tokens, targets, stage: str):
    logits, aux = model(tokens, return_aux=True, indexer_loss=stage)
    ce, acc = _answer_metrics(logits, targets)
    return ce + aux["indexer_loss"], {"ce": ce, "accuracy": acc, "kl": aux["indexer_loss"]}


def _train_step(opt, phase: str):
    @eqx.filter_jit(donate="all-except-first")
    def step(model, opt_state, tokens, targets):
        loss = eqx.filter_grad(_loss, has_aux=True)
        grads, metrics = loss(model, tokens, targets, _stage(phase))
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, metrics

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


def _save(path: Path, model, opt_state, step: int, history: list, cfg: TrainConfig) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps({"step": step, "config": dataclasses.asdict(cfg)}).encode() + b"\n")
        eqx.tree_serialise_leaves(f, (model, opt_state))
    tmp.replace(path)
    (path.parent / "history.json").write_text(json.dumps(history))


def _load(path: Path, cfg: TrainConfig, start: Callable[[str], tuple]):
    """Resume: ``(step, phase, model, opt, opt_state, history)`` from ``path``;
    ``start(phase)`` builds a fresh ``(model, opt, opt_state)`` of the right structure."""
    with open(path, "rb") as f:
        meta = json.loads(f.readline())
        if meta["config"] != json.loads(json.dumps(dataclasses.asdict(cfg))):
            raise ValueError(
                f"checkpoint {path} was written by a different configuration; "
                "use a new --name or delete the run folder"
            )
        step = meta["step"]
        phase = cfg.phase_at(min(step, cfg.total_steps - 1))
        model, opt, opt_state = start(phase)
        model, opt_state = eqx.tree_deserialise_leaves(f, (model, opt_state))
    history = json.loads((path.parent / "history.json").read_text())
    return step, phase, model, opt, opt_state, history


def evaluate(model: DecoderLM, cfg: TrainConfig, mesh, phase: str = "sparse") -> dict:
    """Retrieval accuracy (attending as in ``phase``) and indexer recall on held-out batches
    (steps < 0 never train)."""
    task = cfg.task()
    accs, recalls = [], []
    stage = _stage(phase)
    run = eqx.filter_jit(lambda m, t, y: _answer_metrics(m(t, indexer_loss=stage), y)[1])
    for i in range(cfg.eval_batches):
        tokens, targets = (shard_batch(a, mesh) for a in task.batch(-1 - i, cfg.batch_size))
        accs.append(float(run(model, tokens, targets)))
        recalls.append(float(indexer_recall(model, tokens, targets >= 0)))
    return {"retrieval_accuracy": float(np.mean(accs)), "indexer_recall": float(np.mean(recalls))}


def train(cfg: TrainConfig, out_dir: Path, stream, *, stop_after: int | None = None) -> dict:
    """Run (or resume) training; writes checkpoints, ``report.json`` and plots to ``out_dir``.

    ``stop_after`` ends the run early after that many steps in this call (used to test resume).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(cfg.mesh)
    start_time = time.perf_counter()
    ckpt = out_dir / "checkpoint.eqx"
    with jax.set_mesh(mesh):
        initial = DecoderLM(cfg.model_config(), key=jax.random.key(cfg.seed))

        def start(phase: str, model: DecoderLM = initial):
            opt = _optimizer(model, cfg, phase)
            return model, opt, opt.init(eqx.filter(model, eqx.is_array))

        step, history, phase = 0, [], cfg.phase_at(0)
        model, opt, opt_state = start(phase)
        if ckpt.exists():
            step, phase, model, opt, opt_state, history = _load(ckpt, cfg, start)
        step_fn = _train_step(opt, phase)
        progress = Progress(cfg.total_steps, stream)
        done_here, tokens_seen, t0 = 0, 0, time.perf_counter()
        while step < cfg.total_steps and (stop_after is None or done_here < stop_after):
            if cfg.phase_at(step) != phase:
                phase = cfg.phase_at(step)
                model, opt, opt_state = start(phase, model)
                step_fn = _train_step(opt, phase)
            tokens, targets = cfg.task(cfg.seq_len_at(step)).batch(step, cfg.batch_size)
            model, opt_state, metrics = step_fn(
                model, opt_state, shard_batch(tokens, mesh), shard_batch(targets, mesh)
            )
            step += 1
            done_here += 1
            tokens_seen += tokens.size
            if step % cfg.eval_every == 0 or step == cfg.total_steps:
                record = {
                    "step": step,
                    "phase": phase,
                    **{k: float(v) for k, v in metrics.items()},
                    **evaluate(model, cfg, mesh, phase),
                    "tokens_per_second": tokens_seen / (time.perf_counter() - t0),
                }
                history.append(record)
                progress.update(
                    step,
                    f"{phase} loss={record['ce']:.3f} "
                    f"acc={record['retrieval_accuracy']:.2f} "
                    f"recall={record['indexer_recall']:.2f} "
                    f"tok/s={record['tokens_per_second']:.0f}",
                )
            if step % cfg.checkpoint_every == 0 or step == cfg.total_steps:
                _save(ckpt, model, opt_state, step, history, cfg)
        progress.close()
        final = evaluate(model, cfg, mesh, phase) if step >= cfg.total_steps else {}
    report = {
        "name": cfg.name,
        "finished": step >= cfg.total_steps,
        "step": step,
        **final,
        "wall_seconds": time.perf_counter() - start_time,
        "devices": jax.local_device_count(),
        "mesh": dict(mesh.shape),
        "config": dataclasses.asdict(cfg),
        "history": history,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    if history:
        with jax.set_mesh(mesh):
            plot_run(history, model, cfg, out_dir, mesh)
    return report
