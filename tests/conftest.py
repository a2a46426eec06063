"""Shared test set-up: tests marked ``cuda`` are skipped with the reason where no CUDA GPU is visible.

The helpers are the package ``tests.helpers`` (the repository root is on ``sys.path`` through pytest's rootdir
and ``pythonpath`` setting), never a folder put on ``sys.path`` by hand."""

import logging
from collections.abc import Iterator

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible: torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ddp_rank_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The records of the ``ddp_rank`` loggers (data faults, run events): once a run has configured them
    (``ddp_rank.logs``) they no longer propagate to the root logger that ``caplog`` listens on."""
    logger = logging.getLogger("ddp_rank")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def fresh_accelerator_state() -> Iterator[None]:
    """accelerate's state is a per-process singleton that earlier tests set up with their precision: start from
    a fresh one (to run under another launcher's settings) and leave a fresh one behind."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
