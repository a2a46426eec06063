"""Old import paths of modules that moved (issue 39's regrouping by feature), kept for one release.

``import ddp_rank.data.manifest`` (and every other path in ``MOVED``) still works: a finder placed first on
``sys.meta_path`` imports the module at its new place and registers that same module object under the old name,
with one ``DeprecationWarning`` per old name and process. Same object, not a copy: a ``monkeypatch`` or
``mock.patch`` aimed at an old path patches what the code runs, and ``isinstance`` checks agree.

Why a finder and not stub files at the old paths: a stub at an old path would make git see a modified file
instead of a rename, and edits made elsewhere to the old file would no longer follow it to its new place.

Remove this module (and its installation in ``ddp_rank/__init__.py``) one release after the move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

MOVED: dict[str, str] = {
    # feature shards: one slice across the data, model and eval layers
    "ddp_rank.data.features": "ddp_rank.features.records",
    "ddp_rank.data.synthetic_features": "ddp_rank.features.synthetic",
    "ddp_rank.data.whitening": "ddp_rank.features.whitening",
    "ddp_rank.model.feature_head": "ddp_rank.features.head",
    "ddp_rank.eval.feature_build": "ddp_rank.features.build",
    "ddp_rank.eval.feature_images": "ddp_rank.features.images",
    "ddp_rank.eval.feature_whiten": "ddp_rank.features.whiten",
    # checkpoints: write, read, check, resume
    "ddp_rank.train.checkpoint": "ddp_rank.checkpoints.write",
    "ddp_rank.model.checkpoints": "ddp_rank.checkpoints.read",
    "ddp_rank.file_checks": "ddp_rank.checkpoints.file_checks",
    "ddp_rank.train.resume": "ddp_rank.checkpoints.resume",
    "ddp_rank.train.resume_check": "ddp_rank.checkpoints.resume_check",
    "ddp_rank.train.state_files": "ddp_rank.checkpoints.state_files",
    "ddp_rank.model.safe_pickles": "ddp_rank.checkpoints.safe_pickles",
    # the chunked step and its automatic size
    "ddp_rank.train.chunked": "ddp_rank.train.chunking.step",
    "ddp_rank.train.captured_chunk": "ddp_rank.train.chunking.captured",
    "ddp_rank.train.auto_chunk": "ddp_rank.train.chunking.auto",
    "ddp_rank.train.chunk_choice": "ddp_rank.train.chunking.choice",
    "ddp_rank.train.chunk_confirm": "ddp_rank.train.chunking.confirm",
    "ddp_rank.train.step_memory": "ddp_rank.train.chunking.step_memory",
    "ddp_rank.train.host_memory": "ddp_rank.train.chunking.host_memory",
    "ddp_rank.train.layout": "ddp_rank.train.chunking.layout",
    "ddp_rank.train.plan_report": "ddp_rank.train.chunking.plan_report",
    # the data layer's parts
    "ddp_rank.data.manifest": "ddp_rank.data.format.manifest",
    "ddp_rank.data.manifest_check": "ddp_rank.data.format.manifest_check",
    "ddp_rank.data.tar_writer": "ddp_rank.data.format.tar_writer",
    "ddp_rank.data.tar_scan": "ddp_rank.data.format.tar_scan",
    "ddp_rank.data.compressed": "ddp_rank.data.format.compressed",
    "ddp_rank.data.info": "ddp_rank.data.format.info",
    "ddp_rank.data.fragmentation": "ddp_rank.data.format.fragmentation",
    "ddp_rank.data.build": "ddp_rank.data.building.build",
    "ddp_rank.data.build_dir": "ddp_rank.data.building.build_dir",
    "ddp_rank.data.listing": "ddp_rank.data.building.listing",
    "ddp_rank.data.recipes": "ddp_rank.data.building.recipes",
    "ddp_rank.data.synthetic": "ddp_rank.data.building.synthetic",
    "ddp_rank.data.shard_index": "ddp_rank.data.building.shard_index",
    "ddp_rank.data.shard_sources": "ddp_rank.data.building.shard_sources",
    "ddp_rank.data.reshard": "ddp_rank.data.building.reshard",
    "ddp_rank.data.reshard_source": "ddp_rank.data.building.reshard_source",
    "ddp_rank.data.verify": "ddp_rank.data.building.verify",
    "ddp_rank.data.plan": "ddp_rank.data.sampling.plan",
    "ddp_rank.data.dealing": "ddp_rank.data.sampling.dealing",
    "ddp_rank.data.schedule": "ddp_rank.data.sampling.schedule",
    "ddp_rank.data.pack": "ddp_rank.data.sampling.pack",
    "ddp_rank.data.reader": "ddp_rank.data.reading.reader",
    "ddp_rank.data.stream": "ddp_rank.data.reading.stream",
    "ddp_rank.data.loader": "ddp_rank.data.reading.loader",
    "ddp_rank.data.batch": "ddp_rank.data.reading.batch",
    "ddp_rank.data.eval_reader": "ddp_rank.data.reading.eval_reader",
    "ddp_rank.data.shard_cache": "ddp_rank.data.reading.shard_cache",
    "ddp_rank.data.storage": "ddp_rank.data.reading.storage",
    "ddp_rank.data.decode": "ddp_rank.data.reading.decode",
    "ddp_rank.data.image_modes": "ddp_rank.data.reading.image_modes",
    "ddp_rank.data.transforms": "ddp_rank.data.reading.transforms",
    "ddp_rank.data.serve": "ddp_rank.data.reading.serve",
    "ddp_rank.data.span_samples": "ddp_rank.data.reading.span_samples",
}


def moved_attributes(
    module: str, moved: dict[str, str], gone: dict[str, str] | None = None
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` serving the public names that moved out of it (name -> the
    module that defines it now), each access with a ``DeprecationWarning`` naming the new place; a name in
    ``gone`` (name -> what replaces it, and how) was removed and raises an ``AttributeError`` saying so, where a
    shim of another signature would fail further from the cause. Kept for one release, like ``MOVED``."""

    def __getattr__(name: str) -> Any:
        if name in moved:
            warnings.warn(
                f"{module}.{name} moved to {moved[name]}.{name}; the old import path goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        if gone is not None and name in gone:
            raise AttributeError(f"{module}.{name} was removed: {gone[name]}", name=name, obj=module)
        raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name, obj=module)

    return __getattr__


