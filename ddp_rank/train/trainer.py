"""The training loop: composes the data stream, the model, the global-batch loss and the (chunked) step.

One ``Trainer`` per process. Every process of a job runs the same code on its own share of each global batch:

    stream (same categories on every rank, disjoint samples)  ->  local batch [M / W images]
    -> forward_backward (direct, or chunked when the local batch exceeds the layout's chunk)
       with loss_fn = GlobalBatchLoss(listwise loss): the loss of the GLOBAL batch of M images
    -> gradient clipping, optimizer step, schedule step (DDP / ZeRO have averaged the gradients)

The layers stay apart: the losses know no ranks, the distributed layer no images, the data layer no losses;
only the training package knows all three. Its parts: ``settings`` (each part below gets its config sections,
never the whole config), ``setup`` (building the parts), ``chunking`` (the batch layout, the
chunk), ``batches`` (this rank's batches, read ahead), ``checkpoints`` (the state saved, the resume and its
checks), ``run_report`` (logs, tables, summary). ``train_step`` / ``state_dict`` /
``load_state_dict`` are the units the tests drive; ``fit`` is the loop with evaluation and checkpoints;
``run_training`` is the entry point with guaranteed teardown (``close``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_rank.config import Config, ConfigError
from ddp_rank.data.reading.batch import StreamBatch
from ddp_rank.distributed import GlobalBatchLoss, average_gradients, end_process_group
from ddp_rank.distributed.agreement import RankFailure
from ddp_rank.eval.runner import evaluate_model
from ddp_rank.eval.settings import check_evaluation
from ddp_rank.logs import configure_run_logging
from ddp_rank.model import EmbeddingNet, freeze_batchnorm
from ddp_rank.runtime import AGREED_ERRORS, TrainError, autocast_dtype, make_accelerator, open_training_shards
from ddp_rank.runtime.determinism import set_deterministic
from ddp_rank.runtime.failure import end_process_after_failure, end_process_now, launch_rank
from ddp_rank.train.backends import backend_for_accelerator
from ddp_rank.train.batches import TrainBatches
from ddp_rank.train.batchnorm import match_batchnorm_buffers_to_weights, sync_batchnorm_buffers
from ddp_rank.train.checkpoints.checkpointer import Checkpointer
from ddp_rank.train.checkpoints.resume import resume
from ddp_rank.train.checkpoints.write import CheckpointManager
from ddp_rank.train.chunking.auto import choose_chunk_for_run, confirm_chunk_for_run
from ddp_rank.train.chunking.captured import captured_chunk_for
from ddp_rank.train.chunking.layout import BatchLayout
from ddp_rank.train.chunking.step import forward_backward
from ddp_rank.train.optim import apply_optim_config, build_optimizer, build_scheduler
from ddp_rank.train.preemption import (
    EXIT_REQUEUE,
    RunStopped,
    StopRequest,
    ignore_signals,
    requeue_slurm_job,
)
from ddp_rank.train.run_report import RunReport, StepResult
from ddp_rank.train.run_state import RunState
from ddp_rank.train.settings import train_settings
from ddp_rank.train.setup import (
    build_network,
    build_stream,
    build_training_loss,
    configure_deepspeed,
    trainable_loss_parameters,
    uses_deepspeed,
)
from ddp_rank.train.trackers import run_accelerator
from ddp_rank.train.train_state import TrainState

log = logging.getLogger(__name__)

__all__ = [
    "StepResult",
    "TrainError",
    "Trainer",
    "make_accelerator",
    "run_training",
]


class Trainer:
    """Build everything from a config on this process; ``fit()`` trains, ``close()`` tears down."""

    def __init__(self, cfg: Config, accelerator: Any | None = None, stop: StopRequest | None = None) -> None:
        self.cfg = cfg
        # Given by run_training, which takes the signals over before the (long) start-up; else made here.
        self.stop = stop if stop is not None else StopRequest(cfg.train.stop_signals, cfg.train.stop_grace_s)
        self.settings = s = train_settings(cfg)  # the config translated once: each part gets its own below
        # Fail fast, before any process group exists: the shards, then what the evaluation needs of them.
        self.manifest = open_training_shards(s.data, s.model.backbone)
        check_evaluation(s.evaluation, s.train.best_metric, self.manifest)
        # Before the first CUDA matmul: cuBLAS reads its workspace setting when it starts.
        set_deterministic(s.train.deterministic, s.train.deterministic_fill)
        # A passed accelerator must carry train.log_with.
        self.accelerator = acc = run_accelerator(s.train, cfg.distributed, accelerator)
        self.world_size = acc.num_processes
        self.rank = acc.process_index
        self.is_main = acc.is_main_process
        self.device = acc.device
        self.layout = BatchLayout.from_settings(s.step, self.world_size)  # the chunk: below, when 'auto'
        self.out_dir = Path(s.train.output_dir)
        configure_run_logging(self.rank, self.out_dir)

        # Same initial weights on every rank (DDP would broadcast them anyway; ZeRO would not check).
        torch.manual_seed(s.train.seed)
        self.stream = build_stream(
            s.data, s.data_seed, self.manifest, self.rank, self.world_size, self.out_dir
        )
        self.batches = TrainBatches(self.stream, self.device, lambda: self.stop.requested)
        self.steps_per_epoch = self.stream.steps_per_epoch
        self.total_steps = s.train.steps or s.train.epochs * self.steps_per_epoch

        model, notes = build_network(
            s.model,
            s.data.image_size,
            self.device,
            self.layout.batchnorm,
            deepspeed=uses_deepspeed(acc),
            manifest=self.manifest,
        )
        # After the network: a proxy loss's random proxies leave the model's initial weights as with any loss.
        training_loss = build_training_loss(s.loss, s.model.embedding_dim, self.manifest)
        self.loss_parameters = trainable_loss_parameters(training_loss, acc, self.device, s.loss.name)
        choice = None
        if s.step.distributed.fixed_chunk is None:  # measured with the model still on the CPU
            largest_class = max(self.manifest.split(s.data.train_split).class_counts.values(), default=1)
            self.layout, choice = choose_chunk_for_run(
                s.step,
                self.layout,
                model,
                training_loss.loss,
                self.device,
                autocast_dtype(acc),
                largest_class,
                self.loss_parameters,
                uses_deepspeed(acc),
                self.is_main,
            )
        optimizer = build_optimizer(self.parameter_groups(model), s.optim)
        self.scheduler = build_scheduler(optimizer, s.optim, self.total_steps)
        self.deepspeed = configure_deepspeed(acc, self.layout, s.optim.grad_clip)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if self.deepspeed:
            match_batchnorm_buffers_to_weights(self.model)
        self.backend = backend_for_accelerator(acc, self.model)
        if choice is not None:  # the model is on its device now: one real step confirms the chunk
            self.layout = confirm_chunk_for_run(
                s.step, self.layout, choice, self.backend, self.device, self.deepspeed, self.is_main
            )
        try:  # after the chunk is final: the captured chunk compiles for its shape on the first step
            self.captured = captured_chunk_for(
                self.backend, self.layout.chunk_size, s.step.distributed.capture_chunk
            )
        except ValueError as exc:
            raise TrainError(str(exc)) from None
        self.report = RunReport(s.report, self.layout, self.device, self.is_main, acc, self.manifest)
        if self.is_main:
            log.info(f"BatchNorm: {self.layout.batchnorm.describe(self.layout.local_batch)}")
        for note in notes:
            self.report.note(note)
        if training_loss.description and self.is_main:
            log.info(f"loss: {training_loss.description}")
        self.loss_fn = GlobalBatchLoss(
            training_loss.loss,
            grad_reduction="sum" if s.step.distributed.grad_reduction == "sum" else "mean",
            miner=training_loss.miner,
        )
        self.progress = TrainState(
            self.steps_per_epoch,
            self.total_steps,
            self.world_size,
            s.data.global_batch_size,
            s.train.best_metric,
        )
        self.checkpoints = CheckpointManager(
            self.out_dir / "checkpoints", s.train.keep_last, self.is_main, acc.wait_for_everyone
        )
        self.checkpointer = Checkpointer(
            self.checkpoints,
            acc,
            self.model,
            scheduler=self.scheduler,
            loss=training_loss.loss if self.loss_parameters else None,
            train=self.progress,
            data=self.batches,
            config=s.report.config.values,
            deepspeed=self.deepspeed,
        )

    def parameter_groups(self, model: EmbeddingNet) -> list[dict[str, Any]]:
        """The optimizer's groups: the model's (backbone, head), then the loss's own parameters, if any, at
        ``optim.lr * loss.params_lr_mult`` without weight decay."""
        o = self.settings.optim
        groups = model.parameter_groups(o.lr, o.head_lr_mult, o.weight_decay)
        if self.loss_parameters:
            lr = o.lr * self.settings.loss.params_lr_mult
            groups.append({"params": self.loss_parameters, "lr": lr, "weight_decay": 0.0, "name": "loss"})
        return groups

    @property
    def unwrapped(self) -> EmbeddingNet:
        """The model in DDP's or DeepSpeed's ``.module`` (accelerate's unwrap_model would import DeepSpeed)."""
        return getattr(self.model, "module", self.model)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def local_batch(self) -> int:
        return self.layout.local_batch

    @property
    def chunk_size(self) -> int | None:
        return self.layout.chunk_size

    @property
    def notes(self) -> list[str]:
        return self.report.notes

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: StreamBatch | None = None) -> StepResult:
        """One optimizer step on the next global batch (or on ``batch``, this rank's part of one, which is moved
        to the device here; the trainer's own batches arrive there from the feed)."""
        t0 = time.perf_counter()
        batch = self.batches.next() if batch is None else batch.to(self.device)
        t1 = time.perf_counter()
        self.model.train()
        if self.layout.batchnorm.frozen:
            freeze_batchnorm(self.model)
        try:
            chunk = self.layout.chunk_size
            out = forward_backward(
                self.backend, batch.images, batch.labels, self.loss_fn, chunk, captured=self.captured
            )
        except (ValueError, RankFailure) as exc:
            # Raised on every rank alike by the loss layer: NaN / Inf embeddings (the network diverged), or an
            # exception inside the loss on some rank (its message names the rank).
            raise TrainError(f"step {self.progress.step + 1}: {exc}") from exc
        # The loss's own parameters are outside DDP: every rank holds their full gradient; the mean keeps them
        # bitwise equal on every rank.
        average_gradients(self.loss_parameters)
        grad_norm = None
        clip = self.settings.optim.grad_clip
        if clip and not self.deepspeed:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        self.progress.step += 1
        loss = float(out.loss)
        if not math.isfinite(loss):
            raise TrainError(
                f"step {self.progress.step}: the loss is {loss}; lower optim.lr, set optim.grad_clip, or use "
                "train.mixed_precision=no"
            )
        return StepResult(loss, out.chunks, t1 - t0, time.perf_counter() - t0, lr, grad_norm)

    # ------------------------------------------------------------------ state (train/checkpoints/)
    def state_dict(self) -> dict[str, Any]:
        """What ``meta.json`` records: the loop's state, the data's, the config (the rest is in the files)."""
        return self.checkpointer.meta()

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Continue where ``meta`` left the loop (its step, the best so far) and the data (``meta['stream']``)."""
        self.checkpointer.load_meta(meta, self.settings.train.force_resume)

    def resume(self) -> Path | None:
        """Apply ``train.resume``; returns the checkpoint continued from, or None for a fresh start."""
        s = self.settings
        resumed = resume(self.checkpointer, s.train, s.report.config, self.report.note)
        if resumed is None:
            return None
        if resumed.changes:  # forced: this config's optimizer settings apply from here
            fresh = self.parameter_groups(self.unwrapped)
            apply_optim_config(self.optimizer, self.scheduler, fresh, s.optim, self.total_steps, self.step)
        return resumed.path

    def sync_batchnorm(self) -> None:
        """Collective: BatchNorm running statistics become their mean over the ranks (``ddp_rank.train.batchnorm``),
        so that evaluation and checkpoints see one model, not each rank's own statistics."""
        sync_batchnorm_buffers(self.unwrapped)

    def save_checkpoint(self) -> Path:
        """Atomic checkpoint of the current step (all ranks)."""
        self.sync_batchnorm()
        fresh = self.checkpoints.last_saved_step != self.step
        path = self.checkpointer.save(self.step)
        if fresh and self.is_main:
            log.info(f"checkpoint {path}")
        return path

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any]:
        """Retrieval metrics on ``data.test_split`` (all ranks; same numbers everywhere)."""
        self.sync_batchnorm()
        with torch.random.fork_rng(devices=[]):  # evaluation must not shift the training RNG stream
            return evaluate_model(
                self.unwrapped,
                self.settings.evaluation,
                device=self.device,
                autocast_dtype=autocast_dtype(self.accelerator),
                manifest=self.manifest,
                on_embedded=self.report.picture.capture,
            )

    def _maybe_best(self, metrics: dict[str, Any]) -> None:
        name = self.settings.train.best_metric
        if name not in metrics:
            raise ConfigError(
                f"train.best_metric='{name}' is not among the evaluation metrics {sorted(metrics)}"
            )
        if metrics[name] is None:  # e.g. a TPR@FPR the test split has too few negative pairs to measure
            if self.is_main:
                log.warning(
                    f"train.best_metric='{name}' is not measurable on this test split: no best checkpoint"
                )
            return
        value = float(metrics[name])
        if self.progress.best_value is None or value > self.progress.best_value:
            self.progress.best_value, self.progress.best_step = value, self.step
            self.save_checkpoint()
            self.checkpoints.mark_best(self.step, name, value)
            if self.is_main:
                log.info(f"new best {name} {100 * value:.2f} at step {self.step}")

    # ------------------------------------------------------------------ the loop
    def fit(self, started: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming if configured); returns a summary dict (same on every rank).

        ``started`` is called once the resume (if any) succeeded, before the first step: the run has begun
        (``run_training`` records it in ``run.json`` then, so a refused resume leaves the earlier record).
        Raises :class:`RunStopped` on every rank, after a checkpoint, when a stop signal reached any rank
        (``ddp_rank.train.preemption``)."""
        self.stop.install()
        try:
            return self._fit(started)
        finally:
            self.stop.restore()

    def _fit(self, started: Callable[[], None]) -> dict[str, Any]:
        train = self.settings.train
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        resumed = self.resume()
        started()
        data_facts = {"steps_per_epoch": self.steps_per_epoch, "categories_left_out": self.stream.left_out}
        self.report.start(self.step, self.total_steps, resumed, data_facts)
        self.accelerator.wait_for_everyone()
        has_eval = bool(self.settings.data.test_split)
        eval_every = train.eval_every or self.steps_per_epoch
        ckpt_every = train.checkpoint_every
        last_eval: dict[str, Any] | None = None
        if has_eval and train.eval_at_start and self.step == 0:
            self.report.evaluation(self.step, self.evaluate())
        start_step, t_start = self.step, time.perf_counter()
        window: list[StepResult] = []
        while self.step < self.total_steps:
            result = self.train_step()
            window.append(result)
            self.report.step_done(result)
            s = self.step
            if s % train.log_every == 0 or s == self.total_steps:
                data = self.batches.counts()  # a collective: every rank, every log step
                # The model's groups (backbone, head); a proxy loss's group is not the head's.
                lrs = {
                    g.get("name") or f"group{i}": float(g["lr"])
                    for i, g in enumerate(self.optimizer.param_groups)
                    if g.get("name") != "loss"
                }
                self.report.log_train(s, self.total_steps, s / self.steps_per_epoch, window, lrs, data)
                window = []
            if has_eval and (s % eval_every == 0 or s == self.total_steps):
                last_eval = self.evaluate()
                self.report.evaluation(s, last_eval)
                self._maybe_best(last_eval)
            if (ckpt_every and s % ckpt_every == 0) or s % self.steps_per_epoch == 0 or s == self.total_steps:
                self.save_checkpoint()
            if self.batches.stop_agreed and s < self.total_steps:
                self._stop_here()
        elapsed = time.perf_counter() - t_start
        summary = {
            "steps": self.step,
            "steps_this_run": self.step - start_step,
            "resumed_from": str(resumed) if resumed else None,
            "seconds": elapsed,
            "images_per_s": (self.step - start_step) * self.layout.global_batch / max(elapsed, 1e-9),
            "world_size": self.world_size,
            "chunked": self.layout.chunked,
            "last_eval": last_eval,
            "best_value": self.progress.best_value,
            "best_step": self.progress.best_step,
            "data": {**self.batches.counts(), "categories_left_out": self.stream.left_out},
        }
        processes = (
            f"{self.world_size} ({self.accelerator.distributed_type.value}, device {self.device.type})"
        )
        self.report.finish(summary, self.total_steps, processes)
        self.accelerator.wait_for_everyone()
        return summary

    def _stop_here(self) -> None:
        """Every rank: checkpoint this step, record the stop, raise RunStopped. The job is requeued later, once
        every file is written (``run_training``)."""
        path = self.save_checkpoint()
        self.stop.done()
        if self.is_main:
            log.warning(
                f"stopped after step {self.step} of {self.total_steps} on a signal, checkpoint {path}; the same "
                "command continues from it"
            )
        self.report.stopped(self.step, self.stop.received.name if self.stop.received else None, str(path))
        self.report.close()
        raise RunStopped(self.step, str(path))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release files and the loader (safe to call twice)."""
        self.report.close()
        self.batches.close()


