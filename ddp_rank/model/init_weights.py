"""``model.init_from``: start a new run from another run's weights (backbone and head), nothing else.

Distinct from ``train.resume``, which continues a run (optimizer state, step counter, RNG). Here only the
weights travel, and only those that fit: a key of the same name and shape is copied, every other key keeps its
fresh initialisation and is reported, so a new head size (``model.embedding_dim``) or a changed pooling just
shows up in the report instead of failing. A source that fits nothing is an error (the wrong backbone, most
likely).

Sources: a run directory (its best checkpoint, else its latest), a checkpoints/ folder, a ``step-*`` checkpoint
directory, or a weights file: ``.safetensors`` or a torch file (``.pth``/``.pt``/``.bin``) of the whole
network's state_dict (common wrappers and the ``module.`` prefix of DDP are removed). A file that holds only a
backbone's weights (its keys lack the ``backbone.`` prefix) is matched against the backbone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_rank.model.checkpoint_read import CheckpointError, resolve_checkpoint, verify_checkpoint
from ddp_rank.model.safe_pickles import UnsafePickleError, load_torch_file

__all__ = ["InitReport", "init_from", "read_weights"]

_CONTAINERS = ("state_dict", "model", "model_state_dict")


@dataclass
class InitReport:
    """What :func:`init_from` copied and what it left at its fresh initialisation."""

    source: Path
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Keys of the model the source does not have: left as initialised."""
    unexpected: list[str] = field(default_factory=list)
    """Keys of the source the model does not have: ignored."""
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Keys present in both with different shapes: ``{key: (source shape, model shape)}``, left as initialised."""

    def summary(self) -> str:
        """One paragraph for the log: counts, then the keys that did not fit."""
        lines = [f"model.init_from={self.source}: loaded {len(self.loaded)} tensors"]
        if self.mismatched:
            shapes = ", ".join(f"{k} {list(a)} -> {list(b)}" for k, (a, b) in self.mismatched.items())
            lines.append(f"  kept freshly initialised (shape differs): {shapes}")
        if self.missing:
            lines.append(f"  kept freshly initialised (not in the source): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  ignored (not in this model): {', '.join(self.unexpected)}")
        return "\n".join(lines)


def _weights_file(source: Path) -> Path:
    """The weights file of a checkpoint, run directory or file path."""
    if source.is_file():
        return source
    try:
        ckpt = resolve_checkpoint(source, prefer="best")
    except CheckpointError as exc:
        raise CheckpointError(
            f"model.init_from='{source}': not a weights file and {exc}; pass a run directory, a step-* "
            "checkpoint or a .safetensors/.pth file"
        ) from exc
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as exc:
        raise CheckpointError(f"model.init_from='{source}': {exc}") from exc
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (ckpt / name).is_file():
            return ckpt / name
    raise CheckpointError(
        f"model.init_from='{source}': {ckpt} holds no model.safetensors / pytorch_model.bin (a DeepSpeed "
        "checkpoint keeps its weights in its own layout: convert it with DeepSpeed's zero_to_fp32.py first)"
    )


def read_weights(source: str | os.PathLike[str]) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file read, its state_dict) for a run, a checkpoint or a weights file; wrappers unwrapped."""
    path = _weights_file(Path(source))
    state: Any
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = load_torch_file(path)
    except UnsafePickleError as exc:
        raise CheckpointError(f"model.init_from='{source}': {path.parent} is refused: {exc}") from None
    except Exception as exc:
        kind = "a safetensors" if path.suffix == ".safetensors" else "a torch weights"
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"model.init_from='{source}': {path} is not {kind} file or is damaged ({type(exc).__name__}: {first})"
        ) from exc
    for key in _CONTAINERS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"model.init_from='{source}': {path} does not hold a state_dict of tensors")
    return path, {k.removeprefix("module."): v for k, v in state.items()}


def init_from(model: nn.Module, source: str | os.PathLike[str]) -> InitReport:
    """Copy the weights of ``source`` that fit ``model`` (same key, same shape); report the others."""
    path, state = read_weights(source)
    own = model.state_dict()
    if not any(k in own for k in state) and any(f"backbone.{k}" in own for k in state):
        state = {f"backbone.{k}": v for k, v in state.items()}  # a backbone-only file
    report = InitReport(source=path)
    fitting: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k not in own:
            report.unexpected.append(k)
        elif tuple(v.shape) != tuple(own[k].shape):
            report.mismatched[k] = (tuple(v.shape), tuple(own[k].shape))
        else:
            fitting[k] = v
    report.missing = [k for k in own if k not in state]
    report.loaded = list(fitting)
    if not fitting:
        raise CheckpointError(
            f"model.init_from='{source}': none of its {len(state)} tensors fits this model (e.g. "
            f"{next(iter(state), 'none')}); it was trained with another model.backbone, set the same one"
        )
    model.load_state_dict(fitting, strict=False)
    return report
