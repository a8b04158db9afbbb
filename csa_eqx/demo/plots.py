"""PNG plots for a training run: loss, accuracy/recall, and one query's selections."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import numpy as np

from .mesh import shard_batch


def plot_run(history: list[dict], model, cfg, out_dir: Path, mesh) -> None:
    """Write ``loss.png``, ``recall.png`` and ``selections.png`` into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["ce"] for h in history], label="LM loss (answer)")
    ax.plot(steps, [h["kl"] for h in history], label="indexer KL")
    _shade_phases(ax, cfg)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["retrieval_accuracy"] for h in history], label="retrieval accuracy")
    ax.plot(steps, [h["indexer_recall"] for h in history], label="indexer recall")
    _shade_phases(ax, cfg)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "recall.png", dpi=100)
    plt.close(fig)

    tokens, _ = cfg.task().batch(-1, cfg.batch_size)
    _, aux = eqx.filter_jit(lambda m, t: m(t, return_aux=True))(model, shard_batch(tokens, mesh))
    layer = next(i for i, s in enumerate(aux["selections"]) if s is not None)
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
