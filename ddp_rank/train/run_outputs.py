"""Run outputs written by rank 0: metrics JSONL (mirrored to the experiment trackers), PNG plots, a summary.

``metrics.jsonl`` holds one JSON object per line: ``{"kind": "train", "step": ..., "loss": ..., "lr": ...,
"images_per_s": ..., "data_replaced_classes": ...}`` every ``train.log_every`` steps (the data events counted
since this start), ``{"kind": "eval", "step": ..., "recall@1": ...}`` after each evaluation, a ``data`` record at
each start and a ``stop`` record when a signal stopped the run. It is the single source of the plots and the summary, so they can be redrawn from a
finished (or killed) run with :func:`write_plots` / :func:`write_summary`.

On resume the lines of steps after the resumed checkpoint are dropped (:meth:`MetricsLogger.truncate_after`):
the killed run logged them, the resumed run logs them again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.extras import pyplot, save_figure

__all__ = ["ConfigRecord", "MetricsLogger", "read_metrics", "write_plots", "write_summary"]


@dataclass(frozen=True, eq=False)
class ConfigRecord:
    """The whole config as a run's outputs record it, made once at start-up by ``ddp_rank.train.settings``:
    ``values`` (every ``section.key``, as YAML and JSON hold them: ``run.json``, ``meta.json``, the summary, the
    trackers' hyper-parameters), ``defaults`` (the same for the defaults: keys an older checkpoint predates are
    compared with them) and ``write`` (writes ``config.yaml``, the file a run can be started again from)."""

    values: dict[str, dict[str, Any]]
    defaults: dict[str, dict[str, Any]]
    write: Callable[[str | os.PathLike[str]], None]


class MetricsLogger:
    """Append-only JSONL metrics (flushed every line, so a killed run keeps what it logged), each record's
    numbers also handed to ``trackers(kind, step, values)`` (the run's experiment trackers,
    ``ddp_rank.train.trackers``)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        trackers: Callable[[str, int, dict[str, float]], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._trackers = trackers

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps > ``step`` (a resumed run logs them again); returns how many were dropped."""
        if not self.path.is_file():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                dropped += 1
                continue
            if int(rec.get("step", 0)) > step:
                dropped += 1
            else:
                kept.append(line)
        atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
        return dropped

    def log(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        """Append one record (numbers, and lists such as the data layer's bad shards) and hand its finite
        numbers to the trackers."""
        rec = {"kind": kind, "step": int(step), **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
        if self._trackers is not None:
            numbers = {
                k: float(v)
                for k, v in rec.items()
                if k not in ("kind", "step")
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(float(v))
            }
            self._trackers(kind, int(step), numbers)

    def close(self) -> None:
        """Nothing of its own stays open (each record is written and closed); the trackers end with the
        accelerator (``end_training``)."""
        self._trackers = None


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (unreadable lines skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_plots(records: Sequence[Mapping[str, Any]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """The run's curves by step; returns the files written:

    - ``loss.png``: the training loss;
    - ``recall.png``: Recall@k and MAP@R of each evaluation, in percent;
    - ``lr.png``: the learning rates of the backbone and the head;
    - ``throughput.png``: images per second and the data loader's share of the step.

    Needs matplotlib (the ``eval`` extra); without it nothing is written and an empty list is returned.
    """
    try:
        plt = pyplot("the run's pictures")
    except ImportError:
        return []

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def plot(
        name: str, series: dict[str, list[tuple[int, float]]], ylabel: str, title: str, **style: Any
    ) -> None:
        series = {label: pts for label, pts in series.items() if pts}
        if not series:
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        written.append(save_figure(fig, out / name, dpi=100))

    def points(kind: str, key: str, scale: float = 1.0) -> list[tuple[int, float]]:
        return [
            (r["step"], scale * r[key]) for r in records if r.get("kind") == kind and r.get(key) is not None
        ]

    plot("loss.png", {"loss": points("train", "loss")}, "loss", "training loss", lw=1.5)
    evals = [r for r in records if r.get("kind") == "eval"]
    recall_keys = sorted(
        {k for r in evals for k in r if k.startswith("recall@") and "/" not in k},
        key=lambda k: int(k.split("@")[1]),
    )
    if recall_keys:
        retrieval = {k.replace("recall@", "R@"): points("eval", k, 100.0) for k in recall_keys}
        retrieval["MAP@R"] = points("eval", "map@r", 100.0)
        plot("recall.png", retrieval, "percent", "retrieval on held-out classes", marker="o")
    rates = {group: points("train", f"lr_{group}") for group in ("backbone", "head")}
    rates = {group: series for group, series in rates.items() if series}  # a feature head has no backbone
    if not rates:
        rates = {"lr": points("train", "lr")}
    plot("lr.png", rates, "learning rate", "learning rate", lw=1.5)
    plot("throughput.png", {"images/s": points("train", "images_per_s")}, "images / s", "throughput", lw=1.5)
    return written


def _loss_line(train: Sequence[Mapping[str, Any]]) -> str:
    """The logged loss from the first ``train`` record to the last, or the one value when a single step was logged
    (``train.log_every`` at or above ``train.steps``)."""

    def value(record: Mapping[str, Any]) -> str:
        loss = record.get("loss")
        return f"{loss:.4f}" if isinstance(loss, float) else str(loss)

    first, last = train[0], train[-1]
    if first["step"] == last["step"]:
        return f"{value(last)} at step {last['step']} (the only logged step)"
    return f"{value(first)} at step {first['step']} -> {value(last)} at step {last['step']}"


def write_summary(
    path: str | os.PathLike[str],
    *,
    title: str,
    config: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    facts: Mapping[str, Any],
    tables: Mapping[str, str] | None = None,
    plots: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """A markdown run summary: facts (world size, steps, time), final metrics, tables, plots, the config."""
    lines = [f"# {title}", ""]
    for k, v in facts.items():
        lines.append(f"- **{k}**: {v}")
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if train:
        lines.append(f"- **loss**: {_loss_line(train)}")
    if evals:
        last_eval = evals[-1]
        shown = ", ".join(
            f"{k} {100 * v:.2f}"
            for k, v in last_eval.items()
            if k not in ("kind", "step") and isinstance(v, float)
        )
        lines.append(f"- **last evaluation** (step {last_eval['step']}): {shown}")
    for name, table in (tables or {}).items():
        lines += ["", f"## {name}", "", table]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines += ["", "## Configuration", "", "```yaml"]
    import yaml

    lines.append(yaml.safe_dump(dict(config), sort_keys=False).rstrip())
    lines += ["```", ""]
    p = Path(path)
    atomic_write_text(p, "\n".join(lines))
    return p
