"""Reading a run's checkpoints: where they are, which one is complete, best or latest, and its model weights.

This is the read side of the layout ``train.checkpoints.write`` writes (``<run>/checkpoints/step-NNNNNNNN/``
with ``meta.json`` written last, ``best.json`` beside them). Training, evaluation, export and ``init_from`` all
read checkpoints; only training writes them, so the reading lives here, below both.

Every file is checked before a parser sees it (:func:`checkpoint_problem`): ``meta.json`` records the size and
SHA-256 of every other file of its checkpoint (``files``), and a missing file, a size or a digest that differs
is reported by name. Checkpoints written before that record existed are checked by structure: a
``.safetensors`` file's header must describe exactly the bytes the file holds, and a torch file (``.bin``,
``.pkl``, ``.pt``: a zip archive) must have its central directory and the CRC-32 of every member right. A resume
skips a damaged checkpoint for the newest intact one (:func:`newest_intact_checkpoint`); evaluation, export and
``init_from`` refuse it (:func:`verify_checkpoint`), naming the file and the intact checkpoint to use instead.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

from ddp_rank.file_checks import recorded_problem
from ddp_rank.model.safe_pickles import TORCH_SUFFIXES, UnsafePickleError, load_torch_file

__all__ = [
    "BEST_NAME",
    "FILES_KEY",
    "META_NAME",
    "CheckpointError",
    "checkpoint_problem",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_model_weights",
    "newest_intact_checkpoint",
    "read_best",
    "read_meta",
    "resolve_checkpoint",
    "verify_checkpoint",
]

META_NAME = "meta.json"
BEST_NAME = "best.json"
STEP_RE = re.compile(r"^step-(\d+)$")
FILES_KEY = "files"
"""The key of ``meta.json`` that records every other file of the checkpoint: ``{name: {bytes, sha256}}``."""
_MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says why and how to proceed."""


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint directory (raises :class:`CheckpointError` if it is not complete or
    not a JSON object)."""
    p = Path(path) / META_NAME
    if not p.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {META_NAME}); pick a step-* directory"
        )
    meta, problem = _parse_meta(p)
    if meta is None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; use another checkpoint of the run")
    return meta


def _parse_meta(p: Path) -> tuple[dict[str, Any] | None, str]:
    """(the content of ``meta.json`` or None, why it is not usable)."""
    try:
        meta = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"{META_NAME} is not valid JSON ({_first_line(exc)})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return None, f"{META_NAME} is not a checkpoint record (a JSON object with its step)"
    return meta, ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _safetensors_problem(path: Path) -> str | None:
    """Why the header of a ``.safetensors`` file does not describe the file (cut short, garbled), or None."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{path.name} has {size} bytes, less than a safetensors header (truncated)"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_SAFETENSORS_HEADER):
            return (
                f"{path.name}'s header claims {n} bytes, the file has {size} (truncated or not safetensors)"
            )
        try:
            header = json.loads(fh.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path.name}'s header is not valid safetensors JSON (damaged)"
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        return f"{path.name} has {size} bytes where its header describes {expected} (truncated or damaged)"
    return None


def _torch_zip_problem(path: Path) -> str | None:
    """Why a torch file (a zip archive since torch 1.6) is not whole: no central directory, a bad CRC."""
    if not zipfile.is_zipfile(path):
        return f"{path.name} is not a complete torch file (no zip directory: truncated or damaged)"
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        return f"{path.name} is damaged ({_first_line(exc)})"
    return f"{path.name} is damaged (member {bad} fails its CRC-32)" if bad is not None else None


def _structure_problem(checkpoint: Path) -> str | None:
    """The checks of a checkpoint without a record of its files (written by an older version)."""
    for path in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        if path.suffix == ".safetensors":
            problem = _safetensors_problem(path)
        elif path.suffix in TORCH_SUFFIXES:
            problem = _torch_zip_problem(path)
        else:
            continue
        if problem is not None:
            return problem
    return None


def checkpoint_problem(checkpoint: str | os.PathLike[str]) -> str | None:
    """What is wrong with the files of a complete checkpoint directory (one line), or None when it is intact.

    With a record in ``meta.json`` (every checkpoint this version writes): each recorded file must exist with
    its size and SHA-256; files not recorded are ignored. Without one (an older version, or a folder of weights
    without ``meta.json``): the structural checks of the module docstring. ``meta.json``, where there is one,
    must be a JSON object with the step."""
    path = Path(checkpoint)
    if not path.is_dir():
        return None  # nothing to check: the reader says what is missing
    if not (path / META_NAME).is_file():
        return _structure_problem(path)  # a folder of weights without a record (e.g. written by hand)
    meta, problem = _parse_meta(path / META_NAME)
    if meta is None:
        return problem
    if FILES_KEY in meta:
        return recorded_problem(path, meta[FILES_KEY], META_NAME)
    return _structure_problem(path)


