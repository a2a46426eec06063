"""``distributed.chunk_size=auto`` in a run: the choice before the model goes to its device, the trial step after.

The trainer calls :func:`choose_chunk_for_run` with the model still on the CPU (every rank measures and budgets,
``ddp_rank.train.chunking.choice``; all take the smallest chunk), and :func:`confirm_chunk_for_run` once the engine
holds the model on its device (one real step on every rank, backing off together on an out-of-memory error,
``ddp_rank.train.chunking.confirm``). Each returns the batch layout of the chunk it settled on; both log on rank 0
what they decided and from which figures.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ddp_rank.distributed import min_over_ranks
from ddp_rank.distributed.agreement import RankFailure, raise_if_any_failed
from ddp_rank.runtime import TrainError
from ddp_rank.train.backends import StepBackend
from ddp_rank.train.chunking.choice import ChunkChoice, auto_chunk, loss_work_space, most_positives
from ddp_rank.train.chunking.confirm import Confirmation, confirm_chunk, trial_step
from ddp_rank.train.chunking.layout import BatchLayout
from ddp_rank.train.step_settings import StepSettings

__all__ = ["choose_chunk_for_run", "confirm_chunk_for_run"]

log = logging.getLogger(__name__)


def choose_chunk_for_run(
    step: StepSettings,
    layout: BatchLayout,
    model: nn.Module,
    loss: nn.Module,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    largest_class: int,
    loss_parameters: list[nn.Parameter],
    deepspeed: bool,
    is_main: bool,
) -> tuple[BatchLayout, ChunkChoice]:
    """Collective: measure, choose, agree on the smallest chunk over the ranks. (The layout of that chunk, this
    rank's choice, whose figures the trial step uses.) A failure on any rank is a TrainError on every rank."""
    positives = most_positives(step.data, largest_class)
    work, _ = loss_work_space(loss, layout.local_batch, layout.global_batch, positives, device)
    extra = sum(p.numel() * p.element_size() for p in loss_parameters)
    error: str | None = None
    try:
        choice = auto_chunk(
            model,
            step,
            layout.local_batch,
            layout.global_batch,
            device,
            autocast_dtype,
            work,
            world_size=layout.world_size,
            deepspeed=deepspeed,
            extra_parameters=extra,
        )
    except ValueError as exc:  # not even one image fits
        error = str(exc)
    except RuntimeError as exc:  # the probe itself ran out of memory, say: every rank must hear of it
        error = f"the probe of the model failed: {type(exc).__name__}: {exc}"
    try:
        raise_if_any_failed(error)
    except RankFailure as exc:
        raise TrainError(f"distributed.chunk_size=auto: {exc}") from None
    chunk = min_over_ranks(choice.chunk or layout.local_batch)
    agreed = BatchLayout.from_settings(step, layout.world_size, chunk_size=chunk)  # whole BatchNorm groups
    if is_main:
        ranks = (
            f"; the smallest over the ranks: {chunk:,}"
            if chunk != (choice.chunk or layout.local_batch)
            else ""
        )
        log.info(choice.describe() + ranks + agreed.rounding_note(chunk))
    return agreed, choice


def confirm_chunk_for_run(
    step: StepSettings,
    layout: BatchLayout,
    choice: ChunkChoice,
    backend: StepBackend,
    device: torch.device,
    deepspeed: bool,
    is_main: bool,
) -> BatchLayout:
    """Collective: one real forward + backward of the agreed chunk on every rank before training starts, backing
    off together on an out-of-memory error; the layout of the final chunk. Skipped, and logged, where the trial
    would need a collective inside the step (DeepSpeed's gradient hooks, BatchNorm synchronised over ranks)."""
    skipped = (
        "DeepSpeed's gradient hooks reduce inside the backward"
        if deepspeed
        else "BatchNorm synchronised over the ranks exchanges statistics inside the forward"
        if layout.batchnorm.kind == "global"
        else None
    )
    if skipped:
        outcome = Confirmation(layout.chunk_size, (), False, skipped)
    else:
        outcome = _confirm(step, layout, choice, backend, device)
    if is_main:
        (log.warning if outcome.backed_off else log.info)(outcome.describe(layout.local_batch))
    if outcome.chunk == layout.chunk_size:
        return layout
    return BatchLayout.from_settings(step, layout.world_size, chunk_size=outcome.chunk or layout.local_batch)


def _confirm(
    settings: StepSettings,
    layout: BatchLayout,
    choice: ChunkChoice,
    backend: StepBackend,
    device: torch.device,
) -> Confirmation:
    # On CPU the budget bounds the trial's saved tensors; the probe's intercept (weights saved for the backward,
    # the parameters themselves) does not grow with the chunk.
    cpu = device.type != "cuda"
    limit = choice.budget_bytes + (choice.probe.intercept if choice.probe else 0) if cpu else None
    autocast: Any = backend.autocast
    step = trial_step(
        backend.bare_module,
        settings.data.image_size,
        autocast,
        layout.batchnorm.frozen,
        hold_aside=choice.fixed.not_yet_allocated,
        saved_limit=limit,
    )
    try:
        return confirm_chunk(
            step,
            layout.local_batch,
            layout.chunk_size,
            lambda rows: layout.batchnorm.round_chunk(rows, layout.local_batch),
        )
    except (ValueError, RankFailure) as exc:  # ConfigError too: no chunk keeps the BatchNorm groups whole
        raise TrainError(f"distributed.chunk_size=auto: {exc}") from None
