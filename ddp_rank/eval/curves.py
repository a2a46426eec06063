"""The verification and identification curves as pictures, one line per model or run, operating points marked.

An evaluation's metrics carry its curves under the key :data:`CURVES_KEY` (``roc`` and ``pr`` from verification,
``cmc`` from identification: lists of exact points, see ``ddp_rank.eval.verification``); :func:`split_curves`
takes them out before the numbers are logged, and :func:`draw_curves` draws them:

- ``roc.png``: TPR against FPR, FPR on a log axis (the low-FPR end is where deployments operate), each TPR@FPR
  operating point marked;
- ``det.png``: FNR against FPR, both on log axes, the equal error rate marked;
- ``cmc.png``: identification rate against rank (closed set), the gallery size in the legend;
- ``pr.png``: precision against recall over the pairs.

Needs matplotlib (the ``eval`` extra); without it nothing is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddp_rank.extras import pyplot, save_figure

__all__ = ["CURVES_KEY", "CURVE_KINDS", "draw_curve", "draw_curves", "split_curves"]

CURVES_KEY = "curves"
CURVE_KINDS = ("roc", "det", "cmc", "pr")
DET_FLOOR = 1e-6
"""Where det.png draws a false negative rate of 0 (log axes)."""
SOURCE = {"roc": "roc", "det": "roc", "cmc": "cmc", "pr": "pr"}
"""Which stored curve each picture is drawn from (the DET curve is the ROC curve's points)."""


def split_curves(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the metrics without their curves, the curves: empty when the evaluation drew none)."""
    numbers = {k: v for k, v in metrics.items() if k != CURVES_KEY}
    return numbers, dict(metrics.get(CURVES_KEY) or {})


def draw_curve(
    kind: str, curves_by_name: Mapping[str, Mapping[str, Any]], path: str | os.PathLike[str]
) -> Path | None:
    """Draw the ``kind`` curve (one of :data:`CURVE_KINDS`) of every entry that has it into ``path``; None when
    no entry has it. Raises ImportError with the install command when matplotlib is missing."""
    if kind not in CURVE_KINDS:
        raise ValueError(f"unknown curve {kind!r}; valid: {', '.join(CURVE_KINDS)}")
    entries = {name: c[SOURCE[kind]] for name, c in curves_by_name.items() if c.get(SOURCE[kind])}
    if not entries:
        return None
    plt = pyplot(f"{kind}.png")
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for index, (name, curve) in enumerate(entries.items()):
        _DRAW[kind](ax, name, curve, index)
    ax.set(**_AXES[kind])
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path, dpi=110)


def draw_curves(
    curves_by_name: Mapping[str, Mapping[str, Any]], out_dir: str | os.PathLike[str], prefix: str = ""
) -> list[Path]:
    """Every picture the curves allow, as ``<out_dir>/<prefix><kind>.png``; [] without matplotlib."""
    written: list[Path] = []
    for kind in CURVE_KINDS:
        try:
            path = draw_curve(kind, curves_by_name, Path(out_dir) / f"{prefix}{kind}.png")
        except ImportError:
            return written
        if path is not None:
            written.append(path)
    return written


def _roc(ax: Any, name: str, curve: Mapping[str, Any], index: int) -> None:
    pts = [(x, y) for x, y in zip(curve["fpr"], curve["tpr"], strict=True) if x > 0]
    (line,) = ax.plot(*zip(*pts, strict=True), label=name) if pts else ax.plot([], [], label=name)
    for key, (fpr, tpr) in curve.get("operating_points", {}).items():
        # The n-th curve's labels one line below the (n-1)-th's: close curves stay readable.
        _mark(ax, line, (fpr, tpr), "o", f"{key.upper()}: {100 * tpr:.1f}%", (4, -10 - 8 * index))


def _det(ax: Any, name: str, curve: Mapping[str, Any], index: int) -> None:
    # A false negative rate of 0 (every positive pair accepted) has no place on a log axis: drawn at the floor.
    pts = [(x, max(1 - y, DET_FLOOR)) for x, y in zip(curve["fpr"], curve["tpr"], strict=True) if x > 0]
    (line,) = ax.plot(*zip(*pts, strict=True), label=name) if pts else ax.plot([], [], label=name)
    eer = curve.get("eer")
    if eer:
        _mark(ax, line, (eer, eer), "D", f"EER {100 * eer:.2f}%", (5, 4 + 8 * index))


def _mark(
    ax: Any, line: Any, point: tuple[float, float], marker: str, text: str, offset: tuple[int, int]
) -> None:
    """A point of ``line`` drawn as ``marker`` in its colour, with ``text`` at ``offset`` points from it."""
    ax.plot([point[0]], [point[1]], marker, color=line.get_color(), ms=5)
    ax.annotate(text, point, fontsize=6, color=line.get_color(), xytext=offset, textcoords="offset points")


def _cmc(ax: Any, name: str, curve: Mapping[str, Any], index: int) -> None:
    label = f"{name} (gallery {curve['gallery_size']:,} images, {curve['gallery_identities']:,} identities)"
    (line,) = ax.plot(curve["rank"], [100 * r for r in curve["rate"]], label=label)
    ax.plot([1], [100 * curve["rate"][0]], "o", color=line.get_color(), ms=5)


def _pr(ax: Any, name: str, curve: Mapping[str, Any], index: int) -> None:
    ax.plot(curve["recall"], curve["precision"], label=name)


_DRAW = {"roc": _roc, "det": _det, "cmc": _cmc, "pr": _pr}
# Each picture's axes, as ``Axes.set`` takes them.
_AXES: dict[str, dict[str, str]] = {
    "roc": {
        "xscale": "log",
        "xlabel": "false positive rate (negative pairs accepted)",
        "ylabel": "true positive rate (positive pairs accepted)",
        "title": "verification ROC",
    },
    "det": {
        "xscale": "log",
        "yscale": "log",
        "xlabel": "false positive rate",
        "ylabel": "false negative rate",
        "title": "verification DET",
    },
    "cmc": {
        "xscale": "log",
        "xlabel": "rank",
        "ylabel": "identification rate (%)",
        "title": "closed-set identification (CMC)",
    },
    "pr": {
        "xlabel": "recall (positive pairs)",
        "ylabel": "precision",
        "title": "verification precision-recall",
    },
}
