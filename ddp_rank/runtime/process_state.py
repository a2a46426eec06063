"""What one run leaves behind in its process, and putting it back, so that runs can follow each other in one
Python process (paying the imports and the set-up once) with the numbers each would give in a fresh process.

A run changes process-wide state that a fresh process would not have:

- accelerate's singletons (``PartialState``, ``AcceleratorState``, ``GradientState``): the next ``Accelerator``
  would take the last run's device and precision instead of its own;
- the random generators (torch's, CUDA's, numpy's and Python's global ones): a fresh process starts torch at its
  fixed default seed, and the next run's first draws (the network's initial weights before ``train.seed`` is
  applied, a probe's inputs) must not depend on how many numbers the last run drew;
- torch's global switches: deterministic algorithms (``train.deterministic``), the fill of fresh memory, cuDNN's
  autotuner and determinism, TF32 and the float32 matmul precision, the thread count, the default dtype, grad
  mode;
- the environment (``CUBLAS_WORKSPACE_CONFIG``; accelerate exports its settings there);
- the GPU's cached memory and peak counters (the automatic chunk size is chosen from the free memory);
- the ``ddp_rank`` logger's handlers (the last run's ``train.log`` stays open and would receive the next run's
  lines), the signal handlers (the stop request's), the warning filters, the notes said once per process
  (they belong in each run's log).

:class:`ProcessState` records all of it once, in the state a run should start from, and puts it back before
each run and after the last. Only one-process runs can share a process this way: a job launched on several
processes keeps one process per rank, as ``accelerate launch`` makes them.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

__all__ = ["ProcessState"]

_LOGGER = "ddp_rank"
# The signals a run may take over (train.stop_signals names among these), and the ones Python itself sets.
_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT", "SIGALRM", "SIGXCPU")
    if hasattr(signal, name)
)


def _torch_switches() -> dict[str, Any]:
    cudnn = torch.backends.cudnn
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill": torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        "cudnn_benchmark": cudnn.benchmark,
        "cudnn_deterministic": cudnn.deterministic,
        "cudnn_tf32": cudnn.allow_tf32,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "matmul_precision": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
    }


def _set_torch_switches(s: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(s["deterministic"], warn_only=s["warn_only"])
    torch.utils.deterministic.fill_uninitialized_memory = s["fill"]  # type: ignore[attr-defined]
    cudnn = torch.backends.cudnn
    cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = (
        s["cudnn_benchmark"],
        s["cudnn_deterministic"],
        s["cudnn_tf32"],
    )
    torch.backends.cuda.matmul.allow_tf32 = s["matmul_tf32"]
    torch.set_float32_matmul_precision(s["matmul_precision"])
    if torch.get_num_threads() != s["threads"]:
        torch.set_num_threads(s["threads"])
    torch.set_default_dtype(s["dtype"])
    torch.set_grad_enabled(s["grad"])
    torch.autograd.set_detect_anomaly(s["anomaly"])


def _reset_accelerate() -> None:
    """accelerate's singletons cleared, as in a process that has made no ``Accelerator`` (imported only when
    accelerate already is: a process that never imported it has no state to clear)."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(True)
        state.GradientState._reset_state()


def _forget_said_once() -> None:
    """The notes said once per process (the loss's ``kernel=auto`` path) said again by the next run, in its log."""
    base = sys.modules.get("ddp_rank.losses.base")
    if base is not None:
        base._log_auto_kernel.cache_clear()


def _free_device_memory() -> None:
    """The last run's tensors collected and the GPU's cached blocks given back, its peak counters reset: the
    automatic chunk size is chosen from the free memory, and the run report gives the peak."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        for device in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(device)


@dataclass
class ProcessState:
    """The process-wide state a run starts from, recorded by :meth:`record` (in a fresh process, before any run)
    and put back by :meth:`restore` (before each run and after the last)."""

    torch_seed: int
    torch_cpu_rng: torch.Tensor
    numpy_rng: Any
    python_rng: Any
    switches: dict[str, Any]
    environ: dict[str, str]
    signals: dict[int, Any]
    log_handlers: list[logging.Handler]
    log_level: int
    log_propagate: bool
    warning_filters: list[Any] = field(default_factory=list)

    @classmethod
    def record(cls) -> ProcessState:
        logger = logging.getLogger(_LOGGER)
        return cls(
            # A fresh process's generators (CPU and every CUDA device) start at this seed; seeding them with it
            # again gives the same state, also on a device not yet started.
            torch_seed=torch.initial_seed(),
            torch_cpu_rng=torch.get_rng_state(),  # the CPU generator where it stands, drawn from or not
            numpy_rng=np.random.get_state(),  # noqa: NPY002 - the global generator is what leaks
            python_rng=random.getstate(),
            switches=_torch_switches(),
            environ=dict(os.environ),
            signals={sig: signal.getsignal(sig) for sig in _SIGNALS},
            log_handlers=list(logger.handlers),
            log_level=logger.level,
            log_propagate=logger.propagate,
            warning_filters=list(warnings.filters),
        )

    def restore(self) -> None:
        """Put the recorded state back (the main thread only: signal handlers can be set there alone)."""
        _reset_accelerate()
        _free_device_memory()
        _forget_said_once()
        torch.manual_seed(self.torch_seed)
        torch.set_rng_state(self.torch_cpu_rng)
        np.random.set_state(self.numpy_rng)  # noqa: NPY002
        random.setstate(self.python_rng)
        _set_torch_switches(self.switches)
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        os.environ.update(self.environ)
        for sig, handler in self.signals.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        logger = logging.getLogger(_LOGGER)
        for handler in [h for h in logger.handlers if h not in self.log_handlers]:
            logger.removeHandler(handler)
            handler.close()  # the last run's train.log
        for handler in self.log_handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.setLevel(self.log_level)
        logger.propagate = self.log_propagate
        # In place: the C part of warnings holds this very list.
        cast(list[Any], warnings.filters)[:] = self.warning_filters
        getattr(warnings, "_filters_mutated", lambda: None)()  # what catch_warnings calls: the caches follow
