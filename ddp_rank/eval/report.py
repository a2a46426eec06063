"""Evaluation results as a markdown table, as CSV and as JSON."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddp_rank.atomic_io import atomic_write_text

__all__ = [
    "COUNTS",
    "bootstrap_note",
    "csv_text",
    "deployment_lines",
    "format_count",
    "format_table",
    "is_count",
    "metric_columns",
    "write_json",
]

COUNTS = (
    "num_queries",
    "num_lone_queries",
    "num_positive_pairs",
    "num_negative_pairs",
    "gallery_size",
    "gallery_identities",
    "num_mated_probes",
    "num_non_mated_probes",
)
"""The entries of an evaluation's metrics that are numbers of things, not rates: never shown in percent."""
_HIDDEN = (*COUNTS, "bootstrap")


def is_count(name: str) -> bool:
    """Whether the metric ``name`` (``gallery_size``, ``small/num_queries``) is a count (:data:`COUNTS`)."""
    return name.rsplit("/", 1)[-1] in COUNTS


def format_count(value: float | None) -> str:
    """A count for a table: ``1,200``; a mean of counts that is not a whole number keeps one decimal
    (``1,200.5``); ``-`` for none. One format for every table that shows counts (compare, replicates)."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def metric_columns(rows: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The metric names of ``rows`` in a readable order: Recall@k by k, then MAP@R, per subset prefix."""
    names: list[str] = []
    for metrics in rows.values():
        for k in metrics:
            if k not in names and k.rsplit("/", 1)[-1] not in _HIDDEN:
                names.append(k)

    def key(name: str) -> tuple[str, int, int]:
        prefix, _, metric = name.rpartition("/")
        if metric.startswith("recall@"):
            return (prefix, 0, int(metric.split("@")[1]))
        return (prefix, 1, 0)

    return sorted(names, key=key)


def format_table(rows: Mapping[str, Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A markdown table: one row per entry of ``rows`` (e.g. raw pixels / before / after), metrics in percent;
    ``52.80 ± 0.90`` where a row carries its query bootstrap (``ddp_rank.eval.bootstrap``: ± one standard
    error)."""
    cols = list(columns) if columns is not None else metric_columns(rows)
    names = [_short(c) for c in cols]
    body = [[name, *(_cell(metrics, c) for c in cols)] for name, metrics in rows.items()]
    widths = [max(len(r[i]) for r in [["model", *names], *body]) for i in range(len(cols) + 1)]

    def line(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    lines = [line(["model", *names]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [line(r) for r in body]
    return "\n".join(lines)


def _short(name: str) -> str:
    """A table header: ``recall@1`` -> ``R@1``, ``tpr@fpr=1e-3`` -> ``TPR@1e-3``, ``roc_auc`` -> ``AUC``."""
    for long, short in (
        ("recall@", "R@"),
        ("map@r", "MAP@R"),
        ("tpr@fpr=", "TPR@"),
        ("fnir@fpir=", "FNIR@"),
        ("cmc@", "CMC@"),
        ("roc_auc", "AUC"),
        ("pr_auc", "AP"),
        ("eer", "EER"),
    ):
        name = name.replace(long, short)
    return name


def _percent(value: object) -> str:
    return f"{100 * value:.2f}%" if isinstance(value, float) else "not measurable"


def deployment_lines(metrics: Mapping[str, object]) -> dict[str, str]:
    """One line each for the verification and identification figures of ``metrics`` (those it has), saying
    which are not measurable and on how many pairs / probes and how large a gallery they stand."""
    lines = {}
    if "num_negative_pairs" in metrics:
        rates = [k for k in metrics if k.startswith("tpr@fpr=")]
        lines["verification"] = (
            ", ".join(f"TPR@FPR={k.split('=')[1]} {_percent(metrics[k])}" for k in rates)
            + f", ROC AUC {_percent(metrics.get('roc_auc'))}, EER {_percent(metrics.get('eer'))}"
            + f", AP {_percent(metrics.get('pr_auc'))}"
            + f" ({metrics.get('num_positive_pairs'):,} positive, {metrics['num_negative_pairs']:,} negative pairs)"
        )
    if "gallery_size" in metrics:
        ranks = [k for k in metrics if k.startswith("cmc@")]
        rates = [k for k in metrics if k.startswith("fnir@fpir=")]
        lines["identification"] = (
            ", ".join(f"CMC@{k.split('@')[1]} {_percent(metrics[k])}" for k in ranks)
            + "; "
            + ", ".join(f"FNIR@FPIR={k.split('=')[1]} {_percent(metrics[k])}" for k in rates)
            + f" (gallery {metrics['gallery_size']:,} images of {metrics.get('gallery_identities'):,} identities, "
            + f"{metrics.get('num_mated_probes'):,} mated and {metrics.get('num_non_mated_probes'):,} non-mated probes)"
        )
    return lines


def _cell(metrics: Mapping[str, Any], column: str) -> str:
    if metrics.get(column) is None:
        return "-"
    spread = (metrics.get("bootstrap") or {}).get("metrics", {}).get(column)
    return f"{100 * metrics[column]:.2f}" + (f" ± {100 * spread['se']:.2f}" if spread else "")


def bootstrap_note(metrics: Mapping[str, Any]) -> str:
    """The line that says what a table's ± is, or "" without a bootstrap."""
    settings = metrics.get("bootstrap")
    if not settings:
        return ""
    units = settings.get("over", ["queries"])
    over = " and ".join(f"the {unit}" + (f" ({_OVER[unit]})" if len(units) > 1 else "") for unit in units)
    return (
        f"± one standard error over {over}: {settings['resamples']} bootstrap resamples (seed "
        f"{settings['seed']}); 95% intervals in the results JSON"
    )


_OVER = {"queries": "Recall@k, MAP@R", "identities": "verification, identification"}


def csv_text(rows: Sequence[Mapping[str, object]], empty_header: str) -> str:
    """``rows`` as CSV, the first row's keys as the header; a header of ``empty_header`` alone without rows."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else [empty_header], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_json(results: Mapping[str, object], path: str | os.PathLike[str]) -> Path:
    """Write ``results`` as indented JSON, atomically (``atomic_write_text``)."""
    p = Path(path)
    atomic_write_text(p, json.dumps(results, indent=2) + "\n")
    return p
