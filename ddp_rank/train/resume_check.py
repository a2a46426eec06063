"""What changed between a checkpoint's config and the config a resume is started with.

Why: accelerate restores the optimizer with the hyper-parameters it was saved with, so a changed ``optim.lr``
was silently ignored; a changed model or optimizer failed deep inside ``load_state`` (``size mismatch``,
``KeyError: 'momentum'``). The trainer compares first, refuses with the list below unless
``train.force_resume=true``, and when forced makes the new values apply.

Compared: every ``model`` key except those that only choose the initial values (``weights``, ``init_from``: the
checkpoint replaces them anyway), every ``optim`` key, and the length of the run when the learning-rate
schedule depends on it (cosine and linear decay end at the last step). A change is *structural* when the saved
state cannot be loaded as it is (other parameters, other optimizer state); a forced resume then loads the
weights that fit and starts the optimizer afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddp_rank.config import Config, to_dict

__all__ = ["ConfigChange", "describe_changes", "resume_changes"]

INIT_ONLY_KEYS = ("weights", "init_from")
STRUCTURAL = {("model", "backbone"), ("model", "embedding_dim"), ("model", "pooling"), ("optim", "name")}


@dataclass(frozen=True)
class ConfigChange:
    """One difference: ``key`` (``optim.lr``), the checkpoint's value and this config's."""

    key: str
    saved: Any
    new: Any
    structural: bool


def resume_changes(meta: dict[str, Any], cfg: Config, total_steps: int | None = None) -> list[ConfigChange]:
    """The model / optimizer differences between a checkpoint's ``meta.json`` and ``cfg``.

    Keys a checkpoint predates are compared with their defaults (what that run used). A checkpoint without a
    stored config (older format) yields no difference.
    """
    saved_all = meta.get("config")
    if not isinstance(saved_all, dict):
        return []
    defaults, current = to_dict(Config()), to_dict(cfg)
    changes = []
    for section in ("model", "optim"):
        saved = {**defaults[section], **(saved_all.get(section) or {})}
        for key, new in current[section].items():
            if section == "model" and key in INIT_ONLY_KEYS:
                continue
            old = saved.get(key)
            if isinstance(new, list) and isinstance(old, (list, tuple)):
                old = list(old)
            if old != new:
                changes.append(ConfigChange(f"{section}.{key}", old, new, (section, key) in STRUCTURAL))
    if total_steps is not None and cfg.optim.schedule in ("cosine", "linear"):
        saved_total = meta.get("total_steps")
        if saved_total is not None and int(saved_total) != total_steps:
            changes.append(
                ConfigChange("schedule length (train.steps / epochs)", saved_total, total_steps, False)
            )
    return changes


def describe_changes(changes: list[ConfigChange]) -> str:
    """``optim.lr: 1e-05 -> 0.001, model.embedding_dim: 512 -> 128``."""
    return ", ".join(f"{c.key}: {c.saved!r} -> {c.new!r}" for c in changes)
