"""``compare.png`` for replicates: each point's final metric as the mean of its finished seeds with an error bar
of one standard deviation, every seed drawn as a dot beside it. A point of one seed is a dot with no bar (no
spread is invented). The x axis is the one setting the points differ in when it is a number (a batch sweep),
else the points by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_rank.experiments.replicates import Replicates
from ddp_rank.extras import save_figure

__all__ = ["draw_points"]


def draw_points(replicates: Replicates, path: Path, x_key: str | None, plt: Any) -> Path | None:
    """Draw ``replicates.metric`` per point into ``path`` with matplotlib's ``plt``; None when no point has a
    finished run with that metric."""
    metric = replicates.metric
    points = [p for p in replicates.points if p.values(metric)]
    if not points:
        return None
    keys = [k for k in replicates.keys if x_key is None or k == x_key]
    swept = x_key or (keys[0] if len(replicates.factors) == 1 and keys else None)
    values = [dict(p.settings).get(swept) for p in points] if swept else []
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    numeric = bool(values) and len(numbers) == len(points)
    if numeric:
        order = sorted(range(len(points)), key=lambda i: numbers[i])
        xs = [numbers[i] for i in order]
    else:
        order, xs = list(range(len(points))), [float(i) for i in range(len(points))]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    means, errors = [], []
    for x, i in zip(xs, order, strict=True):
        stats = points[i].stats(metric)
        means.append(100 * stats["mean"])
        errors.append(100 * stats["std"] if stats["std"] is not None else 0.0)
        seeds = [100 * v for v in points[i].values(metric)]
        beside = x * 1.04 if numeric else x + 0.08  # beside the bar, not hidden behind it
        ax.plot([beside] * len(seeds), seeds, "o", color="0.5", markersize=3, zorder=1)
    ax.errorbar(
        xs,
        means,
        yerr=errors,
        fmt="o-" if numeric else "o",
        capsize=4,
        zorder=2,
        label=f"final {metric}: mean ± std over seeds (dots: each seed)",
    )
    if numeric:
        if min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(str(swept))
    else:
        labels = [f"{points[i].name}\n(n={len(points[i].values(metric))})" for i in order]
        ax.set_xticks(xs, labels, fontsize=7, rotation=20 if len(points) > 3 else 0)
        ax.set_xlim(-0.5, len(points) - 0.5)
    ax.set_ylabel(f"{metric} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path, dpi=120)
