"""Replicates pooled into points: runs that differ only in their seeds (``train.seed``, ``data.seed``) are one
point of an experiment, summarised by the mean, the spread and the count of their final metric, and two points
that differ in one setting get their difference with a 95% paired t interval over the seeds both finished
(``ddp_rank.experiments.intervals``), marked "within noise" when it includes zero.

What is pooled: the LAST evaluation of each FINISHED run (the final model; the best of several evaluations
would pick the luckiest of noisy numbers). Crashed, stopped, dying or running replicates are counted but not
pooled, so a point says "2 of 3". A point of one finished run shows its value as such: no standard deviation,
no interval, never an invented spread.

"One setting": the settings that differ between points are grouped, a key that is a function of an earlier
one (``train.steps`` under ``sweep --equal images``, which follows ``data.global_batch_size``) going with it,
so a batch sweep's points differ in one setting, named ``data.global_batch_size (with train.steps, ...)``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from ddp_rank.eval.report import csv_text, format_count, is_count
from ddp_rank.experiments.grid import REPLICATE_KEYS
from ddp_rank.experiments.intervals import Interval, paired_t_interval
from ddp_rank.experiments.runs import RunSummary

__all__ = ["Difference", "Point", "Replicates", "is_replicated"]


def is_replicated(keys: Sequence[str]) -> bool:
    """Whether the keys that differ between runs include a seed: then the runs are replicates of points."""
    return any(key in REPLICATE_KEYS for key in keys)


@dataclass
class Point:
    """The runs that share every setting but the seeds; ``settings`` are the values of the differing keys."""

    settings: tuple[tuple[str, Any], ...]
    runs: list[RunSummary] = field(default_factory=list)
    named_by: tuple[str, ...] | None = None
    """The keys its name shows (the settings' own, not those that follow them); None: every key."""

    @property
    def name(self) -> str:
        shown = [(k, v) for k, v in self.settings if self.named_by is None or k in self.named_by]
        return ",".join(f"{key}={_text(value)}" for key, value in shown) or "all runs"

    @property
    def finished(self) -> list[RunSummary]:
        return [run for run in self.runs if run.status == "finished"]

    def by_seed(self, metric: str) -> dict[tuple[Any, ...], float]:
        """The final ``metric`` of each finished run by its seeds (runs of the same seeds averaged)."""
        pooled: dict[tuple[Any, ...], list[float]] = {}
        for run in self.finished:
            value = run.last(metric)
            if value is not None:
                pooled.setdefault(seeds_of(run), []).append(value)
        return {seed: statistics.fmean(values) for seed, values in pooled.items()}

    def values(self, metric: str) -> list[float]:
        return [v for run in self.finished if (v := run.last(metric)) is not None]

    def stats(self, metric: str) -> dict[str, Any]:
        """mean, std (None under two values), min, max and count of the finished runs' final ``metric``."""
        values = self.values(metric)
        return {
            "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values, default=None),
            "max": max(values, default=None),
            "count": len(values),
        }

    def unfinished(self) -> dict[str, int]:
        """How many runs of the point are in each status other than finished (``{"crashed": 1}``)."""
        out: dict[str, int] = {}
        for run in self.runs:
            if run.status != "finished":
                out[run.status] = out.get(run.status, 0) + 1
        return out


@dataclass(frozen=True)
class Difference:
    """``first`` minus ``second``, two points that differ in ``setting``, over the seeds both finished."""

    first: Point
    second: Point
    setting: str
    interval: Interval | None
    common_seeds: int

    @property
    def verdict(self) -> str:
        if self.interval is None:
            return f"no interval: {self.common_seeds} seed(s) finished in both"
        if self.interval.within_noise:
            return "within noise"
        return "beyond noise: " + ("first higher" if self.interval.mean > 0 else "second higher")


class Replicates:
    """The points of ``runs`` (pooled over ``REPLICATE_KEYS``) and the differences of those one setting apart, for
    ``metric``; every logged metric in ``metrics`` gets its mean and spread in the rows."""

    def __init__(
        self, runs: Sequence[RunSummary], keys: Sequence[str], metric: str, metrics: list[str]
    ) -> None:
        self.metric = metric
        self.metrics = metrics
        self.keys = [key for key in keys if key not in REPLICATE_KEYS]
        self.factors = _factors([run for run in runs if run.config], self.keys)
        named_by = tuple(group[0] for group in self.factors.values())
        points: dict[tuple[tuple[str, Any], ...], Point] = {}
        for run in runs:
            if run.config:  # a folder that never started has no settings to pool by
                settings = tuple((key, run.config.get(key)) for key in self.keys)
                points.setdefault(settings, Point(settings, named_by=named_by)).runs.append(run)
        self.points = list(points.values())

    def differences(self) -> list[Difference]:
        out = []
        for a, b in combinations(self.points, 2):
            apart = [name for name, keys in self.factors.items() if _differ(a, b, keys)]
            if len(apart) != 1:
                continue
            seeds_a, seeds_b = a.by_seed(self.metric), b.by_seed(self.metric)
            common = [seed for seed in seeds_a if seed in seeds_b]
            interval = paired_t_interval([seeds_a[s] - seeds_b[s] for s in common])
            out.append(Difference(a, b, apart[0], interval, len(common)))
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One dict per point: its settings, runs, finished count, then mean/std/min/max/count per metric."""
        rows = []
        for point in self.points:
            row: dict[str, Any] = {"point": point.name}
            row.update({key: _plain(value) for key, value in point.settings})
            row["runs"] = len(point.runs)
            row["finished"] = len(point.finished)
            row["not finished"] = ", ".join(f"{n} {status}" for status, n in point.unfinished().items())
            for metric in self.metrics:
                for stat, value in point.stats(metric).items():
                    row[f"{metric} {stat}"] = value
            rows.append(row)
        return rows

    def difference_rows(self) -> list[dict[str, Any]]:
        rows = []
        for d in self.differences():
            i = d.interval
            rows.append(
                {
                    "first": d.first.name,
                    "second": d.second.name,
                    "setting": d.setting,
                    "metric": self.metric,
                    "difference": i.mean if i else _single_difference(d, self.metric),
                    "low": i.low if i else None,
                    "high": i.high if i else None,
                    "confidence": i.confidence if i else None,
                    "seeds": d.common_seeds,
                    "verdict": d.verdict,
                }
            )
        return rows

    def markdown(self) -> str:
        m = self.metric
        others = [x for x in self.metrics if x != m]
        header = ["point", "finished", f"final {m}", "min-max", *(f"final {x}" for x in others)]
        lines = [
            f"Replicates: each point's runs pooled over their seeds ({', '.join(REPLICATE_KEYS)}); the final "
            "evaluation of each finished run, mean ± standard deviation in percent.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        for point in self.points:
            stats = point.stats(m)
            finished = f"{len(point.finished)} of {len(point.runs)}"
            if point.unfinished():
                finished += " (" + ", ".join(f"{n} {s}" for s, n in point.unfinished().items()) + ")"
            show = format_count if is_count(m) else _pct
            spread = "-" if stats["count"] < 2 else f"{show(stats['min'])}-{show(stats['max'])}"
            cells = [point.name, finished, _mean_std(stats, is_count(m)), spread]
            cells += [_mean_std(point.stats(x), is_count(x)) for x in others]
            lines.append("| " + " | ".join(cells) + " |")
        differences = self.differences()
        if differences:
            lines += [
                "",
                f"Differences of final {m} between points one setting apart (first minus second, points of "
                "percent): the mean over the seeds both finished with its 95% paired t interval; 'within noise' "
                "when the interval includes zero.",
                "",
                "| first | second | setting | difference | 95% interval | seeds | verdict |",
                "|---|---|---|---|---|---|---|",
            ]
            for d in differences:
                i = d.interval
                diff = _signed(i.mean) if i else _signed(_single_difference(d, m))
                span = f"[{_signed(i.low)}, {_signed(i.high)}]" if i else "-"
                cells = [d.first.name, d.second.name, d.setting, diff, span, str(d.common_seeds), d.verdict]
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        return csv_text(self.rows(), "point")


def seeds_of(run: RunSummary) -> tuple[Any, ...]:
    """The run's replicate identity: its values of ``REPLICATE_KEYS``."""
    return tuple(run.config.get(key) for key in REPLICATE_KEYS)


def _factors(runs: list[RunSummary], keys: list[str]) -> dict[str, list[str]]:
    """The settings, each a key and the later keys that are functions of it (same value -> same value over
    ``runs``), named ``key (with other, ...)``."""
    factors: dict[str, list[str]] = {}
    for key in keys:
        owner = next((k for k, group in factors.items() if _determines(runs, group[0], key)), None)
        if owner is None:
            factors[key] = [key]
        else:
            factors[owner].append(key)
    return {
        (group[0] + (f" (with {', '.join(group[1:])})" if len(group) > 1 else "")): group
        for group in factors.values()
    }


def _determines(runs: list[RunSummary], key: str, other: str) -> bool:
    seen: dict[str, str] = {}
    for run in runs:
        value, follows = repr(run.config.get(key)), repr(run.config.get(other))
        if seen.setdefault(value, follows) != follows:
            return False
    return True


def _differ(a: Point, b: Point, keys: list[str]) -> bool:
    first, second = dict(a.settings), dict(b.settings)
    return any(first[key] != second[key] for key in keys)


def _single_difference(d: Difference, metric: str) -> float | None:
    """The difference of the means where there is no interval (one seed each, or none in common)."""
    first, second = d.first.stats(metric)["mean"], d.second.stats(metric)["mean"]
    return first - second if first is not None and second is not None else None


def _mean_std(stats: dict[str, Any], count: bool = False) -> str:
    """``mean ± std (n=...)`` in percent, or as counts (``gallery_size``: a number of images, not a rate)."""
    show = format_count if count else _pct
    if stats["count"] == 0:
        return "-"
    if stats["count"] == 1:
        return f"{show(stats['mean'])} (one seed)"
    return f"{show(stats['mean'])} ± {show(stats['std'])} (n={stats['count']})"


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def _signed(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:+.2f}"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ";".join(map(str, value))
    return str(value)