def run_training(cfg: Config) -> dict[str, Any]:
    """Entry point: build the trainer, fit, and always tear down (STYLE 1: thin, try/finally).

    In a multi-process run, an exception other than the agreed ones (``AGREED_ERRORS``) is this rank's alone:
    the process prints it and ends at once, so that the launcher stops the ranks waiting for it in a collective.
    """
    trainer: Trainer | None = None
    state = RunState(cfg.train.output_dir, enabled=launch_rank() == 0)
    requeue = False  # stopped on a signal: requeue the job as the very last thing
    # The signals are taken over before the start-up (shards, model, the chunk's probe: seconds to minutes): a
    # scheduler's signal meanwhile is a stop request like any other, met after the first step, not a dead rank.
    stop = StopRequest(cfg.train.stop_signals, cfg.train.stop_grace_s).install()
    try:
        trainer = Trainer(cfg, stop=stop)
        # After the checks and the resume: a refused start leaves the record of the run it refused to touch.
        summary = trainer.fit(started=state.start)
        state.finished(trainer.step)
        return summary
    except RunStopped as stopped:
        state.stopped(stopped.step)
        if (
            trainer is not None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            # Every rank has written its part of the checkpoint (the save ends in a barrier). End all ranks
            # together now, without the process group's teardown: a launcher such as torchrun ends the other
            # ranks as soon as one exits with a non-zero status, and a rank caught inside the teardown aborts.
            # Rank 0 requeues between two barriers: after every rank's files are closed, and before any rank
            # exits (the launcher would then end rank 0 before it asked). Every rank ignores the signal that the
            # requeue brings (SLURM signals the whole job): nothing is left to do but exit with status 75.
            trainer.close()
            dist.barrier()
            ignore_signals(cfg.train.stop_signals)
            if trainer.is_main and cfg.train.requeue == "auto":
                requeue_slurm_job(ignore=cfg.train.stop_signals)
            dist.barrier()
            end_process_now(EXIT_REQUEUE)
        requeue = True
        raise
    except AGREED_ERRORS as exc:
        state.crashed(exc, trainer.step if trainer is not None else None)
        raise
    except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the run did not finish
        state.crashed(exc, trainer.step if trainer is not None else None)
        if not isinstance(exc, Exception):
            raise
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if trainer is not None:
                trainer.close()  # flushes metrics.jsonl; no collective
            # The step that failed, counted from 1 as in the logs.
            end_process_after_failure(
                "ddp-rank train", exc, trainer.step + 1 if trainer is not None else None
            )
        raise
    finally:
        main = trainer is not None and trainer.is_main
        accelerator = trainer.accelerator if trainer is not None else None
        if trainer is not None:
            trainer.close()
        # The DDP model released (the trainer and the accelerator held it) for end_process_group to collect.
        trainer = None
        if accelerator is not None:
            accelerator.free_memory()
        end_process_group()
        if accelerator is not None:
            accelerator.end_training()  # the trackers
        stop.restore()
        # Last: `scontrol requeue` signals the whole job at once, so checkpoint, stop record and run.json come first.
        if requeue and main and cfg.train.requeue == "auto":
            requeue_slurm_job(ignore=cfg.train.stop_signals)
