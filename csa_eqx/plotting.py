"""Pictures of what a layer's indexer picks, for notebooks: ``plot_picks`` draws the scores
behind a selection (``layer.indexer_scores``) with each query's picks marked. matplotlib is
optional (the ``notebook`` and ``demo`` extras install it) and imported only when a picture
is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import ArrayLike, Float, Int

__all__ = ["plot_picks"]


def _pyplot():
    """``matplotlib.pyplot``, or an ``ImportError`` that says how to install it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "csa_eqx.plot_picks draws with matplotlib, which is not installed: "
            "pip install matplotlib (or the notebook extra, pip install '.[notebook]' "
            "from a checkout)"
        ) from error
    return plt


def plot_picks(
    scores: Float[ArrayLike, "batch nq entries"],
    picks: Int[ArrayLike, "batch nq k"],
    queries: Sequence[int] | None = None,
    *,
    batch: int = 0,
    ax: Any = None,
):
    """Draw the indexer scores of some queries against every entry, with each query's picks
    outlined: one row per query, one column per entry (V4: compressed-entry slot, V3.2:
    token); entries a query cannot see are dark.

    **Arguments:**

    - ``scores``, ``picks``: ``layer.indexer_scores(x, queries)``'s ``[B, nq, T]`` scores
        (``-inf`` = not visible) and ``[B, nq, k]`` picks (``-1`` = none).
    - ``queries``: the query rows they belong to, for the axis labels (``None``: ``0 ..
        nq - 1``).
    - ``batch``: which batch row to draw.
    - ``ax``: the matplotlib ``Axes`` to draw on (``None``: a new figure's).

    **Returns:** the ``Axes``. An ``ImportError`` naming the install command when matplotlib
    is missing.
    """
    plt = _pyplot()
    s = np.asarray(scores, np.float32)[batch]
    p = np.asarray(picks)[batch]
    nq, entries = s.shape
    labels = list(range(nq)) if queries is None else list(queries)
    if len(labels) != nq:
        raise ValueError(f"queries must name the {nq} rows of scores (got {len(labels)})")
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2 + entries / 6, 12), min(1.5 + nq / 3, 8)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#2b2b2b")  # not visible: dark
    image = ax.imshow(np.ma.masked_invalid(s), cmap=cmap, aspect="auto", interpolation="nearest")
    rows, slots = np.nonzero(p >= 0)
    ax.scatter(p[rows, slots], rows, marker="s", s=60, facecolors="none", edgecolors="red")
    ticks = range(0, nq, -(-nq // 16))  # at most 16 labelled rows
    ax.set_yticks(ticks, [str(labels[i]) for i in ticks])
    ax.set_xlabel("entry (dark: not visible; red: picked)")
    ax.set_ylabel("query")
    ax.figure.colorbar(image, ax=ax, label="indexer score")
    return ax
