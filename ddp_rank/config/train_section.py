"""The ``train`` section: the loop around the optimizer: length, precision, checkpoints, logging."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import model_validator

from ddp_rank.config.checks import (
    Bool,
    ConfigError,
    Float,
    Int,
    ListOf,
    Text,
    _field,
    _Section,
)

StopSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"]
"""Signals that ``train.stop_signals`` may name (a worker process ignores them all: the main process decides)."""
Tracker = Literal[
    "tensorboard", "wandb", "mlflow", "aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio"
]
"""The experiment trackers of accelerate that ``train.log_with`` may name."""


class TrainConfig(_Section):
    """The loop: length, precision, checkpoints, logging."""

    output_dir: Text = _field(
        "runs/default", "Run directory: config.yaml, checkpoints/, metrics.jsonl, plots, summary."
    )
    epochs: Int = _field(
        1, "Epochs (an epoch is the sampler's schedule: e.g. SOP hard = 66 pairs x 5 = 330 steps).", minimum=1
    )
    steps: Int = _field(0, "Total optimizer steps; overrides epochs when > 0.", minimum=0)
    seed: Int = _field(
        0,
        "Seed of the model's initial weights (the embedding head's, and the backbone's without pretrained weights) "
        "and of dropout; also of the data schedule and the augmentations unless data.seed is set (PNP: 0).",
        minimum=0,
    )
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = _field(
        "auto",
        "Autocast precision (the losses compute in float32 whatever this is); 'auto' = the launcher's "
        "(accelerate's --mixed_precision or its config file), else 'no'. A value here that contradicts a "
        "launcher asking for fp16/bf16 is an error.",
    )
    deterministic: Bool = _field(
        False,
        "Deterministic algorithms everywhere (torch.use_deterministic_algorithms, cuDNN without autotuning, "
        "float atomics replaced by sorted kernels): two runs, and a killed-and-resumed run, give bit-identical "
        "weights on a GPU as on CPU. Slower on GPUs (benchmarks/train.py measures it); CPU runs are deterministic anyway.",
    )
    deterministic_fill: Bool = _field(
        False,
        "With train.deterministic: also fill every fresh tensor with NaN (torch.utils.deterministic."
        "fill_uninitialized_memory), so that a kernel reading memory it never wrote shows as NaN. A write per "
        "allocation: a check to run when a deterministic run still varies, not a setting to train with.",
    )
    log_every: Int = _field(10, "Steps between metrics.jsonl records and progress-bar updates.", minimum=1)
    checkpoint_every: Int = _field(
        0, "Steps between periodic checkpoints; 0 = only at the end of each epoch.", minimum=0
    )
    keep_last: Int = _field(3, "Periodic/epoch checkpoints kept (the best one is kept as well).", minimum=1)
    eval_every: Int = _field(
        0, "Steps between evaluations on data.test_split; 0 = at the end of every epoch.", minimum=0
    )
    eval_at_start: Bool = _field(
        False, "Also evaluate before the first step (logged as step 0: the network before training)."
    )
    best_metric: Text = _field(
        "recall@1", "Evaluation metric that selects the best checkpoint (higher is better)."
    )
    resume: Text = _field(
        "auto",
        "'auto' = continue from the latest checkpoint in output_dir if there is one, 'never' = start afresh "
        "(refused if output_dir holds checkpoints), or a checkpoint to continue from (a step-* directory, or a "
        "run directory: its latest checkpoint), with its optimizer state and step counter. Continuing at an "
        "earlier step than output_dir's latest checkpoint moves the later ones to checkpoints/abandoned-<time>/. "
        "To start a new run from another run's weights only, use model.init_from.",
    )
    force_resume: Bool = _field(
        False,
        "Resume even when the checkpoint differs from this config: another world size or data schedule, a "
        "changed model or optimizer (name or hyper-parameters), saved weights of another shape (a ViT after a new "
        "data.image_size). Without it such a resume is refused with the "
        "list of differences; with it the new values apply (and are listed in the log).",
    )
    stop_signals: Annotated[list[StopSignal], ListOf] = _field(
        ["SIGTERM", "SIGUSR1"],
        "Signals that stop the run with a checkpoint: on any rank, every rank stops together after the next "
        "step, writes a checkpoint and exits with status 75 (EX_TEMPFAIL: 'start me again'); train.resume=auto "
        "then continues exactly there. A second signal (a few seconds after the first, so a launcher "
        "forwarding the scheduler's signal is not one) exits at once. SLURM: #SBATCH --signal=USR1@300.",
    )
    stop_grace_s: Float = _field(
        0.0,
        "After a stop signal, exit at once if the checkpoint is not written within this many seconds (0 = no "
        "limit of our own; the scheduler's kill is the limit). A checkpoint cut short is never left as one: the "
        "previous checkpoints stay, and the next start removes the partial one.",
        minimum=0,
    )
    requeue: Literal["auto", "never"] = _field(
        "auto",
        "After a stop signal's checkpoint: 'auto' = under SLURM, rank 0 requeues the job (scontrol requeue "
        "$SLURM_JOB_ID) so that it continues when it runs again; 'never' = only exit with status 75.",
    )
    log_with: Annotated[list[Tracker], ListOf] = _field(
        [],
        "Experiment trackers that also receive the metrics and pictures, through accelerate's tracker API "
        "(rank 0): 'tensorboard' (event files under OUTPUT_DIR/tensorboard/), 'mlflow' (MLFLOW_TRACKING_URI, "
        "else a file store in OUTPUT_DIR/mlruns), 'wandb' (WANDB_MODE=offline works), 'aim', 'comet_ml', "
        "'clearml', 'dvclive', 'swanlab', 'trackio'; each needs its package (tensorboard, mlflow and wandb: the "
        "extra of that name, docs/install.md). "
        "metrics.jsonl and the PNG plots are written whatever this holds.",
    )
    tracker_project: Text = _field(
        "ddp_rank",
        "train.log_with: the project (W&B, TensorBoard's folder), experiment (MLflow, Aim) the run is logged "
        "under; the run is named after OUTPUT_DIR's last folder.",
    )
    progress: Bool = _field(
        True,
        "On a terminal, show the rank-0 progress bar (loss, images/s, ETA); without a terminal (a SLURM log), or "
        "with false, rank 0 prints one timestamped line per log_every steps (step, loss, images/s, data time, "
        "learning rates, memory, ETA).",
    )
    plots: Bool = _field(True, "Write PNG plots of the loss and Recall@k curves (needs matplotlib).")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if not self.resume.strip():
            # An empty path would be Path(""): the checkpoints/ of whatever directory the job starts in.
            raise ConfigError(
                "train.resume is empty; set it to 'auto' (continue the latest checkpoint in train.output_dir), "
                "'never' (start afresh) or the path of a checkpoint or run directory to continue from"
            )
        return self
