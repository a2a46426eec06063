"""The feature study: does retrieval grow with the global batch, and where does it stop? (its write-up:
``benchmarks/results/study-features-2026-11-26-findings.md``; ``make study-features``.)

A linear head on the word set's frozen feature shards (``make words-features``: 20,802 training words and 5,198
held-out words, 8 fonts each, 1,792 values per image) is trained with ``ddp-rank train`` for every point below,
one process per run, and evaluated on the held-out words (each image queries all the others).

1. **Batch axis.** FastAP, random sampler, global batches ``--batches`` (256 ... 8,192).
   The learning rate of each batch is chosen by a small sweep: the square-root-scaled rate
   ``--lr0 * sqrt(B / 1024)`` and ``--lr-factor`` times below and above it, each trained ``--sweep-epochs``
   epochs (a winner at an end of the grid: one more rate beyond it, twice at most); the rate with the best
   R@1 at the end of that short run wins (ties: the lower rate).
2. **Until flat.** The winner of each batch goes on (the same run, resumed) and is extended while its R@1 still
   grows over the last quarter of its steps: flat means R@1 at the last evaluation is less than ``--flat``
   points above R@1 at three quarters of the run (at most ``--max-epochs`` epochs; a run that reaches the cap
   unflattened is marked so in the table).
3. **Sampler and loss at the best batch** (the batch of the highest final R@1): the hard sampler (the fewest
   categories per batch, 2 at least, that leave at most a tenth of the images out), and PNP-Dq and Smooth-AP.
   Each has a rate sweep of its own by the same rule, centred on the best batch's rate (a loss of another scale,
   or batches of other classes, want another rate), and its winner is extended until flat the same way.
4. **Replicates.** ``--replicates K`` trains every point K-1 more times with other seeds (same rate and length,
   evaluated at the end) so that each point has a spread and the differences an interval.

Runs go ``--jobs`` at a time (default 2, one torch thread each on 2 cores: about 3x the throughput of one run on
both, the stream being Python), the waiting first-seed runs before the waiting replicates.

Outputs in ``--out``: one folder per run, ``study.json`` (every figure the tables hold) and ``study.md``;
``--results`` copies the table and the plots into ``benchmarks/results/`` with the date.

    make study-features                      # the study as its write-up reports it
    .venv/bin/python -m benchmarks.study_features --batches 256,1024 --sweep-epochs 1 --max-epochs 2   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from ddp_rank.data.format.manifest import Manifest
from ddp_rank.experiments.intervals import paired_t_interval
from ddp_rank.experiments.runs import RunSummary, read_run

REPO = Path(__file__).resolve().parents[1]

METRICS = ("recall@1", "recall@10", "map@r")


@dataclass
class Point:
    """One trained configuration of the study and its runs (one per seed)."""

    axis: str
    name: str
    batch: int
    lr: float
    overrides: list[str]
    runs: list[Path] = field(default_factory=list)
    steps: int = 0
    flat: bool = False
    sweep: dict[str, float] = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(args.shards)
    n_train = sum(manifest.splits[args.train_split].class_counts.values())
    start = time.monotonic()
    trainer = Trainer(args, out)

    def epochs_to_steps(epochs: float, batch: int) -> int:
        return max(4, math.ceil(epochs * n_train / batch))

    def replicate(point: Point) -> None:
        """The point's other seeds, as long as its first run (evaluated at the end only)."""
        for seed in range(1, args.replicates):
            run = out / "replicates" / f"{point.axis}-{point.name},seed={seed}"
            trainer.train(
                run, [*point.overrides, f"train.seed={seed}"], point.steps, point.steps, replicate=True
            )
            point.runs.append(run)

    def sweep(label: str, batch: int, extra: list[str], centre: float) -> tuple[float, dict[str, float], Path]:
        """The rate of one point: ``centre`` and ``--lr-factor`` times below and above it, each trained
        ``--sweep-epochs`` (a winner at an end of the grid: one more rate beyond it, twice at most); the best R@1
        at the end wins (ties: the lower rate). Returns the rate, every rate's R@1 and the winner's run."""
        steps = epochs_to_steps(args.sweep_epochs, batch)

        def run_of(lr: float) -> Path:
            return out / "lr" / f"{label},lr={lr:.3g}"

        rates = [float(f"{r:.3g}") for r in (centre / args.lr_factor, centre, centre * args.lr_factor)]
        finals: dict[float, float] = {}
        for _ in range(3):  # the grid, then at most two rates beyond a winner at its end
            for lr in rates:
                if lr not in finals:
                    trainer.train(run_of(lr), [*_overrides(batch, lr), *extra], steps, steps)
                    finals[lr] = _last(read_run(run_of(lr)), "recall@1")
            rates = sorted(finals)
            lr = min(finals, key=lambda r: (-finals[r], r))
            if lr not in (rates[0], rates[-1]):
                break
            rates = [float(f"{(lr / args.lr_factor if lr == rates[0] else lr * args.lr_factor):.3g}")]
        return lr, {f"{r:.3g}": finals[r] for r in sorted(finals)}, run_of(lr)

    def batch_chain(batch: int, settled: Future[Point]) -> None:
        """1 and 2 for one batch: the rate sweep, the winner until flat (then ``settled``), its replicates."""
        try:
            label = f"batch={batch}"
            lr, finals, run = sweep(label, batch, [], args.lr0 * math.sqrt(batch / 1024))
            point = Point("batch", label, batch, lr, _overrides(batch, lr), runs=[run], sweep=finals)
            point.steps, point.flat = trainer.until_flat(point.runs[0], point.overrides,
                                                         epochs_to_steps(args.max_epochs, batch))  # fmt: skip
        except BaseException as exc:
            settled.set_exception(exc)
            raise
        settled.set_result(point)
        replicate(point)

    def variant_chain(point: Point, extra: list[str], centre: float) -> None:
        """3 for one sampler or loss at the best batch: its own rate sweep around the best batch's rate (a loss
        of another scale wants another rate), the winner until flat, its replicates."""
        point.lr, point.sweep, run = sweep(f"{point.axis}={point.name}", point.batch, extra, centre)
        point.overrides = [*_overrides(point.batch, point.lr), *extra]
        point.runs.append(run)
        point.steps, point.flat = trainer.until_flat(point.runs[0], point.overrides,
                                                     epochs_to_steps(args.max_epochs, point.batch))  # fmt: skip
        replicate(point)

    # Every chain runs in a thread of its own; ``trainer`` lets --jobs of them train at a time, so a slot freed by
    # one chain is taken by another (the batch points' replicates run beside the sampler and loss runs, and give
    # way to them).
    with ThreadPoolExecutor(max_workers=len(args.batches) + 4) as threads:
        settled: list[Future[Point]] = [Future() for _ in args.batches]
        chains = [threads.submit(batch_chain, b, f) for b, f in zip(args.batches, settled, strict=True)]
        batch_points = [f.result() for f in settled]
        best = max(batch_points, key=lambda p: _last(read_run(p.runs[0]), "recall@1"))
        hard_categories = _categories_to_fill(manifest, args.train_split, best.batch)
        variants = [
            ("sampler", "hard", ["data.sampler=hard", f"data.categories_per_batch={hard_categories}"]),
            ("loss", "pnp-dq", ["loss.name=pnp", "loss.pnp_variant=Dq", "loss.alpha=4"]),
            ("loss", "smooth-ap", ["loss.name=smoothap"]),
        ]
        other_points = []
        for axis, name, extra in variants:
            point = Point(axis, name, best.batch, best.lr, [])
            other_points.append(point)
            chains.append(threads.submit(variant_chain, point, extra, best.lr))
        for chain in chains:
            chain.result()

    wall = time.monotonic() - start
    report = _report(args, manifest, n_train, batch_points, best, other_points, hard_categories, wall)
    (out / "study.json").write_text(json.dumps(report, indent=1) + "\n")
    text = _markdown(report)
    (out / "study.md").write_text(text)
    _plots(report, out)
    print(text)
    if args.results:
        stamp = date.today().isoformat()
        results = REPO / "benchmarks" / "results"
        shutil.copy(out / "study.md", results / f"study-features-{stamp}.md")
        for png in out.glob("study-features-*.png"):
            shutil.copy(png, results / png.name.replace(".png", f"-{stamp}.png"))
    return 0


