"""The run's log: one line per event, stamped, rank-aware, to the console and to the run directory.

Every module logs through ``logging.getLogger(__name__)`` (so under ``ddp_rank``); :func:`configure_run_logging`
gives that logger its handlers once a process knows its rank:

- the console: events (INFO) on stdout, problems (WARNING and above: a class replaced from the reserve, a
  category left out, a note the user must read) on stderr. Rank 0 shows everything; the other ranks show only
  their problems, tagged with their rank, so a fault on rank 5 is seen without every rank repeating each event;
- the run directory: rank 0 appends every event and problem to ``<output_dir>/train.log`` with its level and
  source, for after the job (a SLURM log may be gone, or interleaved with other ranks).

Data faults are log records, not ``warnings``: they are events of a run that the user cannot avoid by changing
code (``warnings.warn`` stays for misuse of the library's API, such as ``kernel='triton'`` without Triton). The
command-line front ends keep their own output (tables, paths) on stdout with ``print``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["configure_run_logging"]

_ROOT = "ddp_rank"
_STAMP = "%Y-%m-%d %H:%M:%S"
_OURS = "_ddp_rank_run_handler"  # marks the handlers configure_run_logging installed


class _RunFormatter(logging.Formatter):
    """``2026-11-24 19:30:01 message``, ``[rank 3]`` after the stamp on ranks other than 0, continuation lines
    (an evaluation's table) indented under the first."""

    def __init__(self, rank: int, detailed: bool = False) -> None:
        super().__init__(datefmt=_STAMP)
        self.rank = rank
        self.detailed = detailed

    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, self.datefmt)
        if self.detailed:
            stamp = f"{stamp} rank {self.rank} {record.levelname} {record.name}:"
        elif self.rank:
            stamp = f"{stamp} [rank {self.rank}]"
        lines = record.getMessage().splitlines() or [""]
        if record.exc_info:
            lines += self.formatException(record.exc_info).splitlines()
        pad = " " * len(stamp)
        return "\n".join(f"{stamp} {line}" if i == 0 else f"{pad} {line}" for i, line in enumerate(lines))


class _ConsoleHandler(logging.Handler):
    """INFO records to stdout, WARNING and above to stderr. The streams are looked up when a record is written
    (not when the handler is made), so a test's or a launcher's redirection of ``sys.stdout`` is followed."""

    def emit(self, record: logging.LogRecord) -> None:
        stream: TextIO = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def configure_run_logging(rank: int, run_dir: str | Path | None = None) -> None:
    """Give the ``ddp_rank`` logger this process's handlers (replacing the ones an earlier call installed: a
    second run in the same process, a test). ``run_dir``: where rank 0 appends ``train.log`` (None: the console
    only)."""
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        if getattr(handler, _OURS, False):  # other handlers (an application's, a test's capture) stay
            logger.removeHandler(handler)
            handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    console = _ConsoleHandler(level=logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(_RunFormatter(rank))
    setattr(console, _OURS, True)
    logger.addHandler(console)
    if run_dir is not None and rank == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(Path(run_dir) / "train.log", encoding="utf-8")
        file.setFormatter(_RunFormatter(rank, detailed=True))
        setattr(file, _OURS, True)
        logger.addHandler(file)
