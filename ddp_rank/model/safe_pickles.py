"""Reading the torch (pickle) files of a run directory without ever running code that a file names.

Why: a pickle is a program. An unrestricted unpickler calls whatever function the file names (``os.system``
included), so a run directory handed over by someone else would run their code at ``train.resume``, ``eval``,
``export`` or ``model.init_from``. The SHA-256 of each file recorded in ``meta.json`` does not help: whoever
hands over the directory can rewrite the record too. So every torch file ddp-rank reads is read by
``torch.load(weights_only=True)``, which builds tensors, containers, numbers and strings, and of other types
only those allowed here by name:

- :data:`RNG_STATE_TYPES`: the numpy arrays of accelerate's ``random_states_<rank>.pkl`` (numpy's generator state);
- :func:`deepspeed_types`: what DeepSpeed 0.19 pickles into ZeRO's ``*_optim_states.pt`` (its stage enum, its loss
  scaler and the fragment addresses of the partitioned optimizer state), allowed only for a DeepSpeed resume.

Three layers. :func:`unsafe_pickle_problem` reads the globals a file names before any byte is unpickled
(``torch.serialization.get_unsafe_globals_in_checkpoint``, a static scan of the pickle's opcodes), so that the
refusal names the file and the function in one line, and then loads it weights-only with ``mmap`` (its tensors'
bytes are not read) for what a static scan cannot see; a resume does this for every torch file of the checkpoint
before anything else reads it. Then the loads themselves are weights-only: the project's own through
:func:`load_torch_file`, and accelerate's ``load_state`` and DeepSpeed's ``load_checkpoint``, which call
``torch.load`` themselves (DeepSpeed with ``weights_only=False``), inside :func:`weights_only_loads`: every
``torch.load`` there is weights-only through torch's own switch ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` (read at each
call, and it overrides an explicit ``weights_only=False``) rather than a replaced ``torch.load``. The switch and
the allowed types are process-wide while the block runs and restored after it, also on error: a ``torch.load`` of
another thread in that time is made weights-only too (with these few data types allowed), never less strict, and a
lock keeps two such blocks from interleaving.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "RNG_STATE_TYPES",
    "TORCH_SUFFIXES",
    "UnsafePickleError",
    "deepspeed_types",
    "load_torch_file",
    "refusal_detail",
    "unsafe_files",
    "unsafe_pickle_problem",
    "weights_only_loads",
]

TORCH_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")
"""The file names torch, accelerate and DeepSpeed give ``torch.save`` files (zip archives holding a pickle)."""

_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses to load when both are set
_LOCK = threading.RLock()
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")

SafeGlobal = Any
"""What ``torch.serialization.safe_globals`` takes: a class or function, or (it, "the dotted name a file uses")."""


def _numpy_types() -> list[SafeGlobal]:
    """numpy's array reconstruction, under the name numpy 2 pickles it and the one numpy 1 did (a checkpoint
    written with numpy 1 still resumes), its dtype and the dtype class of a generator state (uint32)."""
    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 / numpy 1
    reconstruct = core.multiarray._reconstruct
    types: list[SafeGlobal] = [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25
    if dtypes is not None:
        types.append(dtypes.UInt32DType)
    return types


RNG_STATE_TYPES: list[SafeGlobal] = _numpy_types()
"""The types beyond torch's defaults that accelerate's ``random_states_<rank>.pkl`` holds (numpy's state is an
array of uint32); python's ``random`` state is a tuple of ints and torch's a tensor, allowed anyway."""


def deepspeed_types() -> list[SafeGlobal]:
    """The DeepSpeed classes of a ZeRO checkpoint's ``*_optim_states.pt`` (found by saving one with DeepSpeed
    0.19.8: stage 1 and 2 name exactly the first three; a dynamic fp16 loss scaler is the fourth)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address, DynamicLossScaler]


class UnsafePickleError(ValueError):
    """A torch file that names a function or class a checkpoint never needs (it was not loaded)."""


def _describe(name: str, unsafe: Sequence[str]) -> str:
    shown = ", ".join(sorted(unsafe)[:3]) + (f" and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
    return (
        f"{name} names {shown}, which no checkpoint needs; it was not loaded, since unpickling it would run "
        "that code (a file from someone else, or not written by ddp-rank)"
    )


def refusal_detail(exc: BaseException) -> str:
    """The line of a weights-only refusal that says what was refused (torch's first line only says that the
    default of ``weights_only`` changed in PyTorch 2.6), prefixed with the exception's type."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "WeightsUnpickler error" in line]
    useful = named or [line for line in lines if not line.startswith("Weights only load failed")] or lines
    return f"{type(exc).__name__}: {useful[0]}" if useful else type(exc).__name__


def unsafe_pickle_problem(path: str | os.PathLike[str], allowed: Sequence[SafeGlobal] = ()) -> str | None:
    """Why the torch file ``path`` must not be unpickled, in one line; None when it may be loaded.

    Refused: a file that names a global outside torch's defaults and ``allowed`` (the static scan), one whose
    weights-only load still fails (a global the scan cannot see: the file is loaded with ``mmap``, so its
    tensors' bytes are not read), and one that is not a ``torch.save`` zip archive."""
    p = Path(path)
    with torch.serialization.safe_globals(list(allowed)):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(p))
        except Exception as exc:  # a raw pickle (no zip), a TorchScript archive, a damaged file
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"{p.name} is not a torch.save archive ({first}); it was not loaded"
        if unsafe:
            return _describe(p.name, unsafe)
        try:
            torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            named = _GLOBAL_RE.search(str(exc))
            if named is not None:
                return _describe(p.name, [named.group(1)])
            return f"{p.name} cannot be read weights-only ({refusal_detail(exc)}); it was not loaded"
    return None


def load_torch_file(
    path: str | os.PathLike[str], allowed: Sequence[SafeGlobal] = (), mmap: bool = False
) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU with ``allowed`` types, after the scan above; raises
    :class:`UnsafePickleError` (one line naming the file and the globals) instead of loading a file that
    names anything else."""
    problem = unsafe_pickle_problem(path, allowed)
    if problem is not None:
        raise UnsafePickleError(problem)
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise UnsafePickleError(
                f"{Path(path).name} cannot be read weights-only ({refusal_detail(exc)}); it was not loaded"
            ) from None


def unsafe_files(directory: str | os.PathLike[str], allowed: Sequence[SafeGlobal] = ()) -> str | None:
    """The first torch file under ``directory`` (sub-folders included: DeepSpeed's) that
    :func:`unsafe_pickle_problem` refuses, as its one line with the path relative to ``directory``; or None."""
    root = Path(directory)
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in TORCH_SUFFIXES:
            problem = unsafe_pickle_problem(p, allowed)
            if problem is not None:
                return problem.replace(p.name, p.relative_to(root).as_posix(), 1)
    return None


@contextmanager
def weights_only_loads(allowed: Sequence[SafeGlobal] = ()) -> Iterator[None]:
    """Within the block, every ``torch.load`` (accelerate's and DeepSpeed's included) is weights-only with
    ``allowed`` types added to torch's defaults; both restored on exit (see the module docstring)."""
    with _LOCK:
        saved = {name: os.environ.get(name) for name in (_FORCE, _FORCE_NOT)}
        os.environ[_FORCE] = "1"
        os.environ.pop(_FORCE_NOT, None)
        try:
            with torch.serialization.safe_globals(list(allowed)):
                yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
