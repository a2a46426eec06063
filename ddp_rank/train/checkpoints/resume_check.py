"""What changed between a checkpoint's config and the config a resume is started with.

Why: accelerate restores the optimizer with the hyper-parameters it was saved with, so a changed ``optim.lr``
was silently ignored; a changed model or optimizer failed deep inside ``load_state`` (``size mismatch``,
``KeyError: 'momentum'``). The trainer compares first, refuses with the list below unless
``train.force_resume=true``, and when forced makes the new values apply.

Compared: every ``model`` key except those that only choose the initial values (``weights``, ``init_from``: the
checkpoint replaces them anyway), every ``optim`` key, every ``loss`` key except those that only choose how it is
computed (a run resumed with another loss would silently train another objective from the same step), and the length of the run when the learning-rate
schedule depends on it (cosine and linear decay end at the last step). A change is *structural* when the saved
state cannot be loaded as it is (other parameters, other optimizer state); a forced resume then loads the
weights that fit and starts the optimizer afresh.

The config does not decide every shape: a timm ViT's position embeddings follow ``data.image_size``, for one.
So :func:`tensor_changes` also compares the shapes of the checkpoint's saved weights with the model's (read from
the file's header, not loaded), and any difference is structural too: listed per tensor, refused unless forced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_rank.train.run_outputs import ConfigRecord

__all__ = ["ConfigChange", "describe_changes", "resume_changes", "saved_shapes", "tensor_changes"]

INIT_ONLY_KEYS = ("weights", "init_from")
HOW_COMPUTED_LOSS_KEYS = ("kernel", "matmul_precision", "memory_budget_mb")
"""``loss`` keys that choose how the same loss is computed (the kernel, the matmuls' precision, the work space),
not what is trained: a resume may change them freely."""
STRUCTURAL = {
    ("model", "backbone"),
    ("model", "embedding_dim"),
    ("model", "pooling"),
    ("model", "output_stride"),
    ("optim", "name"),
}
TENSOR_PREFIX = "tensor "
"""Key prefix of a :class:`ConfigChange` that is a saved tensor of another shape (``tensor head.weight``)."""
SHOWN_TENSORS = 8
"""Tensor changes :func:`describe_changes` lists one by one (another backbone would list hundreds)."""


@dataclass(frozen=True)
class ConfigChange:
    """One difference: ``key`` (``optim.lr``), the checkpoint's value and this config's."""

    key: str
    saved: Any
    new: Any
    structural: bool

    @property
    def is_tensor(self) -> bool:
        """A saved weight of another shape (:func:`tensor_changes`), not a config key."""
        return self.key.startswith(TENSOR_PREFIX)


def _loss_state_changes(section: str, key: str, old: Any, new: Any) -> bool:
    """Whether another ``loss.name`` changes the saved state: a pytorch-metric-learning loss may hold parameters
    (ProxyAnchor's proxies) that the checkpoint and the optimizer carry; the listwise losses hold none."""
    names = (str(old), str(new))
    return (section, key) == ("loss", "name") and any(n.startswith("pml:") for n in names)


def resume_changes(
    meta: dict[str, Any], config: ConfigRecord, total_steps: int | None = None
) -> list[ConfigChange]:
    """The model / optimizer differences between a checkpoint's ``meta.json`` and this run's ``config``.

    Keys a checkpoint predates are compared with their defaults (what that run used). A checkpoint without a
    stored config (older format) yields no difference.
    """
    saved_all = meta.get("config")
    if not isinstance(saved_all, dict):
        return []
    defaults, current = config.defaults, config.values
    changes = []
    for section in ("model", "optim", "loss"):
        saved = {**defaults[section], **(saved_all.get(section) or {})}
        for key, new in current[section].items():
            if (section == "model" and key in INIT_ONLY_KEYS) or (
                section == "loss" and key in HOW_COMPUTED_LOSS_KEYS
            ):
                continue
            old = saved.get(key)
            if isinstance(new, list) and isinstance(old, (list, tuple)):
                old = list(old)
            if old != new:
                structural = (section, key) in STRUCTURAL or _loss_state_changes(section, key, old, new)
                changes.append(ConfigChange(f"{section}.{key}", old, new, structural))
    if total_steps is not None and current["optim"]["schedule"] in ("cosine", "linear"):
        saved_total = meta.get("total_steps")
        if saved_total is not None and int(saved_total) != total_steps:
            changes.append(
                ConfigChange("schedule length (train.steps / epochs)", saved_total, total_steps, False)
            )
    return changes


def saved_shapes(checkpoint: str | os.PathLike[str]) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of the model weights an accelerate checkpoint holds (``module.`` prefix removed), or
    None when it holds no ``model.safetensors`` / ``pytorch_model.bin`` (then nothing can be compared)."""
    st, pt = Path(checkpoint) / "model.safetensors", Path(checkpoint) / "pytorch_model.bin"
    shapes: dict[str, tuple[int, ...]] = {}
    if st.is_file():
        from safetensors import safe_open

        with safe_open(str(st), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[k] = tuple(f.get_slice(k).get_shape())
    elif pt.is_file():
        from ddp_rank.model.checkpoint_read import CheckpointError
        from ddp_rank.model.safe_pickles import UnsafePickleError, load_torch_file

        try:
            state = load_torch_file(pt, mmap=True)
        except UnsafePickleError as exc:
            raise CheckpointError(f"checkpoint {checkpoint} is refused: {exc}") from None
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    else:
        return None
    return {k.removeprefix("module."): v for k, v in shapes.items()}


def tensor_changes(checkpoint: str | os.PathLike[str], model: Any) -> list[ConfigChange]:
    """The weights of ``checkpoint`` whose shape differs from ``model``'s (a bare, unwrapped module), and those
    only one side has: each a structural :class:`ConfigChange` keyed ``tensor <name>``, shapes as lists."""
    saved = saved_shapes(checkpoint)
    if saved is None:
        return []
    state = model.state_dict()
    own = {k: tuple(v.shape) for k, v in state.items()}

    # accelerate writes one name per shared (tied) storage to safetensors: the other names are not missing.
    def storage(t: Any) -> int | None:
        return t.untyped_storage().data_ptr() if t.untyped_storage().nbytes() else None

    saved_storage = {storage(state[k]) for k in saved if k in state} - {None}
    tied = {k for k, v in state.items() if k not in saved and storage(v) in saved_storage}
    changes = []
    for k in sorted((saved.keys() | own.keys()) - tied):
        old, new = saved.get(k), own.get(k)
        if old != new:
            changes.append(
                ConfigChange(
                    TENSOR_PREFIX + k,
                    list(old) if old is not None else "absent",
                    list(new) if new is not None else "absent",
                    True,
                )
            )
    return changes


def describe_changes(changes: list[ConfigChange]) -> str:
    """``optim.lr: 1e-05 -> 0.001, model.embedding_dim: 512 -> 128``; tensors after the first few are counted."""
    shown, tensors = [], 0
    for c in changes:
        tensors += c.is_tensor
        if tensors <= SHOWN_TENSORS or not c.is_tensor:
            shown.append(f"{c.key}: {c.saved!r} -> {c.new!r}")
    if tensors > SHOWN_TENSORS:
        shown.append(f"and {tensors - SHOWN_TENSORS} more tensors of another shape")
    return ", ".join(shown)
