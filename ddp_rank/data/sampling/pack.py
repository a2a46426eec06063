"""Exact filling of a batch part from whole classes: the one packing rule the plan and the dealing share.

A part of ``room`` images is filled from an ordered list of candidate pieces (a class, or what is left of one),
each taken whole where it fits and otherwise cut, such that every piece taken has at least 2 images, every rest
left behind is 0 or at least 2 images, and the part ends exactly full. Two images per class is what gives every
image a same-class partner in the batch (a query with no positive contributes nothing to a ranking loss), and
rests of at least 2 keep that true for whoever takes them next.

The common case is vectorised: the longest prefix of whole candidates that fits is found with one cumulative
sum; only the last few images of the part are chosen one candidate at a time, with an exact search over a
small window when the greedy choice gets stuck (say 3 images left and only pairs in sight).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PackError(ValueError):
    """No choice of pieces fills the part under the two-images rule."""


def best_take(available: int, room: int, drop: bool = False) -> int:
    """Largest piece t of a candidate with ``available`` images for a part with ``room`` left, such that the
    piece is >= 2 and both the candidate's rest and the part's remaining room are 0 or >= 2 (0: no such t).
    With ``drop`` a rest of 1 is allowed (the caller leaves that image out for now)."""
    for t in range(min(available, room), 1, -1):
        if (drop or available - t != 1) and room - t != 1:
            return t
    return 0


def _takes(size: int, drop: bool) -> list[int]:
    return [t for t in range(size, 1, -1) if drop or size - t != 1]


def _exact(sizes: Sequence[int], room: int, drop: bool = False) -> list[tuple[int, int]] | None:
    """(index, take) pairs filling ``room`` exactly from ``sizes`` (each index once), oldest candidates first;
    a depth-first search with memoised failures (the window is small)."""
    failed: set[tuple[int, int]] = set()

    def search(start: int, left: int) -> list[tuple[int, int]] | None:
        if left == 0:
            return []
        if (start, left) in failed:
            return None
        for i in range(start, len(sizes)):
            for t in _takes(int(sizes[i]), drop):
                if t <= left and left - t != 1:
                    rest = search(i + 1, left - t)
                    if rest is not None:
                        return [(i, t), *rest]
        failed.add((start, left))
        return None

    return search(0, room)


def pack(
    sizes: np.ndarray, room: int, lookahead: int = 48, tail: int = 12, drop: bool = False
) -> list[tuple[int, int]]:
    """Choose ``(index, take)`` pairs over ``sizes`` (candidates in order of preference) that fill ``room``.

    Whole candidates are taken in order while they fit (one ``cumsum``); the rest of the room is filled from
    the following candidates, at most ``lookahead`` of them, greedily and, for the last ``tail`` images or when
    greedy fails, by an exact search. Candidates passed over are the caller's to keep for later. ``drop``
    allows a candidate's rest of 1 image. Raises ``PackError`` when no filling exists in the window.
    """
    if room == 0:
        return []
    if room < 2:
        raise PackError(f"a batch part of {room} image cannot hold a class of >= 2 images")
    sizes = np.asarray(sizes, dtype=np.int64)
    cum = np.cumsum(sizes)
    whole = int(np.searchsorted(cum, room - tail, side="right")) if room > tail else 0
    while whole > 0 and room - int(cum[whole - 1]) == 1:
        whole -= 1
    while True:
        left = room - (int(cum[whole - 1]) if whole else 0)
        window = sizes[whole : whole + lookahead]
        found = _greedy(window, left, tail, drop)
        if found is None and left <= 4 * tail:
            found = _exact([int(s) for s in window], left, drop)
        if found is not None:
            return [(i, int(sizes[i])) for i in range(whole)] + [(whole + i, t) for i, t in found]
        if whole == 0:
            raise PackError(
                f"cannot fill {room} images from {len(sizes)} candidate classes of sizes "
                f"{sorted(set(sizes.tolist()))[:8]} with >= 2 images per class"
            )
        whole = max(0, whole - 4)  # give the exact search more to work with


def _greedy(window: np.ndarray, left: int, tail: int, drop: bool) -> list[tuple[int, int]] | None:
    """Largest valid pieces in order until ``tail`` images are left, then an exact search for those."""
    chosen: list[tuple[int, int]] = []
    for i, size in enumerate(window.tolist()):
        if left <= tail:
            rest = _exact([int(s) for s in window[i:]], left, drop)
            return None if rest is None else chosen + [(i + j, t) for j, t in rest]
        t = best_take(size, left, drop)
        if t:
            chosen.append((i, t))
            left -= t
    if left and left <= tail:
        return None
    return chosen if left == 0 else None


def cut(sizes: np.ndarray, room: int) -> list[tuple[int, int]]:
    """The last resort when no filling keeps two images per class: candidates in order until ``room`` is full,
    the last one cut wherever it must be (its piece may be a single image)."""
    taken: list[tuple[int, int]] = []
    for i, size in enumerate(sizes.tolist()):
        if room == 0:
            break
        if size:
            taken.append((i, min(size, room)))
            room -= taken[-1][1]
    if room:
        raise PackError(
            f"only {sum(t for _, t in taken)} images where {room + sum(t for _, t in taken)} are needed"
        )
    return taken
