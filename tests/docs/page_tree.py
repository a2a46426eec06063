"""The folder a page's blocks run in: a copy of the repository's files as a fresh clone holds them, and the check
that a page wrote only under ignored folders (docs/code-blocks.md).

Why the whole tree: a reader runs a tutorial from the root of a clone, where `shards/`, `docs/` and every other
tracked folder already exist; a page that writes into one of them fails for the reader (or dirties the clone),
and only a copy of the whole tree shows it. Why a check of what the page wrote: a page that writes outside the
ignored folders (`runs/`) leaves untracked files in the reader's clone, or overwrites the clone's own.

The list of files comes from git when the repository is a git checkout (`git ls-files --cached --others
--exclude-standard`: what a commit of the working tree holds); an export without `.git` walks the tree and leaves
out what the root `.gitignore` ignores, which gives the same set. The list and the files' sizes and times are
read once per process; each page copies the files (a plain copy, not hard links: a page that appends to a copied
file must not change the repository's, nor the next page's).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# Never copied, never reported: git's own folder.
_ALWAYS_LEFT_OUT = frozenset({".git"})
# How many stray paths a failure names.
_SHOWN = 8


@dataclass(frozen=True)
class IgnoreRule:
    """One line of a ``.gitignore``, in the subset this repository's file uses: ``name``, ``*.glob``, a trailing
    ``/`` (folders only), a leading ``/`` or an inner ``/`` (anchored at the root)."""

    pattern: str
    anchored: bool
    folders_only: bool

    def matches(self, path: PurePosixPath, is_dir: bool) -> bool:
        if self.folders_only and not is_dir:
            return False
        if self.anchored:
            return fnmatch.fnmatchcase(path.as_posix(), self.pattern)
        return fnmatch.fnmatchcase(path.name, self.pattern)


def read_ignore_rules(text: str, source: str = ".gitignore") -> tuple[IgnoreRule, ...]:
    """The rules of a ``.gitignore``; a feature outside the subset (``!``, ``**``, a ``\\`` escape) is refused in
    one line, since matching it wrongly would copy the wrong tree."""
    rules = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!") or "**" in line or "\\" in line:
            raise ValueError(
                f"{source}:{number}: {line!r} uses a .gitignore feature the docs runner does not read (!, **, \\); "
                f"write it as plain names and globs, or run the tests from a git checkout"
            )
        folders_only = line.endswith("/")
        body = line.rstrip("/")
        anchored = "/" in body
        rules.append(IgnoreRule(body.lstrip("/"), anchored, folders_only))
    return tuple(rules)


def is_ignored(path: PurePosixPath, is_dir: bool, rules: tuple[IgnoreRule, ...]) -> bool:
    """Whether ``path`` (relative to the root) or a folder above it is ignored by ``rules``."""
    if path.parts and path.parts[0] in _ALWAYS_LEFT_OUT:
        return True
    parents = [PurePosixPath(*path.parts[:n]) for n in range(1, len(path.parts))]
    if any(rule.matches(parent, True) for parent in parents for rule in rules):
        return True
    return any(rule.matches(path, is_dir) for rule in rules)


def _root_rules(root: Path) -> tuple[IgnoreRule, ...]:
    ignore = root / ".gitignore"
    return read_ignore_rules(ignore.read_text(encoding="utf-8"), str(ignore)) if ignore.is_file() else ()


def walk_unignored(root: Path, rules: tuple[IgnoreRule, ...]) -> list[str]:
    """The files under ``root`` that ``rules`` do not ignore, as sorted relative POSIX paths (ignored folders
    are not entered)."""
    found = []
    for here, dirs, files in os.walk(root):
        rel = PurePosixPath(Path(here).relative_to(root).as_posix())
        rel = PurePosixPath() if rel.as_posix() == "." else rel
        dirs[:] = [d for d in dirs if not is_ignored(rel / d, True, rules)]
        found += [(rel / f).as_posix() for f in files if not is_ignored(rel / f, False, rules)]
    return sorted(found)


def _git_listing(repo: Path) -> list[str] | None:
    """The files of a commit of ``repo``'s working tree, or None when ``repo`` is not the root of a git checkout
    (an export) or git is missing."""
    try:
        top = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            check=False,
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != repo.resolve():
            return None
        listed = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    # A tracked file deleted in the working tree is not in the commit the reader clones.
    return sorted({p for p in listed.stdout.split("\0") if p and (repo / p).is_file()})


@functools.cache
def repository_files(repo: Path) -> tuple[str, ...]:
    """The files a clone of ``repo`` holds, relative POSIX paths; read once per process."""
    listing = _git_listing(repo)
    return tuple(listing if listing is not None else walk_unignored(repo, _root_rules(repo)))


def copy_repository(repo: Path, folder: Path) -> dict[str, tuple[int, int]]:
    """Copy the files of :func:`repository_files` into ``folder`` (modes and times kept); returns each copied
    file's (size, mtime_ns), what :func:`stray_writes` compares against."""
    copied: dict[str, tuple[int, int]] = {}
    made: set[Path] = set()
    for name in repository_files(repo):
        target = folder / name
        if target.parent not in made:
            target.parent.mkdir(parents=True, exist_ok=True)
            made.add(target.parent)
        try:
            shutil.copy2(repo / name, target, follow_symlinks=False)
        except FileNotFoundError:  # deleted since the listing (another change to the working tree)
            continue
        stat = target.lstat()
        copied[name] = (stat.st_size, stat.st_mtime_ns)
    return copied


def stray_writes(folder: Path, copied: dict[str, tuple[int, int]]) -> list[str]:
    """What a page left outside the ignored folders of ``folder``: files the copy did not hold, and copied files
    it changed or removed, sorted."""
    present = walk_unignored(folder, _root_rules(folder))
    stray = [f"{name} (new)" for name in present if name not in copied]
    for name, before in copied.items():
        try:
            stat = (folder / name).lstat()
        except FileNotFoundError:
            stray.append(f"{name} (removed)")
            continue
        if (stat.st_size, stat.st_mtime_ns) != before:
            stray.append(f"{name} (changed)")
    return sorted(stray)


def stray_report(page: str, stray: list[str]) -> str:
    """One line naming what ``page`` wrote outside the ignored folders, and the fix."""
    shown = ", ".join(stray[:_SHOWN]) + (f" and {len(stray) - _SHOWN} more" if len(stray) > _SHOWN else "")
    return (
        f"{page}: its blocks wrote outside the ignored folders of a clone ({shown}); a reader's clone would "
        f"show them in `git status` or lose its own files: write under runs/<page>/ (runs/ is in .gitignore)"
    )
