"""A shard folder over HTTP for tests, with the handler of ``ddp-rank shards serve`` or a faulty one that records
the faults it served (``serve_directory`` takes neither)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from ddp_rank.data.reading.serve import STOP_POLL_S, RangeRequestHandler

POLL_S = STOP_POLL_S
"""As ``serve_directory``: a stop is seen within 10 ms."""


@contextmanager
def serve_quickly(
    directory: str | Path,
    handler: type[RangeRequestHandler] = RangeRequestHandler,
    faults: list[str] | None = None,
) -> Iterator[str]:
    """``directory`` over HTTP on a free port of 127.0.0.1 with the handler of ``ddp-rank shards serve`` (or a
    faulty one, whose ``faults`` list must not end empty: the test met its fault); yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(directory)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_S}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
    assert faults is None or faults, "the fault was never met"
