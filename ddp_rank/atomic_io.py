"""Crash-safe writes: a reader, or a run resumed after a kill, sees the old content or the new, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where Linux exposes it (``os.umask`` sets it as it reads,
    which races with threads creating files)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:  # pragma: no cover - not Linux
        pass
    mask = os.umask(0o022)  # pragma: no cover
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a part: temporary file
    in the same directory, flush + fsync, ``os.replace``, fsync of the directory.

    The file gets the mode a plain ``open(path, "w")`` would give it (0666 minus the umask): ``mkstemp`` makes
    its temporary file owner-only, and the rename would otherwise keep that, so colleagues sharing a cluster
    could not read a run's config or summary.
    """
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`atomic_write_text` for bytes (an ``.npz`` made in memory, for one)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(p.parent)


def follow_umask(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open(path, "w")`` gives (0666 minus the umask).

    Why: some writers make their files owner-only whatever the umask (safetensors' ``save_file`` writes 0600),
    and a run directory shared on a cluster must read the same for every file in it."""
    mode = 0o666 & ~current_umask()
    for dirpath, _, files in os.walk(root):
        for name in files:
            os.chmod(os.path.join(dirpath, name), mode)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside ``path`` durable (best effort where directories have no fd)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and every directory, so the data is on disk before the rename."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(dirpath))
