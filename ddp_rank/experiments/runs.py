"""A run directory read back: its config, where it stands, what it measured.

What a run writes and what is read from it: ``config.yaml`` (the merged config), ``run.json`` (its status and
wall time, ``ddp_rank.train.run_state``), ``metrics.jsonl`` (``train`` records: step, images/s; ``eval`` records:
the metrics by step). A directory of an older version without ``run.json`` is ``finished`` when it has a
``summary.md``, else ``unknown``; a ``running`` state whose process is gone from this host is ``died`` (killed
outright: SIGKILL, out of memory), so a comparison never passes a dead run off as one still going.

Wall time: ``run.json`` holds the seconds of every start up to its last write, and a running start writes only
when it begins. So a run whose process still runs on this host is timed up to now, and one that died or runs
elsewhere has no known time (None), rather than the seconds it had when it last started.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from ddp_rank.train.run_outputs import read_metrics
from ddp_rank.train.run_state import is_alive, read_run_state

log = logging.getLogger(__name__)

__all__ = ["RunSummary", "expand_run_paths", "flatten_config", "metric_keys", "read_run"]

RUN_MARKERS = ("run.json", "config.yaml", "metrics.jsonl")
STARTED_FORMAT = "%Y-%m-%dT%H:%M:%S%z"  # run.json's "started" (ddp_rank.train.run_state)


@dataclass
class RunSummary:
    """One run as ``compare`` shows it."""

    path: Path
    status: str
    detail: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    total_steps: int | None = None
    global_batch: int | None = None
    seconds: float | None = None
    images_per_s: float | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def images_seen(self) -> int | None:
        return self.steps * self.global_batch if self.global_batch else None

    def best(self, metric: str) -> tuple[float, int] | None:
        """(highest value of ``metric``, its step) over the evaluations, None without one."""
        values = [(r[metric], r["step"]) for r in self.evals if _number(r.get(metric))]
        return max(values, key=lambda v: (v[0], -v[1])) if values else None

    def last(self, metric: str) -> float | None:
        values = [r[metric] for r in self.evals if _number(r.get(metric))]
        return values[-1] if values else None


def flatten_config(config: dict[str, Any]) -> dict[str, Any]:
    """``{"data": {"sampler": "hard"}}`` -> ``{"data.sampler": "hard"}`` (lists become tuples: hashable)."""
    flat: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            for key, value in values.items():
                flat[f"{section}.{key}"] = tuple(value) if isinstance(value, list) else value
    return flat


def metric_keys(runs: list[RunSummary]) -> list[str]:
    """The evaluation metrics any of ``runs`` logged (``recall@k`` by k, then the others), counts left out."""
    keys: dict[str, None] = {}
    for run in runs:
        for record in run.evals:
            for key, value in record.items():
                if key not in ("kind", "step") and "num_" not in key and _number(value):
                    keys[key] = None

    def order(key: str) -> tuple[str, int, str]:
        prefix, _, name = key.rpartition("/")
        if name.startswith("recall@") and name[7:].isdigit():
            return (prefix, int(name[7:]), "")
        return (prefix, 1 << 30, name)

    return sorted(keys, key=order)


def read_run(path: str | os.PathLike[str]) -> RunSummary:
    """Read the run directory ``path`` (see the module docstring); never raises for a damaged one: a metrics line
    that is not a record, or whose ``step`` is not a number, is left out."""
    run_dir = Path(path)
    state = read_run_state(run_dir)
    alive = is_alive(state) if state is not None and state["status"] == "running" else None
    status, detail = _status(run_dir, state, alive)
    run = RunSummary(path=run_dir, status=status, detail=detail)
    try:
        loaded = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        run.config = flatten_config(loaded) if isinstance(loaded, dict) else {}
    except (OSError, yaml.YAMLError):
        run.config = {}
    batch = run.config.get("data.global_batch_size")
    run.global_batch = int(batch) if isinstance(batch, int) else None
    total = run.config.get("train.steps")
    run.total_steps = int(total) if isinstance(total, int) and total > 0 else None
    records = [
        r for r in read_metrics(run_dir / "metrics.jsonl") if isinstance(r, dict) and _number(r.get("step"))
    ]
    train = [r for r in records if r.get("kind") == "train"]
    run.evals = [r for r in records if r.get("kind") == "eval"]
    run.steps = max([int(r["step"]) for r in train + run.evals], default=0)
    speeds = [float(r["images_per_s"]) for r in train if _number(r.get("images_per_s"))]
    run.images_per_s = statistics.median(speeds) if speeds else None
    run.seconds = _wall_time(state, alive)
    return run


def _wall_time(state: dict[str, Any] | None, alive: bool | None) -> float | None:
    """Seconds over every start of the run, None where unknown (see the module docstring)."""
    if state is None or not _number(state.get("seconds")):
        return None
    seconds = float(state["seconds"])
    if state["status"] != "running":
        return seconds
    if not alive:  # died, or running on another host: its time since it started is not known here
        return None
    try:
        started = datetime.strptime(str(state.get("started")), STARTED_FORMAT)
    except ValueError:
        return None
    return seconds + max((datetime.now(started.tzinfo) - started).total_seconds(), 0.0)


def expand_run_paths(patterns: list[str], note: Callable[[str], None] = log.warning) -> list[Path]:
    """Run directories from command-line arguments: globs expanded (also when the shell passed them quoted), and
    a directory that is not a run but holds runs (a sweep's output) replaced by them; in order, each once.

    What is not a run is passed over with a ``note``: a file (``compare sweep/*`` also names the ``compare.md``
    and ``compare.png`` a sweep writes beside its runs) or a folder that holds none. Raises FileNotFoundError
    for a path that does not exist or a glob that matches nothing (a typo), and when no run is left."""
    found: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern), key=_natural) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"no run directory matches {pattern!r}")
        for match in map(Path, matches):
            if not match.exists():
                raise FileNotFoundError(f"{match} is not a run directory (it does not exist)")
            if not match.is_dir():
                note(f"{match} is a file, not a run directory: skipped")
            elif _is_run(match):
                found[match] = None
            else:
                inner = sorted((p for p in match.iterdir() if p.is_dir() and _is_run(p)), key=_natural)
                if not inner:
                    note(
                        f"{match} holds no run (no {', '.join(RUN_MARKERS)} in it or in its folders): skipped"
                    )
                found.update(dict.fromkeys(inner))
    if not found:
        raise FileNotFoundError(f"no run directory among {' '.join(patterns)}")
    return list(found)


def _natural(path: str | Path) -> list[Any]:
    """Sort key that puts ``bs=32`` before ``bs=128``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _is_run(path: Path) -> bool:
    return any((path / marker).exists() for marker in RUN_MARKERS)


def _status(run_dir: Path, state: dict[str, Any] | None, alive: bool | None) -> tuple[str, str]:
    """(status, why) from ``state`` (``run.json``) and, for a running one, whether its process is ``alive``."""
    if state is None:
        if (run_dir / "summary.md").is_file():
            return "finished", ""
        if (run_dir / "metrics.jsonl").is_file():
            return "unknown", "no run.json (a run of an older version, or not started by the trainer)"
        return "not started", ""
    status = str(state["status"])
    if status == "crashed":
        return status, str(state.get("error", ""))
    if status == "running" and alive is False:
        return "died", f"process {state.get('pid')} on {state.get('host')} is gone (killed outright?)"
    if status == "stopped":
        return status, "stopped on a signal; run the same command again to continue"
    return status, ""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
