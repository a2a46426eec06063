"""The word study: does retrieval grow with the global batch? Every choice made on validation words, the test words
evaluated once per final run (``make study-features``; the write-up: ``benchmarks/results/study-features-*``).

A linear head on the word set's frozen, PCA-whitened feature shards (``make words-whitened``: training words,
validation words carved from them by ``shards build --val-fraction``, held-out test words; 8 fonts each) is
trained as ``ddp-rank train`` trains it, one process per run (in turn in ``--jobs`` worker processes).

1. **Batch axis.** FastAP, random sampler, global batches ``--batches`` (64 ... 8,192).
2. **One schedule for every batch.** Every final run trains ``--epochs`` epochs: a linear warm-up over
   ``--warmup`` of its steps, then a cosine decay to zero. The validation split is evaluated ``--evals`` times
   along the run (its curve shows whether it has stopped rising: ``--flat``).
3. **The rate of each batch** is chosen among the same ``--rate-factors`` multiples of ``--lr0 * sqrt(B / 1024)``
   for every batch, each trained on a shorter schedule of the same shape (``--sweep-epochs``), by validation R@1
   at its end (ties: the lower rate). A winner at an end of the grid is reported as such, never extended: every
   batch gets the same number of candidates.
4. **Seeds.** The chosen rate of each point is trained with ``--seeds`` seeds; the best batch is the one of the
   highest mean validation R@1 at the end.
5. **Sampler and loss at the best batch** (``--variants``, none by default: they do not fit the 90 minutes of
   ``make study-features`` beside the batch axis), each with a rate sweep of its own over the best batch's
   candidates.
   **The budget check** (``--budget-check``): seed 0 of the largest batch (the fewest steps) trained again for
   ``--budget-factors`` times ``--epochs`` (twice by default), at its chosen rate: a decaying rate flattens any
   curve by itself, so validation R@1 at the end of longer schedules is what tells whether the length sufficed.
6. **The test split, once.** The last checkpoint of every final run is evaluated on the test words
   (``ddp-rank eval --split test --per-query``). A difference between two points comes with a paired bootstrap
   over the test classes (the same draw for both points and every seed, on the seed-averaged per-query
   difference), a paired t over the seeds, and the two combined (half-widths in quadrature); it is called beyond
   noise only where the combined interval excludes zero (``ddp_rank.experiments.query_pairs``).

Runs go ``--jobs`` at a time (default 2, one torch thread each on 2 cores: the stream is Python, so two runs of
one thread each go faster than one run on both), each job a worker process that trains its runs one after
another (``ddp_rank.experiments.in_process``: the imports and set-up paid once per worker, not once per run, and
every run trained as it would be alone; ``--own-processes``: one ``ddp-rank train`` process per run instead);
the runs draw no pictures of their own (``train.plots=false``: the study draws its own). A run that exists is
reused only if its config holds the settings asked for (a rerun with other settings in the same ``--out`` stops and says so); a candidate rate whose
run fails (a non-finite loss) counts as the worst candidate; any other failure stops the study. Outputs in ``--out``: one folder per run, ``study.json`` (the
record: every figure the table, plot and conclusions hold) and ``study.md``; ``--results`` copies the table and
plots into ``benchmarks/results/`` with the date; ``--from-record`` rewrites them from a record without training.

    make study-features                                   # the study as its write-up reports it
    .venv/bin/python -m benchmarks.study_features --batches 256,1024 --epochs 1 --sweep-epochs 0.5 --seeds 2
    .venv/bin/python -m benchmarks.study_features --from-record runs/study-features/study.json --results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.study_features_report import differences, markdown, plots
from ddp_rank.checkpoints.read import latest_checkpoint
from ddp_rank.config import ConfigError, load_config, to_dict
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.experiments.in_process import train_in_worker, worker_pool
from ddp_rank.experiments.runs import RunSummary, flatten_config, read_run
from ddp_rank.features.records import feature_record

REPO = Path(__file__).resolve().parents[1]
METRICS = ("recall@1", "recall@10", "map@r")
DEFAULT_VARIANTS: tuple[str, ...] = ()
VARIANTS = {
    "hard": ("sampler", ["data.sampler=hard"]),  # categories_per_batch added at the best batch
    "pnp-dq": ("loss", ["loss.name=pnp", "loss.pnp_variant=Dq", "loss.alpha=4"]),
    "smooth-ap": ("loss", ["loss.name=smoothap"]),
}


@dataclass
class Point:
    """One trained configuration: its rate sweep (validation R@1 at each candidate's end) and its final runs."""

    axis: str
    name: str
    batch: int
    extra: list[str]
    lr: float = 0.0
    sweep: dict[str, float] = field(default_factory=dict)
    runs: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Schedule:
    """Steps, warm-up and evaluations of a run of ``epochs`` at ``batch``: the same shape at every batch."""

    epochs: float
    warmup: float
    evals: int

    def overrides(self, batch: int, n_train: int) -> tuple[int, list[str]]:
        steps = max(self.evals, math.ceil(self.epochs * n_train / batch))
        every = max(1, steps // self.evals)
        return steps, [
            f"train.steps={steps}", f"train.eval_every={every}", f"train.checkpoint_every={every}",
            f"train.log_every={max(1, every // 2)}", "optim.schedule=cosine", "optim.min_lr_ratio=0",
            f"optim.warmup_steps={max(1, round(self.warmup * steps))}",
        ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    if args.from_record:
        record = json.loads(Path(args.from_record).read_text())
        _write(record, Path(args.from_record).parent, args.results)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(args.shards)
    _check_splits(manifest, args)
    n_train = manifest.splits[args.train_split].samples
    start = time.monotonic()
    trainer = Trainer(args, out)
    try:
        return _study(args, out, manifest, n_train, start, trainer)
    finally:
        trainer.close()


def _study(args: argparse.Namespace, out: Path, manifest: Manifest, n_train: int, start: float,
           trainer: Trainer) -> int:  # fmt: skip
    final = Schedule(args.epochs, args.warmup, args.evals)
    short = Schedule(args.sweep_epochs, args.warmup, 1)

    def sweep(point: Point, base: float) -> None:
        """Point 3: the candidates ``base`` x ``--rate-factors``, each on the short schedule, judged on validation."""
        rates = [float(f"{base * f:.3g}") for f in args.rate_factors]
        steps, schedule = short.overrides(point.batch, n_train)
        runs = {lr: out / "lr" / f"{point.axis}={point.name},lr={lr:.3g}" for lr in rates}
        with ThreadPoolExecutor(len(rates)) as pool:
            jobs = {lr: pool.submit(trainer.train, run, [*_overrides(point.batch, lr), *point.extra, *schedule],
                                    steps, True) for lr, run in runs.items()}  # fmt: skip
            trained = {lr: job.result() for lr, job in jobs.items()}
        finals = {
            lr: _last(read_run(run), "recall@1") if trained[lr] else math.nan for lr, run in runs.items()
        }
        if not any(math.isfinite(v) for v in finals.values()):
            raise SystemExit(f"{point.axis}={point.name}: every candidate rate failed (logs in {out / 'lr'})")
        point.lr = min(finals, key=lambda r: (-finals[r] if math.isfinite(finals[r]) else math.inf, r))
        point.sweep = {f"{lr:.3g}": finals[lr] for lr in rates}

    def seeds(point: Point) -> None:
        """Point 4 and 6: the chosen rate with every seed on the final schedule, then each on the test split."""
        steps, schedule = final.overrides(point.batch, n_train)
        name = f"{point.axis}={point.name},lr={point.lr:.3g}"
        runs = [out / "final" / f"{name},seed={s}" for s in range(args.seeds)]
        overrides = [*_overrides(point.batch, point.lr), *point.extra, *schedule]
        with ThreadPoolExecutor(len(runs)) as pool:
            jobs = [pool.submit(trainer.train, run, [*overrides, f"train.seed={s}"], steps)
                    for s, run in enumerate(runs)]  # fmt: skip
            for job in jobs:
                job.result()
        for run in runs:
            trainer.test(run)
        point.runs = runs

    def base_rate(batch: int) -> float:
        return args.lr0 * math.sqrt(batch / 1024)

    budget_runs: dict[tuple[int, float], Future[Path]] = {}

    def batch_chain(batch: int) -> Point:
        point = Point("batch", str(batch), batch, [])
        sweep(point, base_rate(batch))
        if batch in args.budget_check:  # beside the final runs, not after them: it needs the chosen rate only
            for factor in args.budget_factors:
                budget_runs[batch, factor] = threads.submit(budget_train, point, factor)
        seeds(point)
        return point

    def variant_chain(point: Point, base: float) -> Point:
        sweep(point, base)
        seeds(point)
        return point

    def longer(factor: float) -> Schedule:
        """The budget check's schedule: the final runs' shape, ``factor`` times their epochs."""
        return Schedule(factor * args.epochs, args.warmup, args.evals)

    def budget_train(point: Point, factor: float) -> Path:
        """A budget check's run: seed 0 of ``point`` again for ``factor`` times the epochs."""
        steps, schedule = longer(factor).overrides(point.batch, n_train)
        run = (
            out
            / "budget"
            / f"{point.axis}={point.name},lr={point.lr:.3g},seed=0,epochs={factor * args.epochs:g}"
        )
        trainer.train(
            run, [*_overrides(point.batch, point.lr), *point.extra, *schedule, "train.seed=0"], steps
        )
        return run

    def budget_check(point: Point, factor: float, run: Path) -> dict[str, Any]:
        """Validation R@1 at the end of the longer run, and its gain over the final run's (seed 0)."""
        summary = read_run(run)
        val = _last(summary, "recall@1")
        gain = 100 * (val - _last(read_run(point.runs[0]), "recall@1"))
        schedule = longer(factor)
        steps, _ = schedule.overrides(point.batch, n_train)
        return {"batch": point.batch, "epochs": schedule.epochs, "steps": steps, "val": val, "gain": gain,
                "val_gain": _val_gain(summary), "path": str(run.relative_to(out))}  # fmt: skip

    n_budget = len(args.budget_check) * len(args.budget_factors)
    with ThreadPoolExecutor(max_workers=2 * len(args.batches) + len(args.variants) + n_budget) as threads:
        chains = {b: threads.submit(batch_chain, b) for b in sorted(args.batches)}
        batch_points = [f.result() for f in chains.values()]
        best = max(batch_points, key=lambda p: (_mean_val(p), -p.batch))
        variants = []
        for name in args.variants:
            axis, extra = VARIANTS[name]
            if name == "hard":
                k = _categories_to_fill(manifest, args.train_split, best.batch)
                extra = [*extra, f"data.categories_per_batch={k}"]
            variants.append(
                threads.submit(variant_chain, Point(axis, name, best.batch, extra), base_rate(best.batch))
            )
        other_points = [f.result() for f in variants]
        budget = [
            budget_check(p, factor, budget_runs[p.batch, factor].result())
            for p in batch_points
            for factor in args.budget_factors
            if (p.batch, factor) in budget_runs
        ]

    record = _record(
        args, manifest, final, short, batch_points, best, other_points, time.monotonic() - start, out
    )
    record["budget_check"] = budget
    record["differences"] = differences(record, out)
    (out / "study.json").write_text(json.dumps(record, indent=1) + "\n")
    _write(record, out, args.results)
    return 0


def _write(record: dict[str, Any], out: Path, results: bool) -> None:
    """``study.md`` and the plots from the record (and into ``benchmarks/results/`` with its date)."""
    text = markdown(record)
    (out / "study.md").write_text(text)
    pngs = plots(record, out)
    print(text)
    if results:
        target = REPO / "benchmarks" / "results"
        shutil.copy(out / "study.md", target / f"study-features-{record['date']}.md")
        (target / f"study-features-{record['date']}.json").write_text(json.dumps(record, indent=1) + "\n")
        for png in pngs:
            shutil.copy(png, target / png.name.replace(".png", f"-{record['date']}.png"))


def _check_splits(manifest: Manifest, args: argparse.Namespace) -> None:
    missing = [s for s in (args.train_split, args.val_split, args.test_split) if s not in manifest.splits]
    if missing:
        raise SystemExit(
            f"{args.shards}: no split {', '.join(map(repr, missing))} (it has {sorted(manifest.splits)}). The study "
            f"chooses on a validation split of training classes: build the image shards with `ddp-rank shards "
            f"build ... --val-fraction 0.1` (the Makefile's words-shards does), then the feature shards again: "
            f"`rm -r runs/words/shards runs/words/features runs/words/whitened && make words-whitened`"
        )


def _overrides(batch: int, lr: float) -> list[str]:
    return [f"data.global_batch_size={batch}", f"optim.lr={lr:.3g}"]


class Trainer:
    """``ddp-rank train`` / ``eval`` processes of the study, ``--jobs`` at a time, resumed where they stopped."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.threads = max(1, (os.cpu_count() or 1) // args.jobs)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        self.slots = threading.BoundedSemaphore(args.jobs)
        self.lock = threading.Lock()
        self.pool: ProcessPoolExecutor | None = None
        """The ``--jobs`` worker processes that train the runs, started at the first run."""
        self.stopped = threading.Event()
        """Set by a fatal failure: no other run starts."""
        self.common = [f"data.shards={args.shards}", "model.backbone=features", "model.weights=none",
                       f"data.train_split={args.train_split}", f"data.test_split={args.val_split}",
                       "eval.metrics=[]"]  # fmt: skip

    def train(self, run: Path, overrides: list[str], steps: int, may_fail: bool = False) -> bool:
        """Train ``run`` to ``steps`` (an interrupted run continues); its evaluations are on validation. A run
        that finished with the settings asked for is kept. ``may_fail``: a failed run returns False (a candidate
        rate that diverged) instead of stopping the study."""
        asked = [*self.common, *overrides]
        if (run / "config.yaml").is_file():
            _check_same_settings(run, asked)
            done = read_run(run)
            if done.status == "finished" and done.steps == steps:
                return True
        for stale in ("test.json", "test-queries.npz"):
            (run / stale).unlink(missing_ok=True)
        # The study draws its own pictures from study.json: a run's own (matplotlib's import and three PNGs, about
        # a second of each run's fixed cost) would go unread.
        settings = [*asked, f"train.output_dir={run}", "train.keep_last=1", "train.progress=false",
                    "train.resume=auto", "train.plots=false"]  # fmt: skip
        if self.args.own_processes:
            cmd = [self.args.python, "-m", "ddp_rank.cli", "train", "--config", self.args.config, *settings]
            return self._call(run, cmd, "train", may_fail)
        return self._call(run, (self.args.config, settings), "train", may_fail)

    def _in_worker(self, config: str, settings: list[str], log: Path) -> int:
        """The run trained by one of the ``--jobs`` worker processes; its exit status as ``ddp-rank train``'s."""
        with self.lock:
            if self.pool is None:
                # In the repository, as the `ddp-rank train` processes ran: relative paths mean the same.
                self.pool = worker_pool(self.args.jobs, self.threads, self.args.python, REPO)
            pool = self.pool
        try:
            return pool.submit(train_in_worker, config, settings, str(log)).result()
        except BrokenProcessPool:  # a worker ended without a word (killed, out of memory): the others with it
            with self.lock:
                if self.pool is pool:
                    self.pool = None  # the next run starts fresh workers
            return -9

    def close(self) -> None:
        """End the worker processes."""
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def test(self, run: Path) -> None:
        """The test split, once, on the run's last checkpoint (not its best on validation: the schedule ends)."""
        if (run / "test-queries.npz").is_file() and (run / "test.json").is_file():
            return
        last = latest_checkpoint(run / "checkpoints")
        if last is None:
            raise SystemExit(f"{run}: no checkpoint to evaluate on the test split")
        self._call(run, [self.args.python, "-m", "ddp_rank.cli", "eval", "--checkpoint", str(last), "--split",
                         self.args.test_split, "--name", "test", "--output", str(run / "test.json"), "--per-query",
                         str(run / "test-queries.npz"), "eval.metrics=[]"], "test")  # fmt: skip

    def _call(self, run: Path, cmd: list[str] | tuple[str, list[str]], what: str = "train",
              may_fail: bool = False) -> bool:  # fmt: skip
        """Run ``cmd``, a command, or (config, overrides) of a run for a worker process, with its output in the
        run's log."""
        run.parent.mkdir(parents=True, exist_ok=True)
        log = run.parent / f"{run.name}.{what}.log"
        with self.slots:
            if self.stopped.is_set():
                raise SystemExit(f"{run}: not started, the study is stopping after a failure")
            print(f"[{time.strftime('%H:%M:%S')}] {what} {run.relative_to(self.out)}", flush=True)
            if isinstance(cmd, tuple):
                code = self._in_worker(*cmd, log.resolve())
            else:
                with log.open("a") as sink:
                    code = subprocess.call(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=self.env)
        if code != 0 and may_fail:
            print(f"[{time.strftime('%H:%M:%S')}] {run.relative_to(self.out)} failed (exit {code}): counted as the "
                  f"worst candidate; its output is in {log}", flush=True)  # fmt: skip
            return False
        if code != 0:
            self.stopped.set()
            raise SystemExit(f"{run}: ddp-rank {what} exited with {code}; its output is in {log}")
        return True


def _check_same_settings(run: Path, asked: list[str]) -> None:
    """Stop when ``run`` was trained with other settings than ``asked`` (``section.key=value`` overrides): a rerun
    with other rules in the same ``--out`` would otherwise report runs it did not make. The run's saved config is
    read twice by the project's own loader, as saved and with ``asked`` on top: the overrides are parsed and coerced
    exactly as ``ddp-rank train`` parsed them, so ``1e-3`` and ``0.001`` are one rate."""
    saved = run / "config.yaml"
    try:
        have = flatten_config(to_dict(load_config(saved)))
        wanted = flatten_config(to_dict(load_config(saved, asked)))
    except ConfigError as exc:
        raise SystemExit(f"{run}: its config.yaml cannot be compared with the settings asked ({exc}): give another "
                         f"--out, or delete {run} to train it again") from None  # fmt: skip
    differ = [f"{key}={have[key]!r}, asked {wanted[key]!r}" for key in wanted if have.get(key) != wanted[key]]
    if differ:
        raise SystemExit(f"{run} was trained with other settings ({'; '.join(differ)}): give another --out, or "
                         f"delete {run} to train it again")  # fmt: skip


def _last(summary: RunSummary, metric: str) -> float:
    value = summary.last(metric)
    return float("nan") if value is None else float(value)


def _mean_val(point: Point) -> float:
    values = [_last(read_run(r), "recall@1") for r in point.runs]
    return sum(values) / len(values)


def _categories_to_fill(manifest: Manifest, split: str, batch: int, coverage: float = 0.9) -> int:
    """The fewest categories per batch (2 at least, the FastAP paper's choice) for which the categories that can
    give a batch their share (``batch / k`` images) hold ``coverage`` of the split's images: the hard sampler
    leaves a smaller category out of its schedule, and a batch of a few thousand images would otherwise be drawn
    from the few largest categories alone."""
    sizes: dict[int, int] = {}
    category = {c.id: c.category for c in manifest.classes}
    for class_id, count in manifest.splits[split].class_counts.items():
        key = category[class_id]
        if key is not None:
            sizes[key] = sizes.get(key, 0) + count
    total = sum(sizes.values())
    for k in range(2, len(sizes) + 1):
        if sum(size for size in sizes.values() if size >= batch / k) >= coverage * total:
            return k
    return len(sizes)


def _val_gain(summary: RunSummary) -> float | None:
    """Validation R@1 points gained from the evaluation at (or just before) three quarters of the run to its
    last: how far the curve still rose at the end."""
    evals = [(int(r["step"]), float(r["recall@1"])) for r in summary.evals if "recall@1" in r]
    if len(evals) < 2:
        return None
    quarter = [v for s, v in evals if s <= 0.75 * evals[-1][0]]
    return 100 * (evals[-1][1] - quarter[-1]) if quarter else None


def _run_figures(run: Path, seed: int, out: Path) -> dict[str, Any]:
    summary = read_run(run)
    test = json.loads((run / "test.json").read_text())["test"]["metrics"]
    return {
        "seed": seed, "path": str(run.relative_to(out)), "steps": summary.steps, "seconds": summary.seconds,
        "val_curve": [(int(e["step"]), float(e["recall@1"])) for e in summary.evals if "recall@1" in e],
        "val_gain": _val_gain(summary), "val": {m: _last(summary, m) for m in METRICS},
        "test": {m: float(test[m]) for m in METRICS}, "queries": str((run / "test-queries.npz").relative_to(out)),
    }  # fmt: skip


def _record(args: argparse.Namespace, manifest: Manifest, final: Schedule, short: Schedule,
            batch_points: list[Point], best: Point, other_points: list[Point], wall: float,
            out: Path) -> dict[str, Any]:  # fmt: skip
    def split_size(name: str) -> dict[str, int]:
        return {"classes": len(manifest.splits[name].class_counts), "images": manifest.splits[name].samples}

    n_train = manifest.splits[args.train_split].samples
    points = []
    for p in [*batch_points, *other_points]:
        steps, _ = final.overrides(p.batch, n_train)
        edge = p.lr in (min(float(r) for r in p.sweep), max(float(r) for r in p.sweep))
        runs = [_run_figures(r, s, out) for s, r in enumerate(p.runs)]
        points.append({"axis": p.axis, "name": p.name, "batch": p.batch, "lr": p.lr, "sweep": p.sweep,
                       "at_edge": edge, "steps": steps, "epochs": round(steps * p.batch / n_train, 2),
                       "runs": runs})  # fmt: skip
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        "wall_seconds": round(wall),
        "jobs": args.jobs,
        "shards": args.shards,
        "splits": {
            "train": split_size(args.train_split),
            "val": split_size(args.val_split),
            "test": split_size(args.test_split),
        },
        "validation": _validation_draw(manifest),
        "rule": {
            "lr0": args.lr0,
            "rate_factors": args.rate_factors,
            "epochs": final.epochs,
            "sweep_epochs": short.epochs,
            "warmup": final.warmup,
            "evals": final.evals,
            "seeds": args.seeds,
            "flat_points": args.flat,
        },
        "best_batch": best.batch,
        "points": points,
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
    return {"source": None if record is None else record.source, "val_fraction": build.get("val_fraction"),
            "split_seed": build.get("split_seed")}  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    def numbers(kind: type) -> Any:
        return lambda s: [kind(v) for v in s.split(",") if v]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default="runs/words/whitened")
    p.add_argument("--config", default="configs/words_features.yaml")
    p.add_argument("--out", default="runs/study-features")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--batches", type=numbers(int), default=[64, 128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument(
        "--lr0",
        type=float,
        default=1e-3,
        help="the base rate at batch 1,024: the candidates are it x sqrt(B / 1024) x --rate-factors",
    )
    p.add_argument("--rate-factors", type=numbers(float), default=[1.0, 3.0, 9.0, 27.0],
                   help="the candidates: these multiples of lr0 * sqrt(B / 1024), the same for every batch")  # fmt: skip
    p.add_argument("--epochs", type=float, default=4.0, help="every final run's length")
    p.add_argument(
        "--sweep-epochs", type=float, default=2.0, help="each candidate rate's run (same schedule shape)"
    )
    p.add_argument("--warmup", type=float, default=0.05, help="the linear warm-up's share of a run's steps")
    p.add_argument("--evals", type=int, default=8, help="validation evaluations along a final run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--flat", type=float, default=0.3,
                   help="validation R@1 points over a run's last quarter below which its curve counts as flat")  # fmt: skip
    p.add_argument("--budget-check", type=numbers(int), default=None,
                   help="batches whose seed 0 trains again for longer (default: the largest)")  # fmt: skip
    p.add_argument("--budget-factors", type=numbers(float), default=[2.0],
                   help="the budget check's lengths: these multiples of --epochs, each a run")  # fmt: skip
    p.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v], default=list(DEFAULT_VARIANTS),
                   help=f"sampler and loss points at the best batch, of {', '.join(VARIANTS)} (empty: none)")  # fmt: skip
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="val")
    p.add_argument("--test-split", default="test")
    p.add_argument(
        "--jobs", type=int, default=2, help="runs at a time (each with cores / jobs torch threads)"
    )
    p.add_argument("--own-processes", action="store_true",
                   help="one `ddp-rank train` process per run (by default each job is a worker process that "
                        "trains its runs in turn, paying the imports once)")  # fmt: skip
    p.add_argument("--results", action="store_true", help="copy table and plots into benchmarks/results/")
    p.add_argument(
        "--from-record", help="a study.json: write its table, plot and conclusions again, train nothing"
    )
    args = p.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose among {', '.join(VARIANTS)}")
    if args.budget_check is None:
        args.budget_check = [max(args.batches)]
    if not set(args.budget_check) <= set(args.batches):
        p.error(f"--budget-check {args.budget_check}: each must be one of --batches {args.batches}")
    if not args.budget_factors or any(f <= 1 for f in args.budget_factors):
        p.error(
            f"--budget-factors {args.budget_factors}: each must be above 1 (a longer schedule than --epochs)"
        )
    return args


if __name__ == "__main__":
    raise SystemExit(main())
