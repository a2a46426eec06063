"""How a multi-process run ends when something fails: promptly, with the failing rank's message printed once.

Two kinds of failure, two rules:

- **Agreed errors** (``ConfigError``, ``ModelError``, ``CheckpointError``, ``TrainError``) are raised on every rank
  alike: they come from the config and the shards every rank reads, or from an agreement point (the data
  layer's per-step flag, the global loss's status and failure flags, the global loss value). Every rank unwinds
  normally; rank 0 prints the message as one line (``report_agreed_error``).
- **Any other exception** (out of memory, a bug, a broken file on one node) is this rank's alone; the others are
  already waiting in the next collective, where they would stay until the process-group timeout (30 minutes by
  default). The failing rank prints its message and traceback and ends its process at once
  (``end_process_after_failure``), without the teardown that could itself wait on the other ranks. The launcher
  (``accelerate launch`` / torchrun, which watch their workers every 0.1 s) then stops the other ranks and exits
  with the failure; under SLURM, ``srun --kill-on-bad-exit=1`` (launch/slurm_multinode.sbatch) ends the other
  nodes.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

__all__ = [
    "EXIT_FAILURE",
    "end_process_after_failure",
    "end_process_now",
    "launch_rank",
    "launch_world_size",
    "report_agreed_error",
]

EXIT_FAILURE = 1

GRACE_S = 5.0
"""How long a rank other than 0 waits before printing an agreed error itself: if rank 0 failed alike it has
printed it and the launcher stops this rank within that time; if not, the error was this rank's alone after all
(a file only its node lacks) and must not be lost."""


def launch_rank() -> int:
    """This process's global rank as the launcher exported it (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """The number of processes the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def report_agreed_error(prog: str, error: BaseException) -> None:
    """Print an error that every rank raises alike, once: by rank 0 (see ``GRACE_S`` for the other ranks)."""
    rank = launch_rank()
    if rank != 0:
        time.sleep(GRACE_S)
    where = f" (rank {rank})" if rank != 0 else ""
    message = " ".join(str(error).split("\n"))
    print(f"{prog}: error{where}: {message}", file=sys.stderr, flush=True)


def end_process_after_failure(prog: str, error: BaseException, step: int | None = None) -> None:
    """Print this rank's failure and end the process now (exit status 1); never returns.

    ``os._exit`` skips the interpreter's teardown on purpose: destroying a process group or joining DataLoader
    workers may wait on ranks that are blocked in a collective. Files are safe: checkpoints are written to a
    temporary directory and renamed, and a partial one is removed at the next start.
    """
    rank = launch_rank()
    at = f" at step {step}" if step is not None else ""
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    sys.stderr.write(
        f"{trace}{prog}: error on rank {rank}{at}: {type(error).__name__}: {error}\n"
        f"{prog}: ending this process so that the launcher stops the other ranks\n"
    )
    end_process_now(EXIT_FAILURE)


def end_process_now(status: int) -> None:
    """Flush the console and end the process with ``status`` at once, skipping the interpreter's teardown (see
    :func:`end_process_after_failure` for why); never returns."""
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(status)
