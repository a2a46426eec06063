"""Held-out classes stay held out: no class of the training split in another split, unless the set says why.

Deep metric learning measures retrieval of classes the model never saw: the test (and validation) classes of
SOP, CUB-200-2011 or Cars196 are apart from the training ones. A split that shares classes with training, such
as an image-level split made for classification (CUB's ``train_test_split.txt``, an ImageNet-style train/val),
is accepted by every other check and gives inflated Recall@k (a query finds images of a class the network was
trained on). So ``shards build`` (on its listing), ``shards index``, ``shards reshard``, ``shards verify`` and a
run's start-up (``runtime.shards``) all ask :func:`class_leak` and refuse such a set with one line.

What a class is: a class id of the manifest, which ``shards build`` and ``shards index`` give per (category,
class name). The same name under two categories is two classes; the same name in two splits is one class seen
twice. The held-out splits may share classes among themselves (VehicleID's nested test lists), and In-Shop's
query and gallery images, which share classes by design, are subsets of its one ``test`` split, not splits.

A protocol that shares classes on purpose (closed-set identification, a user's own benchmark) says so with
``--shared-classes REASON``; the reason is kept as the manifest's ``shared_classes`` field, and every check then
accepts the shared classes. A manifest written before that field existed loads as one without it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import replace
from typing import TypeVar

from ddp_rank.data.format.manifest import Manifest

__all__ = [
    "SHARED_CLASSES_HELP",
    "SHARED_CLASSES_OPTION",
    "TRAIN_SPLIT",
    "ClassLeakError",
    "check_reason",
    "class_leak",
    "leak_line",
    "manifest_leak",
    "record_shared_classes",
]

SHARED_CLASSES_OPTION = "--shared-classes"
SHARED_CLASSES_HELP = (
    "the splits share classes on purpose (your protocol, e.g. closed-set identification): REASON is recorded "
    "in the manifest, and build, index, reshard, verify and train then accept training classes in other "
    "splits. Without it a class of the train split found in another split is refused: retrieval figures on "
    "classes seen in training come out inflated. (In-Shop's query and gallery need no option: they are "
    "subsets of its test split.)"
)
WHY = "held-out classes must be new to the model, or its retrieval figures come out inflated"
RECORD_FIX = f"if your protocol shares classes on purpose, record it with {SHARED_CLASSES_OPTION} REASON"
BUILT_FIX = (
    "rebuild the shards with a class split (`ddp-rank shards build SOURCE OUT --test-fraction F`); or, "
    f"{RECORD_FIX} (`ddp-rank shards index DIR --upgrade {SHARED_CLASSES_OPTION} REASON` records it in the "
    "manifest in place, changing nothing else)"
)
"""The fix for a shard set that exists already (``shards verify``, a run's start-up)."""

K = TypeVar("K", bound=Hashable)
TRAIN_SPLIT = "train"
"""The split the shard tools take for the training one: ``data.train_split``'s default, the split ``shards build``
gives the classes it does not hold out. A run checks its own ``data.train_split``."""


class ClassLeakError(ValueError):
    """A class of the training split is in another split and the set records no protocol that allows it (no
    ``shared_classes``); the message is
    :func:`leak_line`'s, and ``at`` words it again for a caller that knows the file better (the CLI's path)."""

    def __init__(self, where: str, problem: str, fix: str) -> None:
        super().__init__(leak_line(where, problem, fix))
        self.problem, self.fix = problem, fix

    def at(self, where: str) -> str:
        return leak_line(where, self.problem, self.fix)


def check_reason(reason: str | None) -> str | None:
    """``reason`` of ``--shared-classes`` stripped, None when not given; a blank one is refused (it would record
    nothing a later reader can understand)."""
    if reason is None:
        return None
    if not reason.strip():
        raise ValueError(
            f"{SHARED_CLASSES_OPTION} needs a reason, e.g. {SHARED_CLASSES_OPTION} 'closed-set identification'; "
            "it is recorded in the manifest"
        )
    return reason.strip()


def class_leak(
    members: Mapping[str, Collection[K]], name: Callable[[K], str], train: str = TRAIN_SPLIT
) -> str | None:
    """What is wrong when a class of the training split ``train`` is in another split, or None when every
    other split holds classes of its own.

    ``members``: split -> its classes (any hashable id); ``name``: a class's name for the message. Splits other
    than ``train`` may share classes among themselves: VehicleID's test lists (``test_small`` within
    ``test_medium`` within ``test_large``) are nested by design, and none of them was trained on. The text:
    ``2 classes of split 'train' are also in split 'test' (2) and split 'val' (1), e.g. 'birds/a', ...``."""
    seen = set(members.get(train, ()))
    shared: set[K] = set()
    where = []
    for other in sorted(members):
        both = seen & set(members[other]) if other != train else set()
        if both:
            where.append(f"split {other!r} ({len(both):,})")
            shared |= both
    if not shared:
        return None
    examples = sorted(name(k) for k in shared)[:3]
    more = ", ..." if len(shared) > len(examples) else ""
    noun = "class" if len(shared) == 1 else "classes"
    verb = "is" if len(shared) == 1 else "are"
    return (
        f"{len(shared):,} {noun} of split {train!r} {verb} also in {' and '.join(where)}, e.g. "
        f"{', '.join(map(repr, examples))}{more}"
    )


def leak_line(where: str, problem: str, fix: str) -> str:
    """The one line of a refusal: where (the listing, the shards, the manifest), the problem, why, the fix."""
    return f"{where}: {problem}: {WHY}; {fix}"


def manifest_leak(manifest: Manifest, train: str = TRAIN_SPLIT) -> str | None:
    """:func:`class_leak` of a manifest's splits, by class id; None also when the manifest records a protocol
    that shares classes (``shared_classes``)."""
    if manifest.shared_classes:
        return None
    members = {name: info.class_counts.keys() for name, info in manifest.splits.items()}
    return class_leak(members, lambda cid: _class_name(manifest, cid), train)


def _class_name(manifest: Manifest, class_id: int) -> str:
    info = manifest.classes[class_id]
    return info.name if info.category is None else f"{manifest.categories[info.category]}/{info.name}"


def record_shared_classes(directory: str, reason: str) -> Manifest:
    """Record ``reason`` as the ``shared_classes`` of the manifest in ``directory`` (a local shard set), every
    other field kept: the way to accept an existing set whose splits share classes on purpose."""
    manifest = replace(Manifest.load(directory), shared_classes=check_reason(reason))
    manifest.save(directory)
    return manifest
