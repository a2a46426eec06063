"""The word study: does retrieval grow with the global batch, trained to convergence? Every choice is made on
validation words; the test words are evaluated once per final run (``make study-features``; the write-up:
``benchmarks/results/study-features-*``).

A linear head on the word set's frozen, PCA-whitened feature shards (``make words-whitened``: training words,
validation words carved from them by ``shards build --val-fraction``, held-out test words; 8 fonts each) is trained
as ``ddp-rank train`` trains it: FastAP, the random sampler, one warm-up + cosine-to-zero schedule of the same shape
at every batch, validation evaluated ``--evals`` times along each run.

1. **The length probe.** Two seeds (``--probe-seeds``) of the smallest batch, the largest and the one in the middle
   (``--probe-batches``) train at the probe rate (``--probe-factor`` x ``--lr0`` x sqrt(B / 1024)) for
   ``--probe-epochs``, then twice as long, doubling until validation R@1 at the end gains less than the larger of
   the two seeds' spread and ``--min-gain`` points (at most ``--max-epochs``). The final length is the longest that
   the probed batches needed: one equal epoch budget at which every probed curve has stopped rising.
2. **The rate, at that length.** Each batch tries the probe rate and its neighbours a factor ``--rate-step`` apart
   (seed 0, validation R@1 at the end; ties: the lower rate), and the grid grows past whichever end wins (strictly:
   a tie with its neighbour is a plateau inside the grid) until the chosen rate is interior (at most ``--max-rates`` candidates; a winner still at an end is reported as such).
3. **Seeds.** The chosen rate of each batch is trained with ``--seeds`` seeds (seed 0 is the sweep's own run); the
   best batch is the one of the highest mean validation R@1.
4. **The test split, once.** The last checkpoint of every final run is evaluated on the test words (``ddp-rank eval
   --split test --per-query``); their per-query values are kept beside the record. Each difference between two
   batches, and each batch's own mean, comes with a 95% interval that combines the seeds' noise and the test
   classes' (Welch-Satterthwaite, ``ddp_rank.experiments.query_pairs``); the number of differences is stated with a
   Bonferroni verdict beside each.

A run is keyed by its batch, rate, epochs and seed: one the probe trained is the sweep's candidate and a final seed
where they coincide, and a rerun in the same ``--out`` reuses what finished with the same settings (other settings
stop it). Runs go ``--jobs`` at a time, each job a worker process that trains its runs in turn
(``ddp_rank.experiments.in_process``; ``--own-processes``: one ``ddp-rank train`` process per run). A candidate
whose loss diverges counts as the worst; any other failure stops the study. Outputs in ``--out``: ``runs/`` (one
folder per run), ``study.json`` (the record), ``queries.npz`` (the test queries' values of every final run),
``study.md`` and the plot; ``--results`` copies them into ``benchmarks/results/`` with the date;
``--from-record`` writes the table, the intervals and the plot again from a record and its ``queries.npz``.

    make study-features                                   # the study as its write-up reports it
    .venv/bin/python -m benchmarks.study_features --batches 64,256,1024 --probe-epochs 1 --max-epochs 2 --seeds 2
    .venv/bin/python -m benchmarks.study_features --from-record runs/study-features/study.json --results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.study_features_report import add_intervals, markdown, plots, save_queries
from benchmarks.study_features_runs import REPO, Schedule, Trainer, overrides_for
from ddp_rank.data.features.records import feature_record
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.experiments.runs import RunSummary, read_run

METRICS = ("recall@1", "recall@10", "map@r")
RunKey = tuple[int, float, float, int]
"""batch, rate, epochs, seed."""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_record:
        path = Path(args.from_record)
        record = json.loads(path.read_text())
        add_intervals(record, _queries_beside(path))
        _write(record, out, args.results)
        return 0
    manifest = Manifest.load(args.shards)
    _check_splits(manifest, args)
    start = time.monotonic()
    trainer = Trainer(args, out)
    try:
        record = Study(args, out, manifest, trainer).run()
    finally:
        trainer.close()
    record["wall_seconds"] = round(time.monotonic() - start)
    # Kept before anything else can fail: the intervals are computed again from it by --from-record.
    (out / "study.json").write_text(json.dumps(record, indent=1) + "\n")
    save_queries(record, out, out / "queries.npz")
    add_intervals(record, out / "queries.npz")
    (out / "study.json").write_text(json.dumps(record, indent=1) + "\n")
    _write(record, out, args.results)
    return 0


class Study:
    """The probe, the sweeps and the seeds of one study; every run trained once however many steps ask for it."""

    def __init__(self, args: argparse.Namespace, out: Path, manifest: Manifest, trainer: Trainer) -> None:
        self.args, self.out, self.manifest, self.trainer = args, out, manifest, trainer
        self.n_train = manifest.splits[args.train_split].samples
        self.lock = threading.Lock()
        self.runs: dict[RunKey, Future[float]] = {}
        # Runs wait on a slot of the trainer (``--jobs``), not on this pool: it only has to hold every waiting run.
        self.pool = ThreadPoolExecutor(max_workers=256)

    def rate(self, batch: int, factor: float) -> float:
        return float(f"{self.args.lr0 * math.sqrt(batch / 1024) * factor:.3g}")

    def path(self, key: RunKey) -> Path:
        batch, lr, epochs, seed = key
        return self.out / "runs" / f"batch={batch},lr={lr:.3g},epochs={epochs:g},seed={seed}"

    def submit(self, key: RunKey, may_fail: bool = False) -> Future[float]:
        """Validation R@1 at the end of the run ``key`` (NaN for a candidate that diverged), trained once."""
        with self.lock:
            if key not in self.runs:
                self.runs[key] = self.pool.submit(self._train, key, may_fail)
            return self.runs[key]

    def _train(self, key: RunKey, may_fail: bool) -> float:
        batch, lr, epochs, seed = key
        steps, schedule = Schedule(epochs, self.args.warmup, self.args.evals).overrides(batch, self.n_train)
        run = self.path(key)
        if not self.trainer.train(
            run, [*overrides_for(batch, lr), *schedule, f"train.seed={seed}"], steps, may_fail
        ):
            return math.nan
        return _last(read_run(run), "recall@1")

    def run(self) -> dict[str, Any]:
        try:
            probe, epochs = self.probe()
            with ThreadPoolExecutor(len(self.args.batches)) as chains:
                # The largest batches first: their runs are the longest, so the two slots end together.
                jobs = {
                    b: chains.submit(self._stopping, self.point, b, epochs)
                    for b in sorted(self.args.batches, reverse=True)
                }
                points = [jobs[b].result() for b in sorted(self.args.batches)]
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)
        best = max(
            points, key=lambda p: (statistics.fmean(r["val"]["recall@1"] for r in p["runs"]), -p["batch"])
        )
        return self.record(probe, epochs, points, best["batch"])

    def _stopping(self, chain: Any, *args: Any) -> Any:
        """``chain(*args)``; a failure of it stops the study: no other run starts (each chain then fails at its
        next run), instead of every other batch training to its end before the error is seen."""
        try:
            return chain(*args)
        except BaseException:
            self.trainer.stopped.set()
            raise

    def probe(self) -> tuple[list[dict[str, Any]], float]:
        """Point 1: each probed batch's doublings and the length every one of them needed."""
        with ThreadPoolExecutor(len(self.args.probe_batches)) as chains:
            steps = list(chains.map(lambda b: self._stopping(self.probe_batch, b), self.args.probe_batches))
        lengths = [s[-1]["epochs"] if s[-1]["stopped"] else s[-1]["next"] for s in steps]
        return [row for s in steps for row in s], max(lengths)

    def probe_batch(self, batch: int) -> list[dict[str, Any]]:
        lr, seeds = self.rate(batch, self.args.probe_factor), range(self.args.probe_seeds)
        epochs, rows = self.args.probe_epochs, []
        while True:
            jobs = {e: [self.submit((batch, lr, e, s)) for s in seeds] for e in (epochs, 2 * epochs)}
            now, longer = ([100 * j.result() for j in jobs[e]] for e in (epochs, 2 * epochs))
            if not all(map(math.isfinite, [*now, *longer])):
                raise SystemExit(
                    f"the length probe's run at batch {batch}, rate {lr:g} diverged: lower --probe-factor"
                )
            gain = statistics.fmean(longer) - statistics.fmean(now)
            spread = max(longer) - min(longer)
            threshold = max(spread, self.args.min_gain)
            stopped = gain < threshold
            rows.append(
                {
                    "batch": batch,
                    "lr": lr,
                    "epochs": epochs,
                    "next": 2 * epochs,
                    "val": now,
                    "val_next": longer,
                    "gain": gain,
                    "spread": spread,
                    "threshold": threshold,
                    "stopped": stopped,
                }
            )
            if stopped or 2 * epochs >= self.args.max_epochs:
                return rows
            epochs *= 2

    def point(self, batch: int, epochs: float) -> dict[str, Any]:
        """Points 2 and 3: the rate swept at the final length until the winner is interior, then the seeds."""
        step = self.args.rate_step
        factors = [self.args.probe_factor / step, self.args.probe_factor, self.args.probe_factor * step]
        while True:
            rates = sorted({self.rate(batch, f) for f in factors})
            jobs = {lr: self.submit((batch, lr, epochs, 0), may_fail=True) for lr in rates}
            sweep = {lr: 100 * job.result() for lr, job in jobs.items()}
            if not any(map(math.isfinite, sweep.values())):
                raise SystemExit(
                    f"batch {batch}: every candidate rate diverged (logs in {self.out / 'runs'})"
                )
            chosen = min(sweep, key=lambda r: (-sweep[r] if math.isfinite(sweep[r]) else math.inf, r))
            # At an end only when strictly better than its neighbour: a tie is a plateau reaching inside the grid.
            at_low = chosen == rates[0] and not sweep[rates[1]] >= sweep[chosen]
            at_high = chosen == rates[-1] and not sweep[rates[-2]] >= sweep[chosen]
            if not (at_low or at_high) or len(factors) >= self.args.max_rates:
                break
            factors = [factors[0] / step, *factors] if at_low else [*factors, factors[-1] * step]
        finals = [self.path((batch, chosen, epochs, s)) for s in range(self.args.seeds)]
        for job in [self.submit((batch, chosen, epochs, s)) for s in range(self.args.seeds)]:
            if not math.isfinite(job.result()):
                raise SystemExit(f"batch {batch}: a seed of the chosen rate {chosen:g} diverged")
        for run in finals:
            self.trainer.test(run)
        steps, _ = Schedule(epochs, self.args.warmup, self.args.evals).overrides(batch, self.n_train)
        return {
            "axis": "batch",
            "name": str(batch),
            "batch": batch,
            "lr": chosen,
            "sweep": {f"{lr:.3g}": v for lr, v in sweep.items()},
            "at_edge": at_low or at_high,
            "steps": steps,
            "epochs": round(steps * batch / self.n_train, 2),
            "runs": [_run_figures(run, s, self.out) for s, run in enumerate(finals)],
        }

    def record(
        self, probe: list[dict[str, Any]], epochs: float, points: list[dict[str, Any]], best: int
    ) -> dict[str, Any]:
        args, manifest = self.args, self.manifest

        def split_size(name: str) -> dict[str, int]:
            return {
                "classes": len(manifest.splits[name].class_counts),
                "images": manifest.splits[name].samples,
            }

        return {
            "date": date.today().isoformat(),
            "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
            "jobs": args.jobs,
            "shards": args.shards,
            "splits": {
                s: split_size(n)
                for s, n in (("train", args.train_split), ("val", args.val_split), ("test", args.test_split))
            },
            "validation": _validation_draw(manifest),
            "rule": {
                "lr0": args.lr0,
                "probe_factor": args.probe_factor,
                "rate_step": args.rate_step,
                "max_rates": args.max_rates,
                "probe_batches": args.probe_batches,
                "probe_seeds": args.probe_seeds,
                "probe_epochs": args.probe_epochs,
                "max_epochs": args.max_epochs,
                "min_gain": args.min_gain,
                "epochs": epochs,
                "warmup": args.warmup,
                "evals": args.evals,
                "seeds": args.seeds,
            },
            "probe": probe,
            "best_batch": best,
            "points": points,
            "runs_trained": len(self.runs),
        }


