"""``ddp-rank shards serve DIR``: a shard directory over HTTP with Range requests, as object stores serve it.

For trying ``data.shards=http://...`` on one machine, serving shards to a few nodes from a file server that has
no object store, and for the tests and benchmarks of the URL path. It serves static files only, with single
``Range: bytes=a-b`` requests answered 206; it binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import http.server
import io
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """``SimpleHTTPRequestHandler`` plus single byte ranges (``Range: bytes=a-b`` -> 206 Partial Content)."""

    quiet = True

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    def send_head(self) -> Any:
        match = _RANGE.fullmatch(self.headers.get("Range", ""))
        if match is None:
            return super().send_head()
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404, "File not found")
            return None
        size = path.stat().st_size
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if start > end:
            self.send_error(416, "Requested range not satisfiable")
            return None
        with path.open("rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return io.BytesIO(body)


def checked_directory(directory: str | Path) -> str:
    """``directory`` if it is an existing folder; else a one-line :class:`NotADirectoryError` (a server of a
    folder that does not exist answers 404 to every request, which looks like a network fault)."""
    path = Path(directory)
    if not path.is_dir():
        problem = "does not exist" if not path.exists() else "is a file, not a folder"
        raise NotADirectoryError(f"'{directory}' {problem}: pass the folder that holds the shards")
    return str(path)


STOP_POLL_S = 0.01
"""How often a background server (``serve_directory``) checks whether it was asked to stop."""


@contextmanager
def serve_directory(directory: str | Path, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``directory`` in a background thread; yields its base URL (port 0: a free one).

    The thread checks for its stop every 10 ms (``serve_forever``'s default is half a second, which every
    ``with`` block would wait on leaving)."""
    handler = partial(RangeRequestHandler, directory=checked_directory(directory))
    server = http.server.ThreadingHTTPServer((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": STOP_POLL_S}, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def serve_forever(directory: str | Path, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Serve ``directory`` until interrupted, logging each request; ``on_ready`` gets the base URL once the
    socket listens (port 0: a free one)."""
    handler = partial(RangeRequestHandler, directory=checked_directory(directory))
    RangeRequestHandler.quiet = False
    with http.server.ThreadingHTTPServer((host, port), handler) as server:
        on_ready(f"http://{host}:{server.server_address[1]}")
        server.serve_forever()
