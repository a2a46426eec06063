"""One-process runs of a sweep or a study, one after another in the same Python process.

A ``ddp-rank train`` process pays a fixed cost before its first step (importing torch, accelerate and
``torch._dynamo``, which the optimizer's first call imports; building the run) and another after its last (the
summary pictures import matplotlib). :class:`RunsInProcess` pays the imports once for many runs: each run is
``run_training`` on its config, between two :meth:`ProcessState.restore` calls that put back everything a run
changes process-wide (accelerate's singletons, the random generators, torch's switches, the environment, the
log handlers, the signal handlers), so every run trains exactly as it would alone in a fresh process
(``tests/experiments/test_in_process.py`` compares their metrics bit for bit).

:func:`train_in_worker` is the same for a process pool's worker (``concurrent.futures`` with the ``spawn``
context): each worker is a fresh process that trains the runs it is given in turn, so ``--jobs`` workers train
``--jobs`` runs at a time. A job on several processes is not for this: ``accelerate launch`` keeps one process
per rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ddp_rank.config import ConfigError, load_config
from ddp_rank.runtime import AGREED_ERRORS
from ddp_rank.runtime.failure import launch_world_size, report_agreed_error
from ddp_rank.runtime.process_state import ProcessState
from ddp_rank.train.preemption import EXIT_REQUEUE, RunStopped
from ddp_rank.train.trainer import run_training

__all__ = ["EXIT_FAILED", "EXIT_USAGE", "RunsInProcess", "train_in_worker", "worker_pool"]

EXIT_USAGE = 2
"""A config or start-up error (one line printed), as ``ddp-rank train`` exits with."""
EXIT_FAILED = 1
"""Any other failure of the run (its traceback printed)."""

_WORKER: RunsInProcess | None = None


class RunsInProcess:
    """Train one-process runs in this process, each as if alone in a fresh one. Make it before the first run
    (it records the state every run starts from), in the main thread (signal handlers are set there alone)."""

    def __init__(self) -> None:
        if launch_world_size() > 1:
            raise RuntimeError(
                f"runs in one process are one-process runs, but this process is one of WORLD_SIZE="
                f"{launch_world_size()}: launch each multi-process run with `accelerate launch` instead"
            )
        self.start = ProcessState.record()

    def train(
        self, config: str | None, overrides: Sequence[str], log: str | os.PathLike[str] | None = None
    ) -> int:
        """Train the run of ``config`` with ``overrides`` (``section.key=value``); returns the exit status
        ``ddp-rank train`` would (0, ``EXIT_USAGE``, ``EXIT_FAILED``, or ``EXIT_REQUEUE`` when stopped on a
        signal). ``log``: a file that takes the run's console output (appended), as a process's redirected
        output would."""
        with _output_to(log):
            self.start.restore()
            try:
                cfg = load_config(config, list(overrides))
                summary = run_training(cfg)
                print(f"done: {summary['steps']} steps, outputs in {cfg.train.output_dir}", flush=True)
            except RunStopped:
                return EXIT_REQUEUE
            except (ConfigError, *AGREED_ERRORS) as exc:
                report_agreed_error("ddp-rank train", exc)
                return EXIT_USAGE
            except Exception:
                traceback.print_exc()
                return EXIT_FAILED
            finally:
                self.start.restore()
        return 0


def train_in_worker(config: str | None, overrides: Sequence[str], log: str | None = None) -> int:
    """:meth:`RunsInProcess.train` in a pool's worker process (made on its first run: the worker is fresh)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = RunsInProcess()
    return _WORKER.train(config, overrides, log)


def worker_pool(
    workers: int,
    threads: int | None = None,
    python: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> ProcessPoolExecutor:
    """``workers`` fresh worker processes (the ``spawn`` start: no state copied from this one) for
    :func:`train_in_worker`, each with ``threads`` torch threads (None: torch's default), run by ``python``
    (None: this interpreter) in the folder ``cwd`` (None: this one)."""
    context = multiprocessing.get_context("spawn")
    if python:
        context.set_executable(python)
    where = None if cwd is None else str(cwd)
    return ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(threads, where)
    )


def _start_worker(threads: int | None, cwd: str | None) -> None:
    """A worker's folder and torch threads, set before its first run (so every run starts with them)."""
    if cwd is not None:
        os.chdir(cwd)
    if threads:
        import torch

        torch.set_num_threads(threads)


@contextlib.contextmanager
def _output_to(log: str | os.PathLike[str] | None) -> Iterator[None]:
    """Standard output and error (the file descriptors: torch's and the loader's own writes too) appended to
    ``log`` for the duration; nothing changes without one."""
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with Path(log).open("ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
