"""A clock that makes waits short and counts them whole: the ``quick_retries`` fixture (tests/conftest.py) puts it
in place of the ``time`` module of the shard store's retry loop."""

from __future__ import annotations

import threading
import time


class QuickClock:
    """``sleep`` really lasts ``scale`` of the time asked and ``monotonic`` counts it whole, so a loop's deadlines
    and growing pauses keep their schedule, 1 / ``scale`` times faster. ``pauses`` lists the sleeps asked for,
    at their full length."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.pauses: list[float] = []
        self._skipped = 0.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return time.monotonic() + self._skipped

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds * self.scale)
        with self._lock:
            self.pauses.append(seconds)
            self._skipped += seconds * (1 - self.scale)
