"""The training state ddp-rank writes itself beside accelerate's: the learning-rate schedule as JSON, a loss's own
parameters (a proxy loss's proxies) as safetensors. Neither format can hold code.

Why not ``accelerator.register_for_checkpointing``: accelerate 1.15 restores registered objects from
``custom_checkpoint_<i>.pkl`` with ``torch.load(weights_only=False)`` (``load_custom_state``), so such a file from
someone else runs whatever it holds at resume. (Checkpoints of the versions that wrote those files do not
resume; their weights still start a run with ``model.init_from``.)

The scheduler's state (``last_epoch``, ``_step_count``, ``base_lrs``, ``_last_lr`` ...) is numbers, booleans,
strings and lists of them: it is checked to be exactly that when written and when read, and only the keys this
scheduler has are accepted (``LambdaLR.load_state_dict`` sets every key it is given as an attribute).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.model.checkpoint_read import CheckpointError

__all__ = ["LOSS_FILE", "SCHEDULER_FILE", "load_state_files", "plain_json", "save_state_files"]

SCHEDULER_FILE = "scheduler.json"
LOSS_FILE = "loss_state.safetensors"
FORMAT = 1


def plain_json(value: Any, where: str) -> Any:
    """``value`` with tuples as lists, if it is made of None, booleans, ints, finite floats, strings, lists and
    dicts with string keys only; else a ValueError naming the key path ``where``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}, which JSON cannot hold")
        return value
    if isinstance(value, (list, tuple)):
        return [plain_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where} has keys that are not strings")
        return {k: plain_json(v, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}, not a number, string, list or mapping")


def save_state_files(directory: Path, scheduler: Any, loss: nn.Module | None) -> None:
    """Write ``scheduler.json`` and, for a loss with parameters, ``loss_state.safetensors`` (main rank only)."""
    try:
        state = plain_json(scheduler.state_dict(), "the scheduler's state")
    except ValueError as exc:
        raise CheckpointError(
            f"{exc}: the scheduler cannot be saved as JSON; use the schedules of optim.schedule"
        ) from None
    record = {"format": FORMAT, "class": type(scheduler).__name__, "state": state}
    atomic_write_text(directory / SCHEDULER_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")
    if loss is not None:
        from safetensors.torch import save_file

        tensors = {k: v.detach().cpu().contiguous() for k, v in loss.state_dict().items()}
        save_file(tensors, str(directory / LOSS_FILE))


def load_state_files(directory: Path, scheduler: Any, loss: nn.Module | None) -> None:
    """Restore the scheduler and the loss's parameters of a checkpoint; a :class:`CheckpointError` in one line
    naming the file when they are missing or hold anything else."""
    scheduler.load_state_dict(_scheduler_state(directory, scheduler))
    if loss is not None:
        state = _loss_state(directory)
        own = loss.state_dict()
        if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
            raise CheckpointError(
                f"checkpoint {directory}: the loss state ({', '.join(sorted(state)) or 'none'}) does not fit "
                f"this loss ({', '.join(sorted(own))}); resume with the loss.name the run was trained with"
            )
        loss.load_state_dict(state)


def _refuse(directory: Path, name: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {directory}: {name} {why}; resume from another checkpoint of the run, or start afresh "
        "from its weights with model.init_from"
    )


def _scheduler_state(directory: Path, scheduler: Any) -> dict[str, Any]:
    """The saved scheduler state, checked: plain values, only keys this scheduler has."""
    current = scheduler.state_dict()
    name = SCHEDULER_FILE
    if not (directory / name).is_file():
        raise _refuse(directory, name, "is missing")
    try:
        record = json.loads((directory / name).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _refuse(directory, name, f"is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise _refuse(directory, name, f"is not a scheduler record of format {FORMAT}")
    state = record.get("state")
    if not isinstance(state, dict):
        raise _refuse(directory, name, "does not hold a scheduler state (a mapping)")
    try:
        state = plain_json(state, "its state")
    except ValueError as exc:
        raise _refuse(directory, name, f"holds more than plain values: {exc}") from None
    unknown = sorted(set(state) - set(current))
    if unknown:
        raise _refuse(
            directory, name, f"has keys this {type(scheduler).__name__} does not: {', '.join(unknown)}"
        )
    if "lr_lambdas" in state and state["lr_lambdas"] != current.get("lr_lambdas"):
        # LambdaLR copies a non-None entry into its function's __dict__: only what this scheduler has is taken.
        raise _refuse(directory, name, "holds another schedule function's state (lr_lambdas)")
    return state


def _loss_state(directory: Path) -> dict[str, torch.Tensor]:
    if not (directory / LOSS_FILE).is_file():
        raise _refuse(directory, LOSS_FILE, "is missing")
    from safetensors.torch import load_file

    try:
        return load_file(str(directory / LOSS_FILE))
    except Exception as exc:
        raise _refuse(directory, LOSS_FILE, f"cannot be read ({type(exc).__name__})") from None
