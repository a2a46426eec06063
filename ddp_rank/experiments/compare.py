"""Runs side by side: the config values that differ between them, how far each got, its best and last metrics,
its time and speed. One table, as markdown (people), CSV or JSON (tools).

Only the differing keys are shown because a sweep's runs share hundreds of settings; keys that never change a
result (where the run writes, whether it resumes, how it prints) are left out even when they differ.
"""

from __future__ import annotations

import json
from typing import Any

from ddp_rank.eval.report import csv_text, format_count, is_count
from ddp_rank.experiments.replicates import Replicates, is_replicated
from ddp_rank.experiments.runs import RunSummary, metric_keys

__all__ = ["Comparison", "compare_runs"]

IGNORED_KEYS = frozenset(
    {
        "train.output_dir",
        "train.resume",
        "train.progress",
        "train.log_with",
        "train.tracker_project",
        "train.plots",
        "data.cache_dir",
    }
)


class Comparison:
    """The table of ``runs``; ``metric`` is the one whose best value (and step) gets a column of its own."""

    def __init__(self, runs: list[RunSummary], metric: str = "recall@1") -> None:
        self.runs = runs
        self.metric = metric
        self.keys = differing_keys(runs)
        self.metrics = metric_keys(runs)
        # Runs that differ in their seeds are replicates: pooled into points with a mean and a spread.
        self.replicates = (
            Replicates(runs, self.keys, metric, self.metrics) if is_replicated(self.keys) else None
        )

    def rows(self) -> list[dict[str, Any]]:
        """One dict per run: plain values (fractions for metrics, seconds, images/s), None where unknown."""
        rows = []
        for run in self.runs:
            best = run.best(self.metric)
            row: dict[str, Any] = {"run": str(run.path), "status": run.status}
            row.update({key: _plain(run.config.get(key)) for key in self.keys})
            row["steps"] = run.steps
            row["total_steps"] = run.total_steps
            row["images_seen"] = run.images_seen
            row[f"best {self.metric}"] = best[0] if best else None
            row[f"best {self.metric} step"] = best[1] if best else None
            row.update({f"last {m}": run.last(m) for m in self.metrics})
            row["seconds"] = run.seconds
            row["images_per_s"] = run.images_per_s
            row["detail"] = run.detail
            rows.append(row)
        return rows

    def markdown(self) -> str:
        header = ["run", "status", *self.keys, "steps", "images seen", f"best {self.metric}"]
        header += [f"last {m}" for m in self.metrics] + ["wall time", "images/s"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        notes = []
        for run, row in zip(self.runs, self.rows(), strict=True):
            steps = f"{run.steps:,}" + (f" of {run.total_steps:,}" if run.total_steps else "")
            best = row[f"best {self.metric}"]
            cells = [_short_name(run, self.runs), run.status]
            cells += [_text(row[key]) for key in self.keys]
            cells += [steps, format_count(run.images_seen)]
            shown = format_count(best) if is_count(self.metric) else _percent(best)
            cells.append(f"{shown} (step {row[f'best {self.metric} step']})" if best is not None else "-")
            cells += [
                format_count(row[f"last {m}"]) if is_count(m) else _percent(row[f"last {m}"])
                for m in self.metrics
            ]
            cells += [_duration(run.seconds), f"{run.images_per_s:.1f}" if run.images_per_s else "-"]
            lines.append("| " + " | ".join(cells) + " |")
            if run.detail and run.status != "finished":
                notes.append(f"- {_short_name(run, self.runs)}: {run.status}: {run.detail}")
        legend = (
            "Metrics in percent (counts as such: gallery_size); steps done of those asked for; wall time over every start of a run (so far for "
            "one still running here; - where unknown: a run that died, or runs on another host)."
        )
        text = "\n".join([*lines, "", legend, *(["", *notes] if notes else [])]) + "\n"
        return text + ("\n" + self.replicates.markdown() if self.replicates else "")

    def csv(self) -> str:
        return csv_text(self.rows(), "run")

    def points_csv(self) -> str:
        """The replicates' points as CSV (one row per point: mean, std, min, max, count per metric); the runs'
        CSV when no run differs in its seeds."""
        return self.replicates.csv() if self.replicates else self.csv()

    def json(self) -> str:
        out: dict[str, Any] = {"differing_keys": self.keys, "metrics": self.metrics, "runs": self.rows()}
        if self.replicates:
            out["points"] = self.replicates.rows()
            out["differences"] = self.replicates.difference_rows()
        return json.dumps(out, indent=1)


def compare_runs(runs: list[RunSummary], metric: str = "recall@1") -> Comparison:
    return Comparison(runs, metric)


def differing_keys(runs: list[RunSummary]) -> list[str]:
    """Config keys whose values are not the same in every run that has a config (in config order)."""
    configs = [run.config for run in runs if run.config]
    keys: dict[str, None] = {}
    for config in configs:
        keys.update(dict.fromkeys(config))
    return [
        key
        for key in keys
        if key not in IGNORED_KEYS and len({repr(config.get(key)) for config in configs}) > 1
    ]


def _short_name(run: RunSummary, runs: list[RunSummary]) -> str:
    """The run's folder name, or more of its path when two runs share a folder name."""
    names = [r.path.name for r in runs]
    return run.path.name if names.count(run.path.name) == 1 else str(run.path)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "-" if value is None else str(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