def _write(record: dict[str, Any], out: Path, results: bool) -> None:
    """``study.md`` and the plot from the record (and into ``benchmarks/results/`` with its date)."""
    text = markdown(record)
    (out / "study.md").write_text(text)
    pngs = plots(record, out)
    print(text)
    if results:
        target = REPO / "benchmarks" / "results"
        stem = f"study-features-{record['date']}"
        shutil.copy(out / "study.md", target / f"{stem}.md")
        (target / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        if (out / "queries.npz").is_file():
            shutil.copy(out / "queries.npz", target / f"{stem}-queries.npz")
        for png in pngs:
            shutil.copy(png, target / png.name.replace(".png", f"-{record['date']}.png"))


def _queries_beside(record: Path) -> Path:
    """The per-query file of a record: ``queries.npz`` in a study's folder, ``<stem>-queries.npz`` in
    ``benchmarks/results/``."""
    dated = record.with_name(f"{record.stem}-queries.npz")
    return dated if dated.is_file() else record.with_name("queries.npz")


def _check_splits(manifest: Manifest, args: argparse.Namespace) -> None:
    missing = [s for s in (args.train_split, args.val_split, args.test_split) if s not in manifest.splits]
    if missing:
        raise SystemExit(
            f"{args.shards}: no split {', '.join(map(repr, missing))} (it has {sorted(manifest.splits)}). The study "
            f"chooses on a validation split of training classes: build the image shards with `ddp-rank shards "
            f"build ... --val-fraction 0.1` (the Makefile's words-shards does), then the feature shards again: "
            f"`rm -r runs/words/shards runs/words/features runs/words/whitened && make words-whitened`"
        )


def _last(summary: RunSummary, metric: str) -> float:
    value = summary.last(metric)
    return float("nan") if value is None else float(value)


def _run_figures(run: Path, seed: int, out: Path) -> dict[str, Any]:
    summary = read_run(run)
    test = json.loads((run / "test.json").read_text())["test"]["metrics"]
    return {
        "seed": seed,
        "path": str(run.relative_to(out)),
        "steps": summary.steps,
        "seconds": summary.seconds,
        "val_curve": [(int(e["step"]), float(e["recall@1"])) for e in summary.evals if "recall@1" in e],
        "val": {m: _last(summary, m) for m in METRICS},
        "test": {m: float(test[m]) for m in METRICS},
        "queries": str((run / "test-queries.npz").relative_to(out)),
    }


def _validation_draw(manifest: Manifest) -> dict[str, Any]:
    """How the validation split was drawn: ``val_fraction`` and ``split_seed`` of the image shards' build record,
    reached through the feature record's ``source`` (None each when that manifest cannot be read)."""
    record = feature_record(manifest)
    build = manifest.build
    if record is not None:
        try:
            build = Manifest.load(record.source).build
        except (OSError, ValueError):
            build = {}
    return {
        "source": None if record is None else record.source,
        "val_fraction": build.get("val_fraction"),
        "split_seed": build.get("split_seed"),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    def numbers(kind: type) -> Any:
        return lambda s: [kind(v) for v in s.split(",") if v]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default="runs/words/whitened")
    p.add_argument("--config", default="configs/words_features.yaml")
    p.add_argument("--out", default="runs/study-features")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--batches", type=numbers(int), default=[64, 256, 1024, 2048, 4096, 8192])
    p.add_argument("--lr0", type=float, default=1e-3, help="the rate scale at batch 1,024 (x sqrt(B / 1024))")
    p.add_argument(
        "--probe-factor",
        type=float,
        default=3.0,
        help="the probe's rate, and the sweep's first centre: this x lr0 x sqrt(B / 1024)",
    )
    p.add_argument(
        "--rate-step", type=float, default=3.0, help="the factor between neighbouring candidate rates"
    )
    p.add_argument("--max-rates", type=int, default=6, help="the most candidates a batch's sweep grows to")
    p.add_argument(
        "--probe-batches",
        type=numbers(int),
        default=None,
        help="the batches of the length probe (default: the smallest, the middle one, the largest)",
    )
    p.add_argument("--probe-seeds", type=int, default=2)
    p.add_argument(
        "--probe-epochs", type=float, default=4.0, help="the probe's first length, doubled from there"
    )
    p.add_argument("--max-epochs", type=float, default=64.0, help="the probe's longest run")
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.2,
        help="validation R@1 points: a doubling that gains less (or less than the seeds' spread) stops",
    )
    p.add_argument("--warmup", type=float, default=0.05, help="the linear warm-up's share of a run's steps")
    p.add_argument("--evals", type=int, default=8, help="validation evaluations along a run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="val")
    p.add_argument("--test-split", default="test")
    p.add_argument(
        "--jobs", type=int, default=2, help="runs at a time (each with cores / jobs torch threads)"
    )
    p.add_argument(
        "--own-processes",
        action="store_true",
        help="one `ddp-rank train` process per run (by default each job is a worker process that "
        "trains its runs in turn, paying the imports once)",
    )
    p.add_argument(
        "--results", action="store_true", help="copy the table, record and plot into benchmarks/results/"
    )
    p.add_argument(
        "--from-record", help="a study.json: write its table, intervals and plot again, train nothing"
    )
    args = p.parse_args(argv)
    batches = sorted(args.batches)
    if args.probe_batches is None:
        middle = min(batches, key=lambda b: abs(math.log(b * b / (batches[0] * batches[-1]))))  # geometric
        args.probe_batches = sorted({batches[0], middle, batches[-1]})
    if not set(args.probe_batches) <= set(batches):
        p.error(f"--probe-batches {args.probe_batches}: each must be one of --batches {batches}")
    if args.rate_step <= 1 or args.max_rates < 3:
        p.error(
            f"--rate-step must be above 1 and --max-rates at least 3 (got {args.rate_step}, {args.max_rates})"
        )
    doublings = math.log2(args.max_epochs / args.probe_epochs) if args.probe_epochs > 0 else 0
    if doublings < 1 or doublings != int(doublings):
        p.error(
            f"--max-epochs {args.max_epochs:g} must be --probe-epochs {args.probe_epochs:g} doubled one or more "
            "times (the probe doubles the epochs up to it)"
        )
    if args.probe_seeds < 2:
        p.error(
            "--probe-seeds must be at least 2: the probe compares a doubling's gain with the seeds' spread"
        )
    return args


if __name__ == "__main__":
    raise SystemExit(main())