def new_name(old: str) -> str | None:
    """The module's new name: an old module, or a module inside an old package (``ddp_rank.data.recipes.sop``)."""
    if old in MOVED:
        return MOVED[old]
    head = old.rpartition(".")[0]
    while head:
        if head in MOVED:
            return f"{MOVED[head]}.{old[len(head) + 1 :]}"
        head = head.rpartition(".")[0]
    return None


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new place; the import system then returns that module."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # a placeholder; exec_module swaps the real module in under the old name

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        moved = importlib.import_module(self.new)
        warnings.warn(
            f"{old} moved to {self.new}; the old import path goes in the next release",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        # The import system reads sys.modules[old] back after exec_module: the caller gets the new module
        # itself (its own __name__ and __spec__), not the placeholder.
        sys.modules[old] = moved


def _importer_stacklevel() -> int:
    """The ``stacklevel`` of the importing line, as ``warnings.warn`` counts it from ``exec_module``.

    ``warnings.warn`` skips the import system's own frames (``importlib._bootstrap``) when it counts; the frames it
    does count, this module's and ``importlib.import_module``'s, are skipped here."""
    frame = sys._getframe(2)  # exec_module's caller
    level = 2
    while frame is not None:
        name = frame.f_code.co_filename
        internal = "importlib" in name and "_bootstrap" in name
        if not internal and name not in {__file__, importlib.__file__}:
            break
        level += 0 if internal else 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds only the old names of ``MOVED`` (and modules inside old packages); everything else passes by."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("ddp_rank."):
            return None
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an old package's name must not reach the path finder,
    which would load a second copy of its modules from the new folder under the old names."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
