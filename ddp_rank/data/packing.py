"""Who reads what, and how whole classes are packed into exact-size batch parts.

Shares: each (rank, DataLoader worker) slot owns a disjoint part of every group's data: whole shards when the
group has at least as many shards as there are slots (balanced by sample count), otherwise whole classes (each
slot then reads the group's shards but keeps only its classes). Disjoint shares are what guarantee that no image
is on two ranks in one step.

Streams: a slot reads its share as an endless sequence of classes, pass after pass, with the shard order and the
class order (inside a small window, to keep reads sequential) reshuffled by (seed, epoch, group, slot, pass).

Packing: a batch part of exactly ``quota`` images is cut from the stream's classes, taking whole classes when they
fit and otherwise splitting one so both pieces keep at least two images; every taken piece has >= 2 images, so
every image has a same-class partner in its local batch (hence in the global batch) whenever the class sizes
allow it. A small look-ahead buffer finds a class that fits; a split class's rest stays first in line.

Everything here is computed from the shard index alone, never from image bytes, so a resumed run replays the
packing of the skipped steps without reading any image.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter

import numpy as np

from ddp_rank.data.manifest import ShardInfo
from ddp_rank.data.schedule import ALL, UNLABELLED
from ddp_rank.data.tario import ShardScan

Ref = tuple[int, int]
"""A sample: (shard index within the split, sample index within that shard's scan)."""


@dataclass(frozen=True)
class Unit:
    """Part of a slot's share: one shard, all of it (``classes`` None) or only some of its classes."""

    shard: int
    classes: frozenset[int] | None = None


@dataclass(frozen=True)
class ClassGroup:
    class_id: int
    refs: tuple[Ref, ...]


def group_shards(shards: Sequence[ShardInfo], group: int) -> list[int]:
    """Indices of the shards that make up a schedule group (a category, the unlabelled pool, or all)."""
    if group == ALL:
        return list(range(len(shards)))
    wanted = None if group == UNLABELLED else group
    return [i for i, s in enumerate(shards) if s.category == wanted]


def assign_shares(shards: Sequence[ShardInfo], group: int, n_slots: int) -> list[list[Unit]]:
    """Split a group's data into ``n_slots`` disjoint shares: whole shards when that is balanced (every share at
    least half the mean), else whole classes, which balance to within one class."""
    members = group_shards(shards, group)
    if len(members) >= n_slots:
        shares = _by_shards(shards, members, n_slots)
        sizes = [share_size(shards, s) for s in shares]
        if min(sizes) * 2 * n_slots >= sum(sizes):
            return shares
    return _by_classes(shards, members, n_slots)


def _by_shards(shards: Sequence[ShardInfo], members: list[int], n_slots: int) -> list[list[Unit]]:
    """Largest shard first to the least-loaded slot (deterministic ties)."""
    shares: list[list[Unit]] = [[] for _ in range(n_slots)]
    load = [0] * n_slots
    for i in sorted(members, key=lambda i: (-shards[i].samples, i)):
        slot = min(range(n_slots), key=lambda s: (load[s], s))
        shares[slot].append(Unit(i))
        load[slot] += shards[i].samples
    return [sorted(share, key=lambda u: u.shard) for share in shares]


def _by_classes(shards: Sequence[ShardInfo], members: list[int], n_slots: int) -> list[list[Unit]]:
    """Largest class first to the least-loaded slot; a slot reads every shard of the group but keeps its classes
    (the shard index makes skipping the other classes free: their bytes are never read)."""
    load = [0] * n_slots
    owned: list[set[int]] = [set() for _ in range(n_slots)]
    classes = [(n, cid) for i in members for cid, n in shards[i].classes]
    for n, cid in sorted(classes, key=lambda x: (-x[0], x[1])):
        slot = min(range(n_slots), key=lambda s: (load[s], s))
        owned[slot].add(cid)
        load[slot] += n
    shares: list[list[Unit]] = [[] for _ in range(n_slots)]
    for slot in range(n_slots):
        for i in members:
            mine = frozenset(cid for cid, _ in shards[i].classes if cid in owned[slot])
            if mine:
                shares[slot].append(Unit(i, mine))
    return shares


def share_size(shards: Sequence[ShardInfo], share: Sequence[Unit]) -> int:
    """Images in a share according to the manifest."""
    return sum(
        n for u in share for cid, n in shards[u.shard].classes if u.classes is None or cid in u.classes
    )


def class_stream(
    share: Sequence[Unit],
    scan: Callable[[int], ShardScan],
    seed: Sequence[int],
    window: int = 16,
) -> Iterator[ClassGroup]:
    """The classes of a share, forever: pass p shuffles the units and, within windows, the classes."""
    if not share:
        raise ValueError("empty share: this slot owns no data of the group")
    for p in range(1 << 62):
        rng = np.random.default_rng([*seed, p])
        produced = False
        for u in rng.permutation(len(share)):
            groups = _classes_of(share[int(u)], scan, rng)
            for start in range(0, len(groups), window):
                chunk = groups[start : start + window]
                for j in rng.permutation(len(chunk)):
                    produced = True
                    yield chunk[int(j)]
        if not produced:
            names = ", ".join(str(scan(u.shard).path) for u in share)
            raise RuntimeError(f"no readable sample in this slot's share ({names}); see the shard warnings")


def _classes_of(unit: Unit, scan: Callable[[int], ShardScan], rng: np.random.Generator) -> list[ClassGroup]:
    """Consecutive samples of the same class form a group (classes are stored contiguously); the images of a
    class are shuffled per pass, so a piece cut from a class is a different subset each pass."""
    entries = [
        (j, e.class_id)
        for j, e in enumerate(scan(unit.shard).samples)
        if unit.classes is None or e.class_id in unit.classes
    ]
    groups = []
    for class_id, run in groupby(entries, key=itemgetter(1)):
        refs = [(unit.shard, j) for j, _ in run]
        groups.append(ClassGroup(class_id, tuple(refs[int(i)] for i in rng.permutation(len(refs)))))
    return groups


def best_take(available: int, room: int) -> int:
    """Largest piece t of a class with ``available`` images for a batch part with ``room`` left, such that the
    piece, the class's rest and the part's remaining room are each 0 or >= 2 (0 if there is none)."""
    for t in range(min(available, room), 1, -1):
        if available - t != 1 and room - t != 1:
            return t
    return 0


class Packer:
    """Cuts exact-size batch parts from one slot's class stream (see the module docstring)."""

    def __init__(
        self, stream: Iterator[ClassGroup], share_images: int, lookahead: int = 32, tail: int = 16
    ) -> None:
        self.stream = stream
        self.share_images = share_images
        self.lookahead = lookahead
        self.tail = tail
        self.buffer: deque[ClassGroup] = deque()

    def take(self, quota: int) -> list[Ref]:
        part: list[Ref] = []
        seen: set[Ref] = set()
        while len(part) < quota:
            index, refs, drop_rest = self._choose(quota - len(part), seen)
            part.extend(refs)
            seen.update(refs)
            group = self.buffer[index]
            taken = set(refs)
            rest = tuple(r for r in group.refs if r not in taken)
            if rest and not drop_rest:
                self.buffer[index] = ClassGroup(group.class_id, rest)
            else:
                del self.buffer[index]
        return part

    def _group(self, index: int) -> ClassGroup:
        while len(self.buffer) <= index:
            self.buffer.append(next(self.stream))
        return self.buffer[index]

    def _choose(self, room: int, seen: set[Ref]) -> tuple[int, list[Ref], bool]:
        """The next piece: (buffer index, refs, drop the class's last image).

        For a large room: a piece of the oldest class that keeps the partner rule, else the oldest class cut to the
        room with its single leftover image dropped for this pass (so a class never waits forever behind smaller
        ones), else a later class that keeps the rule. For the last few images (room <= ``tail``) an exact search
        over the look-ahead window picks pieces that end the part exactly. Only if no rule-keeping choice exists:
        any fresh piece, and for a share smaller than the quota, repeated images.
        """
        if room <= self.tail:
            found = self._finish(room, seen)
            if found is not None:
                return found
        fallback: tuple[int, list[Ref], bool] | None = None
        index = 0
        while True:
            fresh = [r for r in self._group(index).refs if r not in seen]
            t = best_take(len(fresh), room)
            if t:
                return index, fresh[:t], False
            if index == 0 and room >= 2 and len(fresh) == room + 1:
                return index, fresh[:room], True
            if fresh and fallback is None:
                fallback = (index, fresh[: min(len(fresh), room)], False)
            index += 1
            if index >= self.lookahead and fallback is not None:
                return fallback
            if len(seen) >= self.share_images or index >= self.lookahead + self.share_images:
                # A whole pass holds nothing new (the share, or what is readable of it, is smaller than the
                # quota): repeating images is the only way to keep the batch size exact.
                return 0, list(self._group(0).refs[:room]), False

    def _finish(self, room: int, seen: set[Ref]) -> tuple[int, list[Ref], bool] | None:
        """First piece of an exact filling of ``room`` from the window's classes (each class once), or None."""
        window: list[tuple[int, list[Ref]]] = []
        classes: set[int] = set()
        for index in range(self.lookahead):
            group = self._group(index)
            fresh = [r for r in group.refs if r not in seen]
            if group.class_id not in classes and fresh:
                classes.add(group.class_id)
                window.append((index, fresh))

        def options(size: int, allow_drop: bool) -> list[tuple[int, bool]]:
            takes = [(t, False) for t in range(size, 1, -1) if size - t != 1]
            return takes + ([(size - 1, True)] if allow_drop and size >= 3 else [])

        def search(allow_drop: bool, oldest_first: bool) -> tuple[int, int, bool] | None:
            failed: set[tuple[int, int]] = set()

            def fill(position: int, left: int) -> tuple[int, int, bool] | None:
                if (position, left) in failed:
                    return None
                last = 1 if oldest_first and position == 0 else len(window)
                for p in range(position, last):
                    for t, drop in options(len(window[p][1]), allow_drop):
                        if t <= left and (t == left or fill(p + 1, left - t) is not None):
                            return p, t, drop
                failed.add((position, left))
                return None

            return fill(0, room)

        # The oldest class goes in if it can (so no class waits forever); keep every class's rest >= 2 if
        # possible, else cut a class one short and drop its last image for this pass (it comes back in the next
        # one) rather than leave an image without a partner.
        oldest = bool(window) and window[0][0] == 0
        first = (
            (oldest and (search(False, True) or search(True, True)))
            or search(False, False)
            or search(True, False)
        )
        if first is None:
            return None
        p, t, drop = first
        index, fresh = window[p]
        return index, fresh[:t], drop
