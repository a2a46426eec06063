"""Stopping a run on a signal without losing work: a cluster's preemption, a time limit's warning, ``scancel``.

A scheduler that wants a job gone sends a signal (SLURM: SIGTERM, or the one asked for with ``--signal``, e.g.
``USR1@300`` five minutes before the time limit) and, some seconds later, SIGKILL. :class:`StopRequest` turns
the signal into a flag; the trainer's per-step agreement (``ddp_rank.distributed.agreement.agree``) carries the
flag from whichever rank received it to every rank, so all ranks finish that same step, write one checkpoint and
exit with :data:`EXIT_REQUEUE`. Nothing since the last periodic checkpoint is lost, and ``train.resume=auto``
continues at exactly the next step.

Why a flag and not work in the handler: the handler may run while the process is inside a collective or writing
a checkpoint; only the loop knows a point where every rank can stop alike. The ranks agree on the flag when a
step fetches its batch, so a signal just after a fetch costs the rest of that step (with its scheduled evaluation
and checkpoint), then one more step (likewise), then the stop's checkpoint: the worst case to fit in the time
between the signal and the SIGKILL.

Under SLURM, rank 0 then requeues the job (``scontrol requeue``, :func:`requeue_slurm_job`) as the very last thing
the run does, once every rank's files are written: a requeue makes SLURM signal every process of the job at once.
A launcher between the scheduler and the ranks (torchrun, ``accelerate launch``) turns a rank's status 75 into a
failure status of its own; only the requeue carries through it. The ranks' DataLoader workers ignore the stop
signals (``ddp_rank.data.reading.loader.ignore_stop_signals``): a scheduler or launcher signals them too.

A second signal ends the process at once, and so does ``stop_grace_s`` running out. Neither can leave a
half-written checkpoint: checkpoints are written to a temporary folder and renamed into place
(``train.checkpoints.write``), so the previous ones stay and the next start removes the partial one. A
signal repeated within ``debounce_s`` of the first is the same request (a launcher such as torchrun forwards
the scheduler's SIGTERM to ranks that already received it), not a second one.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

__all__ = ["EXIT_REQUEUE", "RunStopped", "StopRequest", "ignore_signals", "requeue_slurm_job"]

log = logging.getLogger(__name__)

EXIT_REQUEUE = 75
"""The exit status of a run stopped by a signal after its checkpoint: EX_TEMPFAIL of sysexits.h (a temporary
failure; run the same command again)."""


class RunStopped(Exception):
    """Every rank stopped after ``step`` on a signal, with a checkpoint of that step."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped on a signal after step {step}; checkpoint {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint


def _exit_now(status: int) -> None:
    os._exit(status)


class StopRequest:
    """Handlers for ``signals`` that record a stop request (``requested``) instead of ending the process.

    ``exit_fn`` ends the process (a test replaces it); it is called on a second signal and when ``grace_s``
    (> 0) seconds pass after the first without :meth:`done`.
    """

    def __init__(
        self,
        signals: Sequence[str],
        grace_s: float = 0.0,
        debounce_s: float = 5.0,
        exit_fn: Callable[[int], None] = _exit_now,
    ) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.grace_s = grace_s
        self.debounce_s = debounce_s
        self.exit_fn = exit_fn
        self.received: signal.Signals | None = None
        self._first_at = 0.0
        self._timer: threading.Timer | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def install(self) -> StopRequest:
        """Take over the signals (main thread only; elsewhere, e.g. a notebook's worker thread, nothing is
        installed and the signals keep their default action). Installing twice is installing once."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self  # elsewhere than the main thread, or installed already
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back their earlier handlers and cancel the grace timer."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.done()

    def done(self) -> None:
        """The stop finished in time (the checkpoint is written): no grace-period exit."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = sig, now
            limit = f"; exiting anyway in {self.grace_s:g} s" if self.grace_s > 0 else ""
            log.warning(
                f"received {sig.name}: every rank stops after this step with a checkpoint{limit} "
                "(a second signal exits at once)"
            )
            if self.grace_s > 0:
                self._timer = threading.Timer(self.grace_s, self._expire)
                self._timer.daemon = True
                self._timer.start()
        elif now - self._first_at > self.debounce_s:
            self._say(f"received {sig.name} again: exiting now; the last complete checkpoint is kept")
            self.exit_fn(EXIT_REQUEUE)

    def _expire(self) -> None:
        self._say(
            f"train.stop_grace_s={self.grace_s:g} passed without a checkpoint: exiting now; the last complete "
            "checkpoint is kept"
        )
        self.exit_fn(EXIT_REQUEUE)

    @staticmethod
    def _say(message: str) -> None:
        # Straight to the file descriptor: the logging lock may be held by the code this interrupts.
        os.write(sys.stderr.fileno(), f"ddp-rank train: {message}\n".encode())


def ignore_signals(signals: Sequence[str]) -> None:
    """This process ignores ``signals`` from now on (main thread only, as :meth:`StopRequest.install`)."""
    if threading.current_thread() is threading.main_thread():
        for name in signals:
            signal.signal(signal.Signals[name], signal.SIG_IGN)


def requeue_slurm_job(ignore: Sequence[str] = ()) -> bool:
    """Under SLURM, ask the scheduler to queue this job again (``scontrol requeue``); False elsewhere or if it
    refuses (the job was not submitted with ``--requeue``, say: the log says so).

    A requeue makes SLURM signal every process of the job, this one included: the signals ``ignore`` are ignored
    from just before the request on, so that a process with nothing left to do but end is not killed by them.
    """
    job = os.environ.get("SLURM_JOB_ID")
    scontrol = shutil.which("scontrol")
    if not job or scontrol is None:
        return False
    ignore_signals(ignore)
    done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        log.warning(f"scontrol requeue {job} failed: {done.stderr.strip() or done.stdout.strip()}")
        return False
    log.info(f"requeued SLURM job {job}: it continues from the checkpoint when it runs again")
    return True
