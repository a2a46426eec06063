"""Several runs' verification or identification curves on one figure (``ddp-rank compare --curve roc``).

Each run keeps its evaluations' curves in ``curves.json`` (``ddp_rank.train.run_report``); the last one is drawn,
with ``ddp_rank.eval.curves``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddp_rank.eval.curves import SOURCE, draw_curve
from ddp_rank.experiments.runs import RunSummary
from ddp_rank.train.run_report import read_curves

__all__ = ["curve_left_out", "plot_run_curves", "run_curves"]


def run_curves(run: RunSummary) -> dict[str, Any]:
    """The curves of ``run``'s last evaluation that drew any, or {} (none, or an unreadable file)."""
    saved = read_curves(run.path)
    return dict(saved[list(saved)[-1]]) if saved else {}


def plot_run_curves(runs: list[RunSummary], kind: str, path: str | os.PathLike[str]) -> Path | None:
    """Draw the ``kind`` curve (roc, det, cmc, pr) of every run that has one into ``path``, one line per run
    (named by its folder), operating points marked; None when no run has it."""
    names = [r.path.name for r in runs]
    curves = {
        (run.path.name if names.count(run.path.name) == 1 else str(run.path)): run_curves(run) for run in runs
    }
    return draw_curve(kind, {name: c for name, c in curves.items() if c}, path)


def curve_left_out(runs: list[RunSummary], kind: str) -> list[str]:
    """``"<run>: why"`` for each of ``runs`` that :func:`plot_run_curves` leaves out of the ``kind`` curve."""
    group = "identification" if kind == "cmc" else "verification"
    lines = []
    for run in runs:
        curves = run_curves(run)
        if not curves:
            lines.append(
                f"{run.path}: no curves.json (its evaluations drew no curve: eval.protocol={group} or "
                f"eval.metrics=[{group}] draws the {kind} curve)"
            )
        elif not curves.get(SOURCE[kind]):
            lines.append(
                f"{run.path}: its last evaluation drew {', '.join(sorted(curves))}, not {kind} (add "
                f"eval.metrics=[{group}])"
            )
    return lines
