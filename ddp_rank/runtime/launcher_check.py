"""Checks a job script runs before it starts the launchers: ``python -m ddp_rank.runtime.launcher_check``.

torchrun (which ``accelerate launch`` runs) forwards a stop signal to the ranks and kills them a fixed time later.
That time was 30 s, whatever the scheduler allows, until torch gave it a setting (``LaunchConfig.shutdown_timeout``,
read from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or ``--shutdown-timeout``). A stop's checkpoint of a large model can
take longer than 30 s, so a job script that counts on the setting must refuse a torch that ignores it rather than
lose the checkpoint silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

__all__ = ["shutdown_timeout_problem"]


def shutdown_timeout_problem(launch_config: Any = None, version: str | None = None) -> str | None:
    """Why this torch's launcher would not honour ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, or None when it does.

    ``launch_config`` and ``version`` default to the installed torch's ``LaunchConfig`` and version (the tests
    pass stand-ins)."""
    if launch_config is None:
        import torch
        from torch.distributed.launcher.api import LaunchConfig

        launch_config, version = LaunchConfig, torch.__version__
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(launch_config)}:
        return None
    return (
        f"torch {version}'s launcher has no shutdown timeout setting: it kills the ranks 30 s after a stop signal "
        "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT is ignored), which can cut the stop's checkpoint. Install a torch whose "
        "torch.distributed.launcher.api.LaunchConfig has shutdown_timeout, or set ALLOW_SHORT_SHUTDOWN=1 to "
        "accept the 30 s"
    )


def build_parser() -> argparse.ArgumentParser:
    """The check takes no options; its parser gives it ``--help`` (and the command-line reference its entry)."""
    return argparse.ArgumentParser(
        prog="python -m ddp_rank.runtime.launcher_check",
        description="Exit 1 with the reason when this torch's launcher would ignore "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT (it would kill the ranks 30 s after a stop signal, which can cut the "
        "stop's checkpoint); exit 0 when it honours it. A job script runs it before it starts the launchers.",
    )


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    problem = shutdown_timeout_problem()
    if problem is not None:
        print(f"launcher check: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