def _overrides(batch: int, lr: float) -> list[str]:
    return [f"data.global_batch_size={batch}", f"optim.lr={lr:.3g}"]


class Slots:
    """``jobs`` places to train in, handed to waiting first-rank runs before any waiting replicate: the sampler
    and loss runs wait for the slowest batch point to settle, so the replicates must not hold that up."""

    def __init__(self, jobs: int) -> None:
        self.free = jobs
        self.urgent_waiting = 0
        self.changed = threading.Condition()

    @contextmanager
    def held(self, replicate: bool) -> Iterator[None]:
        with self.changed:
            self.urgent_waiting += not replicate
            while self.free == 0 or (replicate and self.urgent_waiting):
                self.changed.wait()
            self.urgent_waiting -= not replicate
            self.free -= 1
        try:
            yield
        finally:
            with self.changed:
                self.free += 1
                self.changed.notify_all()


class Trainer:
    """``ddp-rank train`` runs of the study, one process each, resumed where they stopped."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.jobs)))
        self.slots = Slots(args.jobs)

    def train(
        self, run: Path, overrides: list[str], steps: int, eval_every: int, replicate: bool = False
    ) -> None:
        """Train ``run`` to ``steps`` (continuing it when it holds fewer), evaluated every ``eval_every``; a
        ``replicate`` waits while a first-seed run waits (:class:`Slots`)."""
        done = read_run(run) if (run / "metrics.jsonl").is_file() else None
        if done is not None and done.status == "finished" and done.steps >= steps:
            return
        cmd = [
            self.args.python, "-m", "ddp_rank.cli", "train", "--config", self.args.config,
            f"data.shards={self.args.shards}", "model.backbone=features", "model.weights=none",
            f"train.output_dir={run}", f"train.steps={steps}", f"train.eval_every={eval_every}",
            f"train.checkpoint_every={eval_every}", f"train.log_every={max(1, eval_every // 2)}",
            "train.keep_last=1", "train.progress=false", "train.resume=auto", *overrides,
        ]  # fmt: skip
        run.parent.mkdir(parents=True, exist_ok=True)
        log = run.parent / f"{run.name}.log"
        with self.slots.held(replicate), log.open("a") as sink:
            print(f"[{time.strftime('%H:%M:%S')}] {run.relative_to(self.out)}: to step {steps}", flush=True)
            code = subprocess.call(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=self.env)
        if code != 0:
            raise SystemExit(f"{run}: ddp-rank train exited with {code}; its output is in {log}")

    def until_flat(self, run: Path, overrides: list[str], cap: int) -> tuple[int, bool]:
        """Extend ``run`` (doubling its steps, evaluated every quarter of the new length) until its R@1 is flat
        over its last quarter, or ``cap`` steps; returns (steps, flat)."""
        summary = read_run(run)
        while True:
            flat = _flat(summary, self.args.flat)
            if flat or summary.steps >= cap:
                return summary.steps, flat
            steps = min(cap, 2 * summary.steps)
            self.train(run, overrides, steps, max(1, steps // 4))
            summary = read_run(run)


def _flat(summary: RunSummary, points: float) -> bool:
    """R@1 at the last evaluation is less than ``points`` above R@1 at (or just before) three quarters of it."""
    evals = [(int(r["step"]), float(r["recall@1"])) for r in summary.evals if "recall@1" in r]
    if len(evals) < 2:
        return False
    last_step, last = evals[-1]
    quarter = [v for s, v in evals if s <= 0.75 * last_step]
    return bool(quarter) and 100 * (last - quarter[-1]) < points


def _last(summary: RunSummary, metric: str) -> float:
    value = summary.last(metric)
    return float("nan") if value is None else float(value)


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


def _point_figures(point: Point, n_train: int) -> dict[str, Any]:
    runs = [read_run(r) for r in point.runs]
    figures: dict[str, Any] = {
        "axis": point.axis, "name": point.name, "batch": point.batch, "lr": point.lr, "steps": point.steps,
        "flat": point.flat, "sweep_recall@1": point.sweep, "seeds": len(runs),
        "epochs": round(point.steps * point.batch / n_train, 2), "seconds": [r.seconds for r in runs],
        "curve": [(int(e["step"]), float(e["recall@1"])) for e in runs[0].evals if "recall@1" in e],
    }  # fmt: skip
    for metric in METRICS:
        figures[metric] = [_last(r, metric) for r in runs]
    return figures


def _report(args: argparse.Namespace, manifest: Manifest, n_train: int, batch_points: list[Point], best: Point,
            other_points: list[Point], hard_categories: int, wall: float) -> dict[str, Any]:  # fmt: skip
    points = [_point_figures(p, n_train) for p in batch_points + other_points]
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()})",
        "wall_seconds": round(wall),
        "shards": args.shards,
        "whitened": _whitened(manifest),
        "train_images": n_train,
        "train_classes": len(manifest.splits[args.train_split].class_counts),
        "test_classes": len(manifest.splits[args.test_split].class_counts),
        "rule": {
            "lr0": args.lr0,
            "lr_factor": args.lr_factor,
            "sweep_epochs": args.sweep_epochs,
            "flat_points": args.flat,
            "max_epochs": args.max_epochs,
        },
        "best_batch": best.batch,
        "hard_categories": hard_categories,
        "points": points,
    }


def _whitened(manifest: Manifest) -> bool:
    """Whether the vectors were whitened after the backbone (``ddp-rank shards whiten``)."""
    from ddp_rank.features.records import feature_record

    record = feature_record(manifest)
    return record is not None and record.whitening is not None


def _cell(values: list[float]) -> str:
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.2f}"
    return f"{statistics.fmean(pct):.2f} ± {statistics.stdev(pct):.2f}"


def _difference(a: dict[str, Any], b: dict[str, Any], metric: str) -> str:
    """a - b in points with the paired 95% interval over seeds (seed i of one with seed i of the other)."""
    pairs = list(zip(a[metric], b[metric], strict=False))
    diffs = [100 * (x - y) for x, y in pairs]
    interval = paired_t_interval(diffs)
    if interval is None:
        return f"{statistics.fmean(diffs):+.2f}"
    return f"{interval.mean:+.2f} [{interval.low:+.2f}, {interval.high:+.2f}]"


def _markdown(report: dict[str, Any]) -> str:
    rule = report["rule"]
    lines = [
        f"# The word study: a linear head on frozen features{' (PCA-whitened)' if report.get('whitened') else ''}, "
        f"{report['date']}",
        "",
        f"{report['machine']}; {report['wall_seconds'] // 60} min {report['wall_seconds'] % 60} s for the whole "
        f"study. {report['train_classes']:,} training words ({report['train_images']:,} images), "
        f"{report['test_classes']:,} held-out words; R@1, R@10 and MAP@R in % on the held-out words at the end "
        "of each run (mean ± std over seeds where there are several).",
        "",
        f"Rule: each batch B tries lr {rule['lr0']:g} x sqrt(B / 1024) and {rule['lr_factor']:g}x below and above "
        f"for {rule['sweep_epochs']:g} epoch(s) (a winner at an end of the rates: one more beyond it, twice at "
        "most); the best R@1 wins; that run is extended (its steps doubled) "
        f"until R@1 gains less than {rule['flat_points']:g} points over the last quarter of its steps (cap: "
        f"{rule['max_epochs']:g} epochs). The sampler and loss points run at the best batch "
        f"({report['best_batch']:,}), each with a sweep of its own centred on that batch's rate, then extended "
        f"the same way; `hard` draws {report['hard_categories']} categories (first letter and length) per batch, "
        "and leaves out the categories too small for their share.",
        "",
        "| axis | point | batch | lr | lr sweep (R@1 at the sweep's end) | steps | epochs | flat | R@1 | R@10 | "
        "MAP@R | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        sweep = ", ".join(f"{lr}: {100 * v:.1f}" for lr, v in p["sweep_recall@1"].items()) or "-"
        lines.append(
            f"| {p['axis']} | {p['name']} | {p['batch']:,} | {p['lr']:.3g} | {sweep} | {p['steps']:,} | "
            f"{p['epochs']:g} | {'yes' if p['flat'] else 'no (cap)'} | {_cell(p['recall@1'])} | "
            f"{_cell(p['recall@10'])} | {_cell(p['map@r'])} | {p['seeds']} |"
        )
    batch = [p for p in report["points"] if p["axis"] == "batch"]
    best = next(p for p in batch if p["batch"] == report["best_batch"])
    lines += ["", "Differences (points, paired 95% interval over seeds where there are several):", ""]
    lines += ["| difference | R@1 | MAP@R |", "|---|---|---|"]
    for a, b in zip(batch[1:], batch[:-1], strict=False):
        lines.append(f"| batch {a['batch']:,} - {b['batch']:,} | {_difference(a, b, 'recall@1')} | "
                     f"{_difference(a, b, 'map@r')} |")  # fmt: skip
    for p in report["points"]:
        if p["axis"] != "batch":
            lines.append(f"| {p['name']} - FastAP random at {best['batch']:,} | {_difference(p, best, 'recall@1')} "
                         f"| {_difference(p, best, 'map@r')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _plots(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = [p for p in report["points"] if p["axis"] == "batch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [p["batch"] for p in batch]
    for metric, marker in (("recall@1", "o-"), ("map@r", "s--")):
        means = [100 * statistics.fmean(p[metric]) for p in batch]
        left.plot(xs, means, marker, label=metric)
        for x, p in zip(xs, batch, strict=True):
            left.scatter([x] * len(p[metric]), [100 * v for v in p[metric]], s=10, color="gray", zorder=3)
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [f"{x:,}" for x in xs])
    left.set_xlabel("global batch (FastAP, random sampler, lr swept per batch)")
    left.set_ylabel("held-out words (%)")
    left.grid(alpha=0.3)
    left.legend()
    for p in batch:
        steps, r1 = zip(*p["curve"], strict=True)
        epochs = [s * p["batch"] / report["train_images"] for s in steps]
        right.plot(epochs, [100 * v for v in r1], "o-", ms=3, label=f"{p['batch']:,}")
    right.set_xlabel("epochs")
    right.set_ylabel("R@1 (%), seed 0")
    right.grid(alpha=0.3)
    right.legend(title="batch", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "study-features-batch.png", dpi=120)
    plt.close(fig)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default="runs/words/whitened")
    p.add_argument("--config", default="configs/words_features.yaml")
    p.add_argument("--out", default="runs/study-features")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")],
                   default=[256, 512, 1024, 2048, 4096, 8192])  # fmt: skip
    p.add_argument("--lr0", type=float, default=1e-3, help="the rate at batch 1,024 the sweep centres on")
    p.add_argument("--lr-factor", type=float, default=3.0)
    p.add_argument("--sweep-epochs", type=float, default=1.0)
    p.add_argument("--max-epochs", type=float, default=8.0)
    p.add_argument(
        "--flat", type=float, default=0.5, help="R@1 points over the last quarter that still count as flat"
    )
    p.add_argument("--replicates", type=int, default=2)
    p.add_argument("--train-split", default="train")
    p.add_argument("--test-split", default="test")
    p.add_argument(
        "--jobs", type=int, default=2, help="runs at a time (each with cores / jobs torch threads)"
    )
    p.add_argument("--results", action="store_true", help="copy table and plots into benchmarks/results/")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
