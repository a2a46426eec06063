"""Which column of a listing's header is which: the known names, a user's mapping, and the lookalikes.

Listings exported by other tools name their columns their own way (``filepath,label``, ``image,class_id``).
``resolve_columns`` maps each known column (``path``, ``class``, ...) to the header's name for it, taking a
user's mapping (``--path-column``, ``--class-column``) first, and explains a missing required column by naming
the header column that looks like it and the option that maps it. It returns problems as text; the listing
reader turns them into its one-line error.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

KNOWN_COLUMNS: tuple[str, ...] = ("path", "class", "category", "split", "subset")
REQUIRED_COLUMNS: tuple[str, ...] = ("path", "class")
MAPPABLE: dict[str, str] = {"path": "--path-column", "class": "--class-column"}
"""The required columns a user may map to another header name, with the command-line option that does it."""

_LOOKALIKES: dict[str, tuple[str, ...]] = {
    "path": ("file", "filename", "filepath", "fname", "image", "imagename", "imagepath", "img", "imgpath"),
    "class": ("label", "labels", "classid", "classname", "cls", "target", "identity", "id", "y"),
}
"""Header names other tools give the required columns (compared without case, spaces, ``_`` or ``-``)."""


def _plain(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace(" ", "")


def lookalike(wanted: str, header: Sequence[str]) -> str | None:
    """The header column that most likely holds ``wanted``'s values: the same name in another case or spelling,
    a name other tools use for it, else a close spelling; None if nothing looks like it."""
    free = [h for h in header if h not in KNOWN_COLUMNS]
    for h in free:
        if _plain(h) == _plain(wanted) or _plain(h) in _LOOKALIKES.get(wanted, ()):
            return h
    close = difflib.get_close_matches(wanted, free, n=1, cutoff=0.6)
    return close[0] if close else None


def _missing_hint(column: str, header: Sequence[str]) -> str:
    like = lookalike(column, header)
    if like is None:
        return f"no column looks like {column!r}: add one"
    option = MAPPABLE[column]
    return f"column {like!r} looks like it: pass {option} {like} (or rename it {column} in the header)"


def resolve_columns(header: Sequence[str], mapping: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """(known column -> header column, problems): ``mapping`` says which header column holds a known one;
    problems name a bad mapping or a missing required column, each with the way out."""
    problems = []
    for known, given in mapping.items():
        if known not in MAPPABLE:
            problems.append(f"only {sorted(MAPPABLE)} can be mapped to another column, not {known!r}")
        elif given not in header:
            problems.append(
                f"{MAPPABLE[known]} {given}: the header has no such column (it has {list(header)})"
            )
        elif known in header and given != known:
            problems.append(
                f"{MAPPABLE[known]} {given}, but the header has a {known!r} column too: drop one of them"
            )
    if problems:
        return {}, problems
    columns = {c: c for c in KNOWN_COLUMNS if c in header}
    columns.update(mapping)
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        hints = "; ".join(_missing_hint(c, header) for c in missing)
        problems.append(
            f"missing column(s) {missing}; {hints}; the header names the columns {list(KNOWN_COLUMNS)} "
            "(path and class required)"
        )
    return columns, problems
