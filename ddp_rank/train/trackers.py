"""The run's experiment trackers, the accelerate way: ``train.log_with`` -> ``Accelerator(log_with=...)``.

accelerate owns the trackers (TensorBoard, W&B, MLflow, Aim, ...): the trainer's accelerator is built with
``log_with`` and a logging directory (:func:`tracker_arguments`), rank 0 starts them with the run's config
(:func:`start_trackers`), every metrics record goes through ``accelerator.log`` and every picture through each
started tracker that takes pictures (:func:`log_picture`); ``accelerator.end_training()`` closes them. An
accelerator the caller builds must carry the trackers itself (:func:`run_accelerator`). ``metrics.jsonl`` stays
the run's own record whatever is tracked.

Why the package check here: accelerate leaves out a tracker whose package is missing with a debug message only, so
``train.log_with=[mlflow]`` without mlflow would train and log nothing. The run is refused instead, in one line.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from ddp_rank.config import Config, ConfigError, DistributedConfig, TrainConfig
from ddp_rank.extras import install_hint
from ddp_rank.runtime import TrainError
from ddp_rank.runtime.accelerator import start_accelerator
from ddp_rank.train.run_outputs import ConfigRecord

log = logging.getLogger(__name__)

__all__ = [
    "accelerator_trackers",
    "check_trackers",
    "log_metrics",
    "log_picture",
    "run_accelerator",
    "start_trackers",
    "tracker_arguments",
    "tracker_config",
    "tracker_key",
]

_MODULES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "aim": ("aim", "aim"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
    "trackio": ("trackio", "trackio"),
}
"""Tracker -> (the module accelerate imports, the package that provides it)."""
_EXTRAS = ("tensorboard", "mlflow", "wandb")
"""Trackers with an extra of their own in pyproject.toml."""


def check_trackers(names: list[str]) -> None:
    """Refuse a tracker whose package is not installed (accelerate would drop it without a word)."""
    for name in names:
        module, package = _MODULES[name]
        if importlib.util.find_spec(module) is None:
            extra = f" (or, at the tested version, {install_hint(name)})" if name in _EXTRAS else ""
            raise ConfigError(
                f"train.log_with={name} needs the {package} package: pip install {package}{extra}, or leave "
                f"{name} out of train.log_with"
            )


def tracker_arguments(cfg: Config) -> dict[str, Any]:
    """The ``Accelerator`` keyword arguments of ``cfg``'s ``train.log_with`` (:func:`accelerator_trackers`):
    ``make_accelerator(cfg, tracker_arguments(cfg))`` builds an accelerator a ``Trainer`` accepts."""
    return accelerator_trackers(cfg.train.log_with, cfg.train.output_dir)


def accelerator_trackers(log_with: Sequence[str], output_dir: str) -> dict[str, Any]:
    """The ``Accelerator`` keyword arguments of ``log_with`` (none when it is empty): the trackers and
    ``OUTPUT_DIR/tensorboard`` as the logging directory (TensorBoard and Aim write under it)."""
    names = list(log_with)
    if not names:
        return {}
    check_trackers(names)
    from accelerate.utils import ProjectConfiguration

    out = Path(output_dir)
    return {
        "log_with": names,
        "project_config": ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tensorboard")),
    }


def run_accelerator(
    train: TrainConfig, distributed: DistributedConfig, accelerator: Any | None = None
) -> Any:
    """The trainer's accelerator: made from the ``distributed`` section and ``train.mixed_precision`` with the
    trackers of ``train.log_with`` (:func:`accelerator_trackers`), or the caller's, refused unless it was built
    with them. accelerate takes the trackers only when the Accelerator is made, so one built without them would
    log nothing: ``accelerator.log`` drops every record without a word."""
    if accelerator is None:
        trackers = accelerator_trackers(train.log_with, train.output_dir)
        return start_accelerator(distributed, train.mixed_precision, trackers)
    # accelerate's log_with: a LoggerType per named tracker (its text is the name), or a custom tracker object.
    kept = getattr(accelerator, "log_with", None) or []
    carried = {str(t) if isinstance(t, (str, Enum)) else str(getattr(t, "name", t)) for t in kept}
    missing = [name for name in train.log_with if name not in carried]
    if missing:
        raise TrainError(
            f"train.log_with={list(train.log_with)} but the accelerator passed to Trainer carries no "
            f"{', '.join(missing)} tracker: build it with Accelerator(log_with={list(train.log_with)}, "
            f"project_dir=OUTPUT_DIR), or with ddp_rank.runtime.make_accelerator(cfg, tracker_arguments(cfg)), "
            f"or pass no accelerator"
        )
    return accelerator


def tracker_config(config: ConfigRecord) -> dict[str, Any]:
    """The config as flat ``section.key`` values of the types every tracker accepts (lists as text)."""
    flat: dict[str, Any] = {}
    for section, values in config.values.items():
        for key, value in values.items():
            ok = value is None or isinstance(value, (bool, int, float, str))
            flat[f"{section}.{key}"] = value if ok else str(value)
    return flat


def start_trackers(accelerator: Any, train: TrainConfig, config: ConfigRecord) -> None:
    """Start the trackers of ``train.log_with`` on rank 0, the run named after its output folder, with the whole
    ``config`` as its hyper-parameters. MLflow logs to MLFLOW_TRACKING_URI, else to a file store in
    ``OUTPUT_DIR/mlruns`` (nothing leaves the machine)."""
    if not train.log_with or not accelerator.is_main_process:
        return
    out = Path(train.output_dir).resolve()
    run = out.name
    if "mlflow" in train.log_with and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow

        # MLflow 3 refuses a file store unless this is set (its database store needs SQLAlchemy, which
        # mlflow-skinny lacks); a user who set it either way keeps their choice.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri((out / "mlruns").as_uri())
    accelerator.init_trackers(
        train.tracker_project,
        config=tracker_config(config),
        init_kwargs={"wandb": {"name": run, "dir": str(out)}, "mlflow": {"run_name": run}},
    )


def tracker_key(kind: str, name: str) -> str:
    """The name a metric is logged under: ``kind/name`` with ``@`` spelled ``_at_`` and any other character
    MLflow refuses (it takes letters, digits, ``_ - . : /`` and spaces) as ``_``: ``eval/recall_at_1``,
    ``eval/tpr_at_fpr_1e-3``. One spelling for every tracker, so the runs of two trackers compare."""
    spelled = f"{kind}/{name}".replace("@", "_at_")
    return re.sub(r"[^A-Za-z0-9_\-.:/ ]", "_", spelled)


def log_metrics(accelerator: Any, kind: str, step: int, values: Mapping[str, float]) -> None:
    """One metrics record to every tracker, each number under :func:`tracker_key`."""
    if values:
        accelerator.log({tracker_key(kind, k): v for k, v in values.items()}, step=step)


def log_picture(accelerator: Any, name: str, path: str | os.PathLike[str], step: int) -> None:
    """A PNG to each started tracker that takes pictures: an image for TensorBoard, W&B, Aim, ClearML and the
    others with ``log_images``, an artifact under ``name/step-<step>/`` for MLflow. A tracker that fails (its
    server down, its API changed) costs one warning naming it, not the training run: the picture is also a file
    of the run."""
    trackers = list(getattr(accelerator, "trackers", None) or [])
    if not trackers or not accelerator.is_main_process:
        return
    import numpy as np
    from PIL import Image

    with Image.open(path) as opened:
        picture = np.asarray(opened.convert("RGB"))
    for tracker in trackers:
        tracker_name = getattr(tracker, "name", type(tracker).__name__)
        try:
            if tracker_name == "mlflow":
                tracker.log_artifact(str(path), artifact_path=f"{name}/step-{step:08d}")
            elif tracker_name == "tensorboard":
                tracker.log_images({name: picture[None]}, step=step, dataformats="NHWC")
            elif tracker_name in ("aim", "clearml"):  # one array per key, not a list of them
                tracker.log_images({name: picture}, step=step)
            elif hasattr(tracker, "log_images"):
                tracker.log_images({name: [picture]}, step=step)
        except Exception as error:  # any tracker's own failure: the run goes on
            log.warning(
                "the %s tracker could not take the picture %s of step %d: %s", tracker_name, name, step, error
            )
