"""PNG plots for a training run: loss, accuracy/recall, one query's selections, controls."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import numpy as np

from .mesh import shard_batch


def smooth(values: list[float], weight: float = 0.9) -> np.ndarray:
    """Exponential moving average with bias correction (the first points are not pulled
    towards zero)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return np.asarray(out)


def evaluations(history: list[dict]) -> list[dict]:
    """The records of ``history`` that hold an evaluation."""
    return [h for h in history if "retrieval_accuracy" in h]


def plot_run(history: list[dict], model, cfg, out_dir: Path, mesh) -> None:
    """Write ``loss.png`` (every step, raw and smoothed), ``recall.png`` (each evaluation) and,
    when the model has a CSA layer, ``selections.png`` into ``out_dir``."""
    plt = _pyplot()
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label, color in (
        ("ce", "LM loss (answer)", "tab:blue"),
        ("kl", "indexer KL", "tab:orange"),
    ):
        values = [max(h[key], 1e-6) for h in history]
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth(values), color=color, label=f"{label} (smoothed)")
    _shade_phases(ax, cfg)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)

    evals = evaluations(history)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in evals]
    ax.plot(steps, [h["retrieval_accuracy"] for h in evals], "o-", label="retrieval accuracy")
    if any(h["indexer_recall"] is not None for h in evals):
        ax.plot(steps, [h["indexer_recall"] for h in evals], "o-", label="indexer recall")
    _shade_phases(ax, cfg)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "recall.png", dpi=100)
    plt.close(fig)
    if cfg.variant == "csa":
        _plot_selections(model, cfg, out_dir, mesh, plt)


def plot_controls(report: dict, out_dir: Path) -> None:
    """``controls.png``: retrieval accuracy of the run and of each control, step by step."""
    plt = _pyplot()
    runs = {"CSA (the recipe)": report["history"]}
    names = {"sliding": "sliding window only", "dense": "dense over all entries"}
    runs.update({names[k]: c["history"] for k, c in report["controls"].items()})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, history in runs.items():
        evals = evaluations(history)
        ax.plot(
            [h["step"] for h in evals], [h["retrieval_accuracy"] for h in evals], "o-", label=label
        )
    chance = 1 / report["config"]["n_values"]
    ax.axhline(chance, color="grey", linestyle=":", label="chance")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("retrieval accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "controls.png", dpi=100)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_selections(model, cfg, out_dir: Path, mesh, plt) -> None:
    """``selections.png``: the first CSA layer's top-k entries for each query of one row
    (nothing when the model has no layer with an indexer)."""
    tokens, _ = cfg.task().batch(-1, cfg.batch_size)
    _, aux = eqx.filter_jit(lambda m, t: m(t, return_aux=True))(model, shard_batch(tokens, mesh))
    layer = next((i for i, s in enumerate(aux["selections"]) if s is not None), None)
    if layer is None:
        return
    sel = np.asarray(aux["selections"][layer][0])
    s, k = sel.shape
    grid = np.zeros((s, -(-s // 4)))
    rows = np.repeat(np.arange(s), k)
    keep = sel.reshape(-1) >= 0
    grid[rows[keep], sel.reshape(-1)[keep]] = 1
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.imshow(grid, aspect="auto", cmap="Greys", interpolation="nearest")
    pairs = cfg.task().pair_positions(tokens[:1])[0]
    rows = np.nonzero(pairs >= 0)[0]
    ax.scatter(
        pairs[rows] // 4,
        rows,
        s=12,
        facecolors="none",
        edgecolors="tab:red",
        label="entry holding the queried pair",
    )
    ax.set_xlabel("compressed entry")
    ax.set_ylabel("query position")
    ax.set_title(f"layer {layer} (CSA): entries each query selects")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "selections.png", dpi=100)
    plt.close(fig)


def _shade_phases(ax, cfg) -> None:
    edges = [0, cfg.dense_steps, cfg.dense_steps + cfg.warmup_steps, cfg.total_steps]
    for (lo, hi), color in zip(
        zip(edges[:-1], edges[1:], strict=True), ("#eef", "#efe", "#fee"), strict=True
    ):
        if hi > lo:
            ax.axvspan(lo, hi, color=color, zorder=0)
