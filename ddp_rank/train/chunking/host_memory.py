"""How much memory this process may still take on its node: the node's ``MemAvailable``, or what its memory cgroup
still allows where that is less (a SLURM ``--mem`` job, a container: going past that limit kills the process even
when the node has memory to spare). Read from ``/proc`` and the cgroup file system, v1 and v2; the paths are
parameters for the tests. ``ddp_rank.train.chunking.choice`` sizes the CPU chunk from it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

__all__ = ["available_memory"]

MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (9223372036854771712).
CGROUP_V1_NO_LIMIT = 2**62


def available_memory(
    meminfo: Path = MEMINFO, proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = PROC_MOUNTINFO
) -> tuple[int, str]:
    """(bytes this process may still take, where the figure comes from): the node's ``MemAvailable``, or what the
    process's memory cgroup still allows where that is less (a SLURM ``--mem`` job, a container's limit: going
    past it kills the run even when the node has memory to spare); all physical memory where neither can be read.
    The paths are parameters for the tests."""
    node = _mem_available(meminfo)
    cgroup = _cgroup_headroom(proc_cgroup, mountinfo)
    if cgroup is not None and (node is None or cgroup < node):
        return cgroup, "the cgroup's memory limit less its usage"
    if node is not None:
        return node, "MemAvailable"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def _cgroup_headroom(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = PROC_MOUNTINFO) -> int | None:
    """The least (limit - usage) over the process's memory cgroup and its ancestors (a SLURM job's limit sits on
    the job's cgroup, above the step's), None where no limit is set or readable. cgroup v2: ``memory.max`` -
    ``memory.current``; v1: ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``. Usage counts the page cache;
    its inactive part (``memory.stat``), which the kernel reclaims before failing an allocation, is left out."""
    try:
        memberships = proc_cgroup.read_text().splitlines()
        mounts = mountinfo.read_text().splitlines()
    except OSError:
        return None
    headrooms = [
        headroom
        for directory, v2 in _cgroup_dirs(memberships, mounts)
        if (headroom := _headroom(directory, v2)) is not None
    ]
    return max(min(headrooms), 0) if headrooms else None


def _cgroup_dirs(memberships: list[str], mounts: list[str]) -> Iterator[tuple[Path, bool]]:
    """(directory, is v2) of the process's memory cgroup and each ancestor up to its mount, from the lines of
    ``/proc/self/cgroup`` (``id:controllers:path``) and ``/proc/self/mountinfo`` (mount root in field 4, mount
    point in field 5, file system type and options after the ``-``)."""
    paths: dict[bool, str] = {}
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            paths[True] = path
        elif "memory" in controllers.split(","):
            paths[False] = path
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 6 or len(fields) < dash + 4:
            continue
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        v2 = fstype == "cgroup2"
        if not (v2 or (fstype == "cgroup" and "memory" in options)) or v2 not in paths:
            continue
        root, mount_point = PurePosixPath(fields[3]), Path(fields[4])
        cgroup = PurePosixPath(paths[v2])
        # Inside a container without its own cgroup namespace the mount's root is the container's cgroup.
        relative = cgroup.relative_to(root) if cgroup.is_relative_to(root) else PurePosixPath()
        parts = relative.parts
        for depth in range(len(parts), -1, -1):
            yield mount_point.joinpath(*parts[:depth]), v2


def _headroom(directory: Path, v2: bool) -> int | None:
    limit_file, usage_file, inactive_key = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max":  # v2: no limit
            return None
        limit, usage = int(limit_text), int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    if limit >= CGROUP_V1_NO_LIMIT:
        return None
    inactive = 0
    with contextlib.suppress(OSError, ValueError):
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    return limit - max(usage - inactive, 0)


def _mem_available(meminfo: Path) -> int | None:
    try:
        with meminfo.open() as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
