"""``run.json``: where a run stands, for the tools that read run directories (``ddp-rank compare``, ``sweep``).

Rank 0 writes it atomically at each start once the trainer's checks passed and its checkpoint (if any) is loaded
(``running``, with its host, pid and start time, and the steps of the record it continues), and at the end of
that start: ``finished``, ``stopped`` (a signal: resumable, ``ddp_rank.train.preemption``) or ``crashed`` (with
the error). A process killed outright (SIGKILL, the node lost) leaves ``running``; a reader on the same host
tells that apart by the pid (:func:`is_alive`). ``seconds`` adds up the wall time of every start, so a run
resumed twice reports the time it really took.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ddp_rank.atomic_io import atomic_write_text

__all__ = ["RUN_FILE", "RunState", "is_alive", "read_run_state"]

RUN_FILE = "run.json"
STATUSES = ("running", "finished", "stopped", "crashed")


def read_run_state(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The content of ``run_dir/run.json``, or None when there is none (or it cannot be read)."""
    try:
        state = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and state.get("status") in STATUSES else None


def is_alive(state: dict[str, Any]) -> bool | None:
    """Whether the process of a ``running`` state still runs: True / False on the host that wrote it, None
    (cannot tell) elsewhere."""
    if state.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(state["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return None
    return True


class RunState:
    """The writer of one start's ``run.json`` (rank 0 only: build it with ``enabled=False`` elsewhere)."""

    def __init__(self, run_dir: str | os.PathLike[str], enabled: bool = True) -> None:
        self.path = Path(run_dir) / RUN_FILE
        self.enabled = enabled
        earlier = read_run_state(run_dir) if enabled else None
        self._earlier_s = float(earlier.get("seconds", 0.0)) if earlier else 0.0
        self._starts = int(earlier.get("starts", 0)) if earlier else 0
        self._earlier_steps = earlier.get("steps") if earlier else None
        self._t0 = time.monotonic()
        self._started = False
        self._facts: dict[str, Any] = {}  # this start's process, kept in every state it writes

    def start(self) -> None:
        self._started = True
        self._facts = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        # The steps the earlier starts reached stay in the record while this one runs (a kill leaves them).
        self._write("running", **({"steps": self._earlier_steps} if self._earlier_steps is not None else {}))

    def finished(self, steps: int) -> None:
        self._write("finished", steps=steps, ended=_now())

    def stopped(self, step: int) -> None:
        self._write("stopped", steps=step, ended=_now())

    def crashed(self, error: BaseException, step: int | None) -> None:
        """Record the failure of a start that began (:meth:`start`); one that never began writes nothing."""
        if not self._started:
            return
        message = f"{type(error).__name__}: {error}".strip()
        self._write("crashed", error=message[:2000], steps=step, ended=_now())

    def _write(self, status: str, **facts: Any) -> None:
        if not self.enabled:
            return
        if status == "running":
            self._starts += 1
        state = {
            "status": status,
            "starts": self._starts,
            "seconds": round(self._earlier_s + time.monotonic() - self._t0, 3),
            **self._facts,
            **facts,
        }
        atomic_write_text(self.path, json.dumps(state, indent=1) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
