"""The dealing of one step's global batch to the ranks, and the search behind it.

``deal`` cuts a step's pieces (``plan.StepPlan``) into W parts of exactly M / W images under ``pack``'s rule: a
class never has fewer than 2 images on a rank, no image is used twice. Ranks are filled greedily from a seeded
shuffle of the pieces; where the greedy cut gets stuck, a bounded depth-first search (``_DealSearch``) backs up
and fills earlier ranks differently. It is a pure function of the plan, the world size and the seed, so every
rank and every DataLoader worker finds the same dealing without talking to the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ddp_rank.data.sampling.pack import PackError, cut, pack
from ddp_rank.data.sampling.plan import Piece, PlanError, StepPlan, local_batch_size

DEAL_SEARCH_STEPS = 20_000
"""Most steps ``deal`` spends searching for a dealing under the two-images rule when the greedy one gets stuck
(tens of milliseconds at most); past that it relaxes the rule (``strict``: raises)."""

_TAIL = 12
"""Images at the end of a rank's part that the search chooses piece by piece (``pack``'s ``tail``)."""
_WINDOW = 48
"""Pieces past a rank's whole pieces that the search considers for the rest of its part (``pack``'s lookahead)."""


def deal(plan: StepPlan, world_size: int, seed: int = 0, strict: bool = False) -> list[list[Piece]]:
    """Cut a step's pieces into ``world_size`` parts of exactly M / W images, a class never with fewer than 2
    images on a rank. The pieces are shuffled first (seeded by the step), so every rank holds a mix of the
    step's groups (BatchNorm statistics of a local batch then resemble the global batch's).

    Ranks are filled in turn from the head of the shuffled queue (``pack``: whole pieces while they fit, then an
    exact choice for the last images). When that leaves a later rank unfillable, a bounded depth-first search
    (``_DealSearch``, at most ``DEAL_SEARCH_STEPS`` steps) backs up and fills earlier ranks differently. All of it
    is a pure function of the plan, ``world_size`` and ``seed``: every rank and every DataLoader worker finds the
    same dealing.

    Some plans cannot be dealt under the two-images rule (a local batch of 3 from classes of 2 and 4). Then,
    unless ``strict``, the part is cut where it must be: an image may sit alone on its rank, but its positives
    are still in the global batch, which is what the loss ranks against. ``strict`` raises ``PlanError``
    instead (``ddp-rank plan`` reports it).
    """
    local = local_batch_size(plan.size, world_size)
    rng = np.random.default_rng([seed, plan.epoch, plan.step, 19])
    queue = [plan.pieces[int(i)] for i in rng.permutation(len(plan.pieces))]
    search = _DealSearch([p.size for p in queue], world_size, local, DEAL_SEARCH_STEPS)
    takes = search.run()
    if takes is not None:
        return _parts_of(queue, takes)
    if strict:
        raise PlanError(
            f"step {plan.step} of epoch {plan.epoch}: the {world_size} ranks cannot get exactly {local} images "
            f"each with >= 2 per class ({search.why}); another global batch or world size avoids it"
        )
    return _deal_relaxed(queue, world_size, local)


def _parts_of(queue: Sequence[Piece], takes: Sequence[Sequence[tuple[int, int]]]) -> list[list[Piece]]:
    """Pieces from ``(queue position, images)`` takes: a piece dealt over several ranks gives its images in
    stored order, the first rank first."""
    offset = [0] * len(queue)
    parts = []
    for rank_takes in takes:
        part = []
        for i, t in rank_takes:
            piece, start = queue[i], offset[i]
            whole = start == 0 and t == piece.size
            part.append(
                piece if whole else Piece(piece.class_id, piece.images[start : start + t], piece.group)
            )
            offset[i] = start + t
        parts.append(part)
    return parts


def _deal_relaxed(queue: list[Piece], world_size: int, local: int) -> list[list[Piece]]:
    """The greedy dealing with ``cut`` where ``pack`` finds no filling (a class may get one image on a rank)."""
    sizes = np.array([p.size for p in queue], dtype=np.int64)
    parts: list[list[Piece]] = []
    for _ in range(world_size - 1):
        # Only the head of the queue can be needed: the pieces that reach ``local`` and a look-ahead.
        head = int(np.searchsorted(np.cumsum(sizes), local, side="left")) + _WINDOW
        try:
            taken = dict(pack(sizes[:head], local))
        except PackError:
            taken = dict(cut(sizes[:head], local))
        part, rest, rest_sizes = [], [], []
        for i, (piece, size) in enumerate(zip(queue[:head], sizes[:head].tolist())):
            t = taken.get(i, 0)
            if t:
                part.append(Piece(piece.class_id, piece.images[:t], piece.group))
            if t < size:
                rest.append(Piece(piece.class_id, piece.images[t:], piece.group) if t else piece)
                rest_sizes.append(size - t)
        parts.append(part)
        queue = rest + queue[head:]
        sizes = np.concatenate([np.array(rest_sizes, dtype=np.int64), sizes[head:]])
    parts.append(queue)
    return parts


def _most_odd(size: int) -> int:
    """Most pieces of odd size (3 or more) that ``size`` images can be cut into, pieces >= 2."""
    most = size // 3
    return most if most % 2 == size % 2 else most - 1


class _OutOfSteps(Exception):
    """The search spent its steps."""


@dataclass
class _Frame:
    """One rank of the search: its untried fillings and, once one is applied, how to take it back."""

    fillings: Iterator[list[tuple[int, int]]]
    takes: list[tuple[int, int]] = field(default_factory=list)
    undo: tuple[list[tuple[int, int]], list[int], int] | None = None


class _DealSearch:
    """Depth-first search over the ranks for a dealing under the two-images rule (see ``deal``).

    The queue is the shuffled pieces, and it only ever shrinks in place: a rank takes images from its head, what
    is left of a piece keeps its position. Rank by rank, the first filling tried is ``pack``'s, which is the greedy
    dealing (most steps need nothing else). When a rank cannot be filled, the search backs up to the rank
    before and tries its other fillings: the exact fillings of its last images (all of them for parts of up to
    ``4 * _TAIL`` images) from the next ``_WINDOW`` pieces, whole pieces and earlier pieces first. Pruning keeps
    this small: ranks are interchangeable, so an alternative includes the queue's first piece (whichever rank
    holds it may as well come now); two fillings taking the same (piece size, images) pairs leave the same
    sizes behind, so only one is tried; a multiset of remaining sizes found not to deal is remembered; and
    ``_impossible``'s necessary conditions (pieces of odd size) cut off what cannot work, before the search starts
    and on each way back.

    Exhaustive for steps whose pieces all fit the windows (small batches, where the greedy dealing gets stuck);
    at most ``steps`` fillings and search steps in any case.
    """

    def __init__(self, sizes: list[int], world_size: int, local: int, steps: int) -> None:
        self.sizes = np.array(sizes, dtype=np.int64)
        self.rem = list(sizes)
        """Images left of each queue position."""
        self.count = Counter(s for s in sizes if s)
        """Remaining pieces by size (the state that decides whether the remaining ranks can be dealt)."""
        self.world_size, self.local, self.steps, self.left = world_size, local, steps, steps
        self.front = 0
        """Positions from here on are untouched; ``carried`` lists the earlier ones with images left."""
        self.carried: list[int] = []
        self.failed: set[tuple[tuple[int, int], ...]] = set()
        self.truncated = False
        self.why = ""

    def run(self) -> list[list[tuple[int, int]]] | None:
        """``(queue position, images)`` takes of every rank, or None with ``why`` set."""
        reason = self._impossible() if self.world_size > 1 and self.local else None
        if reason:
            self.why = f"no dealing exists: {reason}"
            return None
        frames: list[_Frame] = []
        try:
            while len(frames) < self.world_size - 1:
                # (the checks cost a little: the greedy dealing, tried first, never needs them)
                known_bad = bool(self.failed) and (self._key() in self.failed or bool(self._impossible()))
                frames.append(_Frame(iter(()) if known_bad else self._fillings()))
                while frames:
                    top = frames[-1]
                    if top.undo is not None:  # back from a rank that could not be dealt
                        self._undo(top.undo)
                        top.undo = None
                        if self._impossible():  # (not checked on the way down, see above)
                            top.fillings = iter(())
                    filling = next(top.fillings, None)
                    if filling is not None:
                        top.takes, top.undo = filling, self._apply(filling)
                        break
                    self.failed.add(self._key())
                    frames.pop()
                else:
                    self.why = (
                        "no dealing exists" if not self.truncated else "none found in the search window"
                    )
                    return None
        except _OutOfSteps:
            self.why = f"none found in {self.steps} search steps"
            return None
        last = [(i, self.rem[i]) for i in self.carried]
        last += [(i, self.rem[i]) for i in range(self.front, len(self.rem)) if self.rem[i]]
        return [f.takes for f in frames] + [last]

    def _impossible(self) -> str | None:
        """Why the remaining pieces cannot be dealt, by quick necessary conditions (None: they may be)."""
        local, count = self.local, self.count
        if min(count, default=2) < 2:
            return "the plan holds a class with a single image"
        allowed = {1: (), 2: (2,), 3: (3,), 4: (2, 4)}.get(local)
        if allowed is not None:  # parts this small take few piece sizes (from 5 on, 2 and 3 make every size)
            bad = sorted(s for s in count if not allowed or s % (3 if local == 3 else 2))
            if bad:
                return (
                    f"a class of {bad[0]} images cannot be cut into pieces of "
                    f"{' or '.join(map(str, allowed)) or 'at least 2'} images that fill {local}-image parts"
                )
        # A part has an odd number of pieces of odd size (>= 3) when its size is odd, an even one otherwise,
        # at most ``_most_odd(local)``; a class of s images gives at least s % 2 of them, at most _most_odd(s).
        ranks = sum(s * n for s, n in count.items()) // local
        low = sum(n for s, n in count.items() if s % 2)
        high = sum(n * _most_odd(s) for s, n in count.items())
        if low > ranks * _most_odd(local) or high < ranks * (local % 2):
            return (
                f"{ranks} parts of {local} images hold {ranks * (local % 2)} to {ranks * _most_odd(local)} "
                f"pieces of odd size, the classes give {low} to {high}"
            )
        return None

    def _spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise _OutOfSteps

    def _key(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted((s, n) for s, n in self.count.items() if n))

    def _fillings(self) -> Iterator[list[tuple[int, int]]]:
        """The fillings of the next rank, from the queue as it stands now (see the class docstring)."""
        local, carried, front = self.local, self.carried, self.front
        # The head of the queue: what is left of pieces before ``front``, then untouched pieces, enough of them
        # to reach ``local`` images (pieces have >= 2) and a window beyond.
        end = min(len(self.rem), front + local // 2 + 1 + _WINDOW)
        sizes = np.concatenate(
            [np.array([self.rem[i] for i in carried], dtype=np.int64), self.sizes[front:end]]
        )
        cum = np.cumsum(sizes)

        def position(j: int) -> int:
            return carried[j] if j < len(carried) else front + j - len(carried)

        def signature(filling: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
            return tuple(sorted((int(sizes[j]), t) for j, t in filling))

        try:  # the greedy choice: what ``_deal_relaxed`` takes when it needs no cut
            greedy = pack(sizes[: int(np.searchsorted(cum, local, side="left")) + _WINDOW], local)
        except PackError:
            greedy = None
        if greedy is not None:
            if self.failed:  # the greedy dealing itself is free; once searching, a rank costs its size
                self._spend(1 + local // 128)
            yield [(position(j), t) for j, t in greedy]
        # Only when a later rank got stuck: the other fillings.
        seen = {signature(greedy)} if greedy is not None else set()
        remaining = sum(self.count.values())
        whole = int(np.searchsorted(cum, local - _TAIL, side="right")) if local > _TAIL else 0
        while whole > 0 and local - int(cum[whole - 1]) == 1:
            whole -= 1
        for w in [*range(whole, 0, -4), 0]:
            left = local - (int(cum[w - 1]) if w else 0)
            if left > 4 * _TAIL:
                self.truncated = True
                break
            window = sizes[w : w + _WINDOW].tolist()
            self.truncated |= remaining - w > len(window)
            prefix = [(j, int(sizes[j])) for j in range(w)]
            for rest in self._exact(window, left, w == 0):
                filling = prefix + [(w + j, t) for j, t in rest]
                self._spend()
                if signature(filling) not in seen:
                    seen.add(signature(filling))
                    yield [(position(j), t) for j, t in filling]

    def _exact(self, sizes: list[int], room: int, first: bool) -> Iterator[list[tuple[int, int]]]:
        """Every ``(index, take)`` filling of ``room`` from ``sizes`` under the two-images rule, earlier and
        bigger takes first; with ``first`` only those that take from index 0."""
        failed: set[tuple[int, int]] = set()

        def search(start: int, left: int) -> Iterator[list[tuple[int, int]]]:
            if left == 0:
                yield []
                return
            if (start, left) in failed:
                return
            found = False
            stop = start + 1 if first and start == 0 else len(sizes)
            for i in range(start, stop):
                for t in range(min(sizes[i], left), 1, -1):
                    if sizes[i] - t == 1 or left - t == 1:
                        continue
                    self._spend()
                    for rest in search(i + 1, left - t):
                        found = True
                        yield [(i, t), *rest]
            if not found:
                failed.add((start, left))

        return search(0, room)

    def _apply(self, filling: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int], int]:
        changes = []
        for i, t in filling:
            old = self.rem[i]
            changes.append((i, old))
            self.rem[i] = old - t
            self.count[old] -= 1
            if old - t:
                self.count[old - t] += 1
        undo = (changes, self.carried, self.front)
        front = max(self.front, max((i + 1 for i, _ in filling), default=0))
        self.carried = [i for i in self.carried if self.rem[i]] + [
            i for i in range(self.front, front) if self.rem[i]
        ]
        self.front = front
        return undo

    def _undo(self, undo: tuple[list[tuple[int, int]], list[int], int]) -> None:
        changes, self.carried, self.front = undo
        for i, old in reversed(changes):
            now = self.rem[i]
            if now:
                self.count[now] -= 1
            self.count[old] += 1
            self.rem[i] = old
