"""The word study's runs (``benchmarks/study_features.py``): their schedule, their settings, and the ``Trainer`` that
trains them ``--jobs`` at a time in worker processes and evaluates the final ones on the test split."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from ddp_rank.config import ConfigError, load_config, to_dict
from ddp_rank.experiments.in_process import train_in_worker, worker_pool
from ddp_rank.experiments.runs import flatten_config, read_run
from ddp_rank.model.checkpoint_read import latest_checkpoint

REPO = Path(__file__).resolve().parents[1]


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
            f"train.steps={steps}",
            f"train.eval_every={every}",
            f"train.checkpoint_every={every}",
            f"train.log_every={max(1, every // 2)}",
            "optim.schedule=cosine",
            "optim.min_lr_ratio=0",
            f"optim.warmup_steps={max(1, round(self.warmup * steps))}",
        ]


def overrides_for(batch: int, lr: float) -> list[str]:
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
        self.common = [
            f"data.shards={args.shards}",
            "model.backbone=features",
            "model.weights=none",
            f"data.train_split={args.train_split}",
            f"data.test_split={args.val_split}",
            "eval.metrics=[]",
        ]

    def train(self, run: Path, overrides: list[str], steps: int, may_fail: bool = False) -> bool:
        """Train ``run`` to ``steps`` (an interrupted run continues); its evaluations are on validation. A run
        that finished with the settings asked for is kept. ``may_fail``: a failed run returns False (a candidate
        rate that diverged) instead of stopping the study."""
        asked = [*self.common, *overrides]
        if (run / "config.yaml").is_file():
            check_same_settings(run, asked)
            done = read_run(run)
            if done.status == "finished" and done.steps == steps:
                return True
        for stale in ("test.json", "test-queries.npz"):
            (run / stale).unlink(missing_ok=True)
        # The study draws its own pictures from study.json: a run's own (matplotlib's import and three PNGs, about
        # a second of each run's fixed cost) would go unread.
        settings = [
            *asked,
            f"train.output_dir={run}",
            "train.keep_last=1",
            "train.progress=false",
            "train.resume=auto",
            "train.plots=false",
        ]
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
        self._call(
            run,
            [
                self.args.python,
                "-m",
                "ddp_rank.cli",
                "eval",
                "--checkpoint",
                str(last),
                "--split",
                self.args.test_split,
                "--name",
                "test",
                "--output",
                str(run / "test.json"),
                "--per-query",
                str(run / "test-queries.npz"),
                "eval.metrics=[]",
            ],
            "test",
        )

    def _call(
        self, run: Path, cmd: list[str] | tuple[str, list[str]], what: str = "train", may_fail: bool = False
    ) -> bool:
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
            print(
                f"[{time.strftime('%H:%M:%S')}] {run.relative_to(self.out)} failed (exit {code}): counted as the "
                f"worst candidate; its output is in {log}",
                flush=True,
            )
            return False
        if code != 0:
            self.stopped.set()
            raise SystemExit(f"{run}: ddp-rank {what} exited with {code}; its output is in {log}")
        return True


def check_same_settings(run: Path, asked: list[str]) -> None:
    """Stop when ``run`` was trained with other settings than ``asked`` (``section.key=value`` overrides): a rerun
    with other rules in the same ``--out`` would otherwise report runs it did not make. The run's saved config is
    read twice by the project's own loader, as saved and with ``asked`` on top: the overrides are parsed and coerced
    exactly as ``ddp-rank train`` parsed them, so ``1e-3`` and ``0.001`` are one rate."""
    saved = run / "config.yaml"
    try:
        have = flatten_config(to_dict(load_config(saved)))
        wanted = flatten_config(to_dict(load_config(saved, asked)))
    except ConfigError as exc:
        raise SystemExit(
            f"{run}: its config.yaml cannot be compared with the settings asked ({exc}): give another "
            f"--out, or delete {run} to train it again"
        ) from None
    differ = [f"{key}={have[key]!r}, asked {wanted[key]!r}" for key in wanted if have.get(key) != wanted[key]]
    if differ:
        raise SystemExit(
            f"{run} was trained with other settings ({'; '.join(differ)}): give another --out, or "
            f"delete {run} to train it again"
        )
