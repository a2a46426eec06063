"""``compare.png``: the finished runs' metric against the one setting they differ in (a batch-size sweep: R@1
against the global batch, best and last), or, when they differ in more than one (or in a setting that is not a
number), against images seen, one curve per run; runs that differ in their seeds, each point's mean with an
error bar (``ddp_rank.experiments.plot_points``). Needs matplotlib (the ``eval`` extra, docs/install.md)."""

from __future__ import annotations

import os
from pathlib import Path

from ddp_rank.experiments.compare import differing_keys
from ddp_rank.experiments.plot_points import draw_points
from ddp_rank.experiments.replicates import Replicates, is_replicated
from ddp_rank.experiments.runs import RunSummary
from ddp_rank.extras import pyplot, save_figure

__all__ = ["plot_comparison", "plot_left_out"]


def plot_comparison(
    runs: list[RunSummary], metric: str, path: str | os.PathLike[str], x_key: str | None = None
) -> Path | None:
    """Draw ``metric`` of the finished ``runs`` into ``path``, against ``x_key`` when given (a sweep's one axis:
    ``--equal images`` makes ``train.steps`` differ too), else against the one key they differ in, else against
    images seen; None when there is nothing to draw.

    Raises ImportError with the install command when matplotlib is missing.
    """
    finished = [run for run in runs if run.status == "finished" and run.best(metric) is not None]
    if not finished:
        return None
    plt = pyplot("compare.png")
    everyone = differing_keys(runs)
    if is_replicated(everyone):  # runs that differ in their seeds: each point's mean and spread
        return draw_points(Replicates(runs, everyone, metric, [metric]), Path(path), x_key, plt)
    keys = differing_keys(finished)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    swept = x_key or (keys[0] if len(keys) == 1 else None)
    values = [run.config.get(swept) for run in finished] if swept else []
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if swept and len(numbers) == len(finished):
        order = sorted(range(len(finished)), key=lambda i: numbers[i])
        xs = [numbers[i] for i in order]
        best = [100 * _best(finished[i], metric) for i in order]
        last = [100 * (finished[i].last(metric) or 0.0) for i in order]
        ax.plot(xs, best, "o-", label=f"best {metric}")
        ax.plot(xs, last, "s--", label=f"last {metric}")
        if min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(swept)
    else:
        for run in finished:
            points = [
                (r["step"] * (run.global_batch or 1), 100 * r[metric]) for r in run.evals if metric in r
            ]
            label = _label(run, finished)
            ax.plot(*zip(*points, strict=True), "o-", label=label)
        ax.set_xlabel("images seen" if all(run.global_batch for run in finished) else "step")
    ax.set_ylabel(f"{metric} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path, dpi=120)


def plot_left_out(runs: list[RunSummary], metric: str) -> list[str]:
    """``"<run>: why"`` for each of ``runs`` that :func:`plot_comparison` leaves out (it draws finished runs that
    logged ``metric``)."""
    lines = []
    for run in runs:
        if run.status != "finished":
            lines.append(f"{run.path}: {run.status}, not finished (only finished runs are drawn)")
        elif run.best(metric) is None:
            lines.append(f"{run.path}: no evaluation logged {metric} (--metric picks the one drawn)")
    return lines


def _best(run: RunSummary, metric: str) -> float:
    best = run.best(metric)
    return best[0] if best else float("nan")


def _label(run: RunSummary, runs: list[RunSummary]) -> str:
    """The run's folder name (a sweep names its folders by their values), with its parent's where two share it."""
    names = [r.path.name for r in runs]
    return run.path.name if names.count(run.path.name) == 1 else f"{run.path.parent.name}/{run.path.name}"
