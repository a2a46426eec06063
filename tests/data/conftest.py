"""Fixtures of the data tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """The files this process opens while the test runs (an audit hook; hooks cannot be removed, so it
    records only while the list is live)."""
    seen: list[str] = []
    live = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if live[0] and event == "open" and isinstance(args[0], str | bytes | Path):
            seen.append(str(args[0]))

    sys.addaudithook(hook)
    yield seen
    live[0] = False
