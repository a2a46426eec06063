"""Reading a run's checkpoints: where they are, which one is complete, best or latest, and its model weights.

This is the read side of the layout ``ddp_rank.train.checkpoint`` writes (``<run>/checkpoints/step-NNNNNNNN/``
with ``meta.json`` written last, ``best.json`` beside them). Training, evaluation, export and ``init_from`` all
read checkpoints; only training writes them, so the reading lives here, below both.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "BEST_NAME",
    "META_NAME",
    "CheckpointError",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_model_weights",
    "read_best",
    "read_meta",
    "resolve_checkpoint",
]

META_NAME = "meta.json"
BEST_NAME = "best.json"
STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says why and how to proceed."""


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint directory (raises :class:`CheckpointError` if it is not complete)."""
    p = Path(path) / META_NAME
    if not p.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {META_NAME}); pick a step-* directory"
        )
    return json.loads(p.read_text())


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
    return json.loads(p.read_text()) if p.is_file() else None


def resolve_checkpoint(path: str | os.PathLike[str], prefer: str = "best") -> Path:
    """A checkpoint directory from a run directory (its best, else latest), a checkpoints/ folder, or itself."""
    p = Path(path)
    if (p / META_NAME).is_file():
        return p
    for root in (p / "checkpoints", p):
        if root.is_dir():
            best = read_best(root) if prefer == "best" else None
            if best is not None and (root / best["path"] / META_NAME).is_file():
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
    import torch

    ckpt = Path(checkpoint)
    st, pt = ckpt / "model.safetensors", ckpt / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        state = load_file(str(st))
    elif pt.is_file():
        state = torch.load(str(pt), map_location="cpu", weights_only=True)
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
