"""Shared test set-up: tests marked ``cuda`` are skipped with the reason where no CUDA GPU is visible.

Under pytest-xdist (``make test``: ``-n 2 --dist loadfile``) each worker gets its share of the cores as torch
threads (two workers of two threads each on a 2-core machine would fight over the cores), and the files that
start several processes are handed out first, so that the long ones do not end the run on one worker while the
other sits idle.

The helpers are the package ``tests.helpers`` (the repository root is on ``sys.path`` through pytest's rootdir
and ``pythonpath`` setting), never a folder put on ``sys.path`` by hand. The fixture ``quick_retries`` runs the
shard store's retry pauses at a tenth of their length, for the tests of retries and outages."""

import logging
import os
from collections.abc import Iterator

import pytest

from tests.helpers.quick_clock import QuickClock


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    import torch

    threads = max(1, _cores() // int(workers))
    torch.set_num_threads(threads)
    # The processes the tests start (single-process CLI runs; launchers set their ranks' own) inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _multi_process_files_first(items: list[pytest.Item]) -> None:
    """Stable order: the files holding ``slow`` tests, then those holding ``distributed`` ones, then the rest."""

    def weight(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("distributed") else 2

    def file(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    first: dict[str, int] = {}
    for item in items:
        first[file(item)] = min(first.get(file(item), 2), weight(item))
    items.sort(key=lambda item: first[file(item)])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    _multi_process_files_first(items)
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


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> QuickClock:
    """The shard store's retries at a tenth of their pauses: a test of a retry proves it, not the wait."""
    from ddp_rank.data.reading import storage

    clock = QuickClock(scale=0.1)
    monkeypatch.setattr(storage, "time", clock)
    return clock