def verify_checkpoint(checkpoint: str | os.PathLike[str]) -> Path:
    """``checkpoint`` if its files are intact; else a :class:`CheckpointError` naming the damaged file, the
    problem and the newest intact checkpoint of the same run to use instead."""
    path = Path(checkpoint)
    problem = checkpoint_problem(path)
    if problem is None:
        return path
    step = _step_of(path)
    intact = newest_intact_checkpoint(path.parent, below=step)[0] if step is not None else None
    if intact is not None:
        instead = f"the newest intact checkpoint of the run is {intact}: pass it instead"
    elif step is not None:
        instead = "no older checkpoint of the run is intact: restore the file from a copy or train again"
    else:
        instead = "restore the file from a copy"
    raise CheckpointError(f"checkpoint {path} is damaged: {problem}; {instead}")


def _step_of(path: Path) -> int | None:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def newest_intact_checkpoint(
    root: str | os.PathLike[str], below: int | None = None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest complete checkpoint under ``root`` whose files are intact, or None; the newer ones skipped
    because they are damaged, as (path, problem), newest first). ``below`` only considers earlier steps."""
    damaged: list[tuple[Path, str]] = []
    for step, path in reversed(complete_checkpoints(root)):
        if below is not None and step >= below:
            continue
        problem = checkpoint_problem(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def complete_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as (step, path), oldest first (a ``step-*`` folder counts only once
    its ``meta.json`` exists: it is written last)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / META_NAME).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    ckpts = complete_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def read_best(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The content of ``root/best.json`` (step, metric, value, path) if a best checkpoint was recorded."""
    p = Path(root) / BEST_NAME
    if not p.is_file():
        return None
    try:
        best = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{p} is damaged ({_first_line(exc)}); delete it (the checkpoints themselves are kept)"
        ) from exc
    if not (
        isinstance(best, dict) and isinstance(best.get("step"), int) and isinstance(best.get("path"), str)
    ):
        raise CheckpointError(
            f"{p} is damaged (no step and path); delete it (the checkpoints themselves are kept)"
        )
    return best


def resolve_checkpoint(path: str | os.PathLike[str], prefer: str = "best") -> Path:
    """A checkpoint directory from a run directory (its best, else latest), a checkpoints/ folder, or itself."""
    p = Path(path)
    if (p / META_NAME).is_file():
        return p
    for root in (p / "checkpoints", p):
        if root.is_dir():
            best = read_best(root) if prefer == "best" else None
            if (
                best is not None
                and STEP_RE.match(best["path"])
                and (root / best["path"] / META_NAME).is_file()
            ):
                return root / best["path"]
            latest = latest_checkpoint(root)
            if latest is not None:
                return latest
    raise CheckpointError(
        f"no complete checkpoint at or under '{path}': pass a run directory or a step-* directory"
    )


def load_model_weights(model: Any, checkpoint: str | os.PathLike[str]) -> Path:
    """Load the model weights of an accelerate checkpoint directory into a bare (unwrapped) model.

    Reads ``model.safetensors`` (or ``pytorch_model.bin``), strips the ``module.`` prefix a DDP wrapper leaves,
    and loads strictly, so a checkpoint of another architecture fails with the mismatching keys.
    """

    ckpt = verify_checkpoint(checkpoint)
    st, pt = ckpt / "model.safetensors", ckpt / "pytorch_model.bin"
    if st.is_file() or pt.is_file():
        state = _read_weights_file(st if st.is_file() else pt)
    else:
        raise CheckpointError(
            f"{ckpt} holds no model.safetensors / pytorch_model.bin (a DeepSpeed checkpoint keeps the weights in "
            "its own layout: convert it with DeepSpeed's zero_to_fp32.py first)"
        )
    state = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in state.items()}
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    unexpected += [k for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt} does not fit this model: missing {missing[:3]}, unexpected or reshaped {unexpected[:3]}; "
            "use the config the run was trained with (its config.yaml)"
        )
    model.load_state_dict(state, strict=True)
    return ckpt


def _read_weights_file(path: Path) -> dict[str, Any]:
    """The state_dict in a checked ``model.safetensors`` / ``pytorch_model.bin``; what the parser still refuses
    (a file the checks could not judge) becomes a :class:`CheckpointError` naming it."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = load_torch_file(path)
    except UnsafePickleError as exc:
        raise CheckpointError(f"checkpoint {path.parent} is refused: {exc}") from None
    except Exception as exc:
        raise CheckpointError(
            f"{path} cannot be read ({_first_line(exc)}); use another checkpoint of the run"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state_dict; use another checkpoint of the run")
    return state
