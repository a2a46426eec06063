"""Shared test set-up: tests marked ``cuda`` are skipped with the reason where no CUDA GPU is visible.

The helpers are the package ``tests.helpers`` (the repository root is on ``sys.path`` through pytest's rootdir
and ``pythonpath`` setting), never a folder put on ``sys.path`` by hand."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible: torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
