"""The training loop: composes the data stream, the model, the global-batch loss and the (chunked) step.

One ``Trainer`` per process. Every process of a job runs the same code on its own share of each global batch:

    stream (same categories on every rank, disjoint samples)  ->  local batch [M / W images]
    -> forward_backward (direct, or chunked when the local batch exceeds distributed.chunk_size)
       with loss_fn = GlobalBatchLoss(listwise loss): the loss of the GLOBAL batch of M images
    -> gradient clipping, optimizer step, schedule step (DDP / ZeRO have averaged the gradients)

The layers stay apart: the losses know no ranks, the distributed layer no images, the data layer no losses;
only this module knows all three. ``train_step`` / ``state_dict`` / ``load_state_dict`` are the units the
tests drive; ``fit`` is the loop with logging, evaluation and checkpoints; ``run_training`` is the entry point
with guaranteed teardown (``close``).

Resume: a checkpoint holds the accelerate state (model, optimizer, GradScaler, per-rank RNG), the schedule,
and ``meta.json`` with the global step and the world size. The stream is a pure function of (seed, epoch, step)
so it restarts at the checkpoint's step; a resumed run ends with the parameters of an uninterrupted one.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.config import Config, ConfigError, save_config, to_dict
from ddp_rank.data.loader import StreamLoader
from ddp_rank.data.manifest import Manifest, is_url
from ddp_rank.data.stream import DataError, ShardStream
from ddp_rank.data.transforms import transform_from_config
from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.distributed.agreement import RankFailure, gather_counts, raise_if_any_failed
from ddp_rank.eval.protocols import metric_names
from ddp_rank.eval.report import format_table
from ddp_rank.eval.runner import evaluate_model, vehicleid_splits
from ddp_rank.losses import FastAPLoss, ListwiseLoss, PNPLoss, SmoothAPLoss
from ddp_rank.model import EmbeddingNet, build_model, freeze_batchnorm, init_from, is_convolutional
from ddp_rank.model.checkpoints import CheckpointError, read_meta, resolve_checkpoint
from ddp_rank.runtime import AGREED_ERRORS, TrainError, autocast_dtype, make_accelerator, open_shards
from ddp_rank.runtime.data_setup import schedule_config
from ddp_rank.runtime.determinism import set_deterministic
from ddp_rank.runtime.failure import end_process_after_failure
from ddp_rank.train.backends import backend_for_accelerator
from ddp_rank.train.batchnorm import convert_to_cross_rank, sync_batchnorm_buffers
from ddp_rank.train.checkpoint import CheckpointManager, check_world_size
from ddp_rank.train.chunked import forward_backward
from ddp_rank.train.console import StepLine, announce, peak_memory
from ddp_rank.train.device_feed import DeviceFeed
from ddp_rank.train.optim import build_optimizer, build_scheduler, lr_factor
from ddp_rank.train.reporting import MetricsLogger, read_metrics, write_plots, write_summary
from ddp_rank.train.resume_check import describe_changes, resume_changes, tensor_changes

__all__ = [
    "StepResult",
    "TrainError",
    "Trainer",
    "build_loss",
    "check_inputs",
    "make_accelerator",
    "run_training",
]


def build_loss(cfg: Config) -> ListwiseLoss:
    """The listwise loss of ``cfg.loss`` (it knows no ranks; :class:`GlobalBatchLoss` spreads it)."""
    lc = cfg.loss
    budget = lc.memory_budget_mb * 2**20 if lc.memory_budget_mb else None
    common: dict[str, Any] = {
        "normalize": lc.normalize,
        "memory_budget": budget,
        "matmul_precision": lc.matmul_precision,
        "kernel": lc.kernel,
    }
    if lc.name == "fastap":
        return FastAPLoss(num_bins=lc.num_bins, **common)
    if lc.name == "pnp":
        return PNPLoss(
            variant=lc.pnp_variant, tau=lc.tau, b=lc.b, alpha=lc.alpha, count_self=lc.count_self, **common
        )
    return SmoothAPLoss(tau=lc.tau, count_self=lc.count_self, **common)


def check_evaluation(cfg: Config) -> None:
    """What the evaluation needs, checked at start-up rather than at the first evaluation: the test lists of
    VehicleID recipe shards, and ``train.best_metric`` among the metrics the protocol will report."""
    if not cfg.data.test_split:
        return
    sizes = cfg.eval.vehicleid_sizes
    if cfg.eval.protocol == "vehicleid":
        sizes = list(vehicleid_splits(cfg)) or sizes
    names = metric_names(
        cfg.eval.protocol, cfg.eval.ks or None, map_at_r=cfg.eval.map_at_r, vehicleid_sizes=sizes
    )
    if cfg.train.best_metric not in names:
        valid = [n for n in names if not n.rsplit("/", 1)[-1].startswith("num_")]
        raise ConfigError(
            f"train.best_metric='{cfg.train.best_metric}' is not among the metrics eval.protocol="
            f"{cfg.eval.protocol} reports with these settings; valid: {', '.join(valid)}"
        )


def check_inputs(cfg: Config) -> Manifest:
    """Fail fast, before any process group exists, on a missing shard directory or split, or on an evaluation
    setting that would only fail at the first evaluation."""
    manifest = open_shards(cfg)
    for key, split in (("train_split", cfg.data.train_split), ("test_split", cfg.data.test_split)):
        if split and split not in manifest.splits:
            raise TrainError(
                f"data.{key}='{split}' is not a split of {cfg.data.shards} (it has {sorted(manifest.splits)}); "
                f"set data.{key}"
                + (" (or data.test_split= to train without evaluation)" if key == "test_split" else "")
            )
    local = not is_url(manifest.location)
    train_shards = manifest.split(cfg.data.train_split).shards
    missing = [s.path for s in train_shards if local and not manifest.shard_path(s).is_file()]
    if missing:
        raise TrainError(
            f"{len(missing)} shard file(s) of {cfg.data.shards} are missing, e.g. {missing[0]}: copy the whole "
            "shard directory or rebuild it (`ddp-rank shards verify` checks it)"
        )
    check_evaluation(cfg)
    return manifest


@dataclass
class StepResult:
    """What one optimizer step reports: the global loss, chunks used, timings."""

    loss: float
    chunks: int
    data_time: float
    step_time: float
    lr: float
    grad_norm: float | None = None


@dataclass
class _Progress:
    """Running state of the loop that is not in the accelerate checkpoint (written to ``meta.json``)."""

    step: int = 0
    best_value: float | None = None
    best_step: int | None = None


class Trainer:
    """Build everything from a config on this process; ``fit()`` trains, ``close()`` tears down."""

    def __init__(self, cfg: Config, accelerator: Any | None = None) -> None:
        self.cfg = cfg
        self.manifest = check_inputs(cfg)
        # Before the first CUDA matmul: cuBLAS reads its workspace setting when it starts.
        set_deterministic(cfg.train.deterministic)
        self.accelerator = accelerator if accelerator is not None else make_accelerator(cfg)
        acc = self.accelerator
        self.world_size = acc.num_processes
        self.rank = acc.process_index
        self.is_main = acc.is_main_process
        self.device = acc.device
        if cfg.data.global_batch_size % self.world_size:
            raise ConfigError(
                f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by the {self.world_size} "
                "processes: every rank holds the same number of images; change the batch or --num_processes"
            )
        self.local_batch = cfg.data.global_batch_size // self.world_size
        chunk = cfg.distributed.chunk_size
        self.chunk_size: int | None = chunk if chunk and self.local_batch > chunk else None
        self.out_dir = Path(cfg.train.output_dir)

        # Same initial weights on every rank (DDP would broadcast them anyway; ZeRO would not check).
        torch.manual_seed(cfg.train.seed)
        try:
            self.stream = self._build_stream()
        except ValueError as exc:  # the sampler settings cannot be met by these shards
            raise TrainError(
                f"data: {exc}; `ddp-rank plan --config ...` shows what the shards allow"
            ) from exc
        self.data_events: dict[str, Any] = {"replaced_classes": 0, "decode_errors": 0, "bad_shards": []}
        # Pinned host batches: their copy to the GPU is asynchronous (DeviceFeed overlaps it with the step).
        self.loader = StreamLoader(self.stream, pin_memory=self.device.type == "cuda", track_position=False)
        self.steps_per_epoch = self.stream.steps_per_epoch
        self.total_steps = cfg.train.steps or cfg.train.epochs * self.steps_per_epoch

        self.notes: list[str] = []
        model = build_model(cfg.model, cfg.data.image_size)
        if cfg.model.init_from:
            self._note(init_from(model, cfg.model.init_from).summary())
        if self.device.type == "cuda" and is_convolutional(model):
            model.use_channels_last()
        if cfg.model.sync_bn:
            # In place (an EmbeddingNet is not itself a BatchNorm layer); PyTorch's fused SyncBatchNorm on CUDA.
            convert_to_cross_rank(model, cuda=self.device.type == "cuda")
        optimizer = build_optimizer(
            model.parameter_groups(cfg.optim.lr, cfg.optim.head_lr_mult, cfg.optim.weight_decay), cfg.optim
        )
        self.scheduler = build_scheduler(optimizer, cfg.optim, self.total_steps)
        self._configure_deepspeed()
        self.model, self.optimizer = acc.prepare(model, optimizer)
        acc.register_for_checkpointing(self.scheduler)
        self.backend = backend_for_accelerator(acc, self.model)
        self._deepspeed = getattr(self.accelerator.state, "deepspeed_plugin", None) is not None
        self.loss_fn = GlobalBatchLoss(
            build_loss(cfg),
            grad_reduction="sum" if cfg.distributed.grad_reduction == "sum" else "mean",
        )
        self.progress = _Progress()
        self.checkpoints = CheckpointManager(
            self.out_dir / "checkpoints", cfg.train.keep_last, self.is_main, acc.wait_for_everyone
        )
        self.logger: MetricsLogger | None = None
        self._show_lines = False  # progress lines instead of the bar (set by fit)
        self._clock = (0, time.perf_counter())  # (first step, start time) of this fit, for the ETA
        self._batches: DeviceFeed | None = None

    # ------------------------------------------------------------------ set-up helpers
    def _build_stream(self) -> ShardStream:
        """The data layer's category-aware stream of this rank's local batches (pixels in [0, 1])."""
        cfg = self.cfg
        return ShardStream(
            self.manifest,
            cfg.data.global_batch_size,
            split=cfg.data.train_split,
            schedule=schedule_config(cfg),
            transform=transform_from_config(cfg.data, augment=cfg.data.augment, pixels="uint8"),
            augment=cfg.data.augment,
            num_workers=cfg.data.num_workers,
            rank=self.rank,
            world_size=self.world_size,
            cache_dir=cfg.data.cache_dir or None,
        )

    def _configure_deepspeed(self) -> None:
        """DeepSpeed needs the micro-batch size, which accelerate would otherwise take from a prepared loader."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            return
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = self.local_batch
        ds["train_batch_size"] = self.cfg.data.global_batch_size
        ds["gradient_accumulation_steps"] = 1
        # Always set: DeepSpeed clips the gradient norm to 1.0 when the key is absent, which would silently
        # change the update (0.0 turns clipping off, as optim.grad_clip = 0 means here).
        ds["gradient_clipping"] = float(self.cfg.optim.grad_clip)

    def _note(self, message: str) -> None:
        """Something the user must know about this start (printed by rank 0, kept for the summary)."""
        self.notes.append(message)
        if self.is_main:
            print(f"ddp-rank train: {message}", file=sys.stderr, flush=True)

    @property
    def unwrapped(self) -> EmbeddingNet:
        return self.accelerator.unwrap_model(self.model)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def bn_frozen_always(self) -> bool:
        return self.cfg.model.freeze_bn == "always"

    # ------------------------------------------------------------------ the step
    def _next_batch(self) -> dict[str, Any]:
        """The next local batch, agreed on by every rank: if any rank's data layer fails (no readable
        replacement left), every rank raises that rank's message instead of waiting in the next collective."""
        error: str | None = None
        batch: dict[str, Any] = {}
        try:
            batch = self._fetch()
        except DataError as exc:
            error = str(exc)
        try:
            raise_if_any_failed(error)
        except RankFailure as exc:
            raise TrainError(f"data: {exc}") from None
        for key in ("replaced_classes", "decode_errors"):
            self.data_events[key] += int(batch["events"][key])
        self.data_events["bad_shards"] = sorted(
            set(self.data_events["bad_shards"]) | set(batch["events"]["bad_shards"])
        )
        return batch

    def _fetch(self) -> dict[str, Any]:
        """The next batch from the device feed (one batch read and copied ahead), its position recorded."""
        # None at the end of an epoch: the loader's next iter starts the next one.
        batch = next(self._batches, None) if self._batches is not None else None
        if batch is None:
            # A new DataLoader iterator draws its worker base seed from the global RNG; fork it so that a resumed
            # run (which starts a new iterator mid-epoch) keeps the model's RNG stream identical to an
            # uninterrupted one. The stream seeds each image's augmentation from (seed, epoch, step, class, image).
            with torch.random.fork_rng(devices=[]):
                self._batches = DeviceFeed(iter(self.loader), self.device)
                batch = next(self._batches)
        self.stream.advance(batch)  # the feed reads ahead: the position is that of the batch trained on
        return batch

    def train_step(self, batch: dict[str, Any] | None = None) -> StepResult:
        """One optimizer step on the next global batch (or on ``batch``, this rank's part of one)."""
        t0 = time.perf_counter()
        if batch is None:
            batch = self._next_batch()
        t1 = time.perf_counter()
        images = batch["images"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        self.model.train()
        if self.bn_frozen_always:
            freeze_batchnorm(self.model)
        try:
            out = forward_backward(self.backend, images, labels, self.loss_fn, self.chunk_size)
        except (ValueError, RankFailure) as exc:
            # Raised on every rank alike by the loss layer: NaN / Inf embeddings (the network diverged), or an
            # exception inside the loss on some rank (its message names the rank).
            raise TrainError(f"step {self.progress.step + 1}: {exc}") from exc
        grad_norm = None
        if self.cfg.optim.grad_clip and not self._deepspeed:
            grad_norm = float(
                self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            )
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The loop state that goes to ``meta.json`` (the rest is in the accelerate checkpoint)."""
        epoch, step_in_epoch = divmod(self.progress.step, self.steps_per_epoch)
        return {
            "step": self.progress.step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "world_size": self.world_size,
            "global_batch_size": self.cfg.data.global_batch_size,
            "total_steps": self.total_steps,
            "best_value": self.progress.best_value,
            "best_step": self.progress.best_step,
            "best_metric": self.cfg.train.best_metric,
            "stream": {**self.stream.state_dict(), **self._schedule_signature()},
            "config": to_dict(self.cfg),
        }

    def _schedule_signature(self) -> dict[str, Any]:
        """What decides which samples each step draws, besides the layout the stream itself records."""
        data = self.cfg.data
        return {
            "seed": self.cfg.train.seed,
            "sampler": data.sampler,
            "categories_per_batch": data.categories_per_batch,
            "batches_per_pair": data.batches_per_pair,
            "images_per_class": data.images_per_class,
            "category_aware": data.category_aware,
            "steps_per_epoch": self.steps_per_epoch,
        }

    def load_state_dict(self, meta: dict[str, Any]) -> None:
        """Continue at ``meta['step']``: the stream is positioned there and the best-so-far restored."""
        if (
            int(meta.get("global_batch_size", self.cfg.data.global_batch_size))
            != self.cfg.data.global_batch_size
        ):
            raise CheckpointError(
                f"the checkpoint was trained with data.global_batch_size={meta['global_batch_size']}, this run "
                f"uses {self.cfg.data.global_batch_size}; resume with the same global batch or start afresh"
            )
        saved = meta.get("stream", {})
        changed = {
            k: (v, saved[k]) for k, v in self._schedule_signature().items() if k in saved and saved[k] != v
        }
        if changed and not self.cfg.train.force_resume:
            details = ", ".join(f"{k}: {old} -> {new}" for k, (new, old) in changed.items())
            raise CheckpointError(
                f"the data schedule differs from the checkpoint's ({details}), so the resumed run would not see "
                "the batches of the interrupted one; restore those settings, or set train.force_resume=true"
            )
        self.progress.step = int(meta["step"])
        self.progress.best_value = meta.get("best_value")
        self.progress.best_step = meta.get("best_step")
        epoch, step_in_epoch = divmod(self.progress.step, self.steps_per_epoch)
        # The plan depends neither on the world size nor on the workers: any layout continues the sequence.
        self.stream.load_state_dict({"epoch": epoch, "step": step_in_epoch})
        self._drop_feed()

    def sync_batchnorm(self) -> None:
        """Collective: BatchNorm running statistics become their mean over the ranks (``ddp_rank.train.batchnorm``),
        so that evaluation and checkpoints see one model, not each rank's own statistics."""
        sync_batchnorm_buffers(self.unwrapped)

    def save_checkpoint(self) -> Path:
        """Atomic checkpoint of the current step (all ranks)."""
        self.sync_batchnorm()
        fresh = self.checkpoints.last_saved_step != self.step
        path = self.checkpoints.save(self.step, self.state_dict(), self._save_state)
        if fresh and self.is_main:
            announce(f"checkpoint {path}")
        return path

    def _save_state(self, directory: Path) -> None:
        self.accelerator.save_state(str(directory))
        if self._deepspeed:
            # DeepSpeed keeps weights in its own layout; also write plain weights so `ddp-rank eval` can load them
            # (ZeRO-1/2 do not partition parameters, so every rank holds them all).
            state = self.accelerator.get_state_dict(self.model)
            if self.is_main:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))

    def resume(self) -> Path | None:
        """Apply ``train.resume``; returns the checkpoint continued from, or None for a fresh start."""
        mode = self.cfg.train.resume
        self.checkpoints.cleanup_partial()
        if mode == "never":
            if self.checkpoints.latest() is not None:
                raise CheckpointError(
                    f"{self.checkpoints.root} already holds checkpoints and train.resume=never: use a new "
                    "train.output_dir, delete the old run, or train.resume=auto to continue it"
                )
            return None
        path = self.checkpoints.latest() if mode == "auto" else resolve_checkpoint(mode, prefer="latest")
        if path is None:
            return None
        meta = read_meta(path)
        force = self.cfg.train.force_resume
        # Only DeepSpeed's partitioned optimizer state ties a checkpoint to its world size: the data plan does not.
        check_world_size(meta, self.world_size, force or not self._deepspeed, str(path))
        # The saved weights' shapes as well: not every shape is a model.* key (a ViT's position embeddings follow
        # data.image_size), and load_state would fail on them with a bare size-mismatch traceback.
        changes = resume_changes(meta, self.cfg, self.total_steps) + tensor_changes(path, self.unwrapped)
        if changes and not force:
            shapes = (
                " (its weights have other shapes: a timm ViT's position embeddings follow data.image_size)"
                if any(c.is_tensor for c in changes)
                else ""
            )
            raise CheckpointError(
                f"checkpoint {path} was trained with another model or optimizer setting ({describe_changes(changes)})"
                f"{shapes}; resuming would ignore or break on them. Restore those values, start a new run from its "
                f"weights with model.init_from={path} and a new train.output_dir, or set train.force_resume=true to "
                "continue with the new values"
            )
        if any(c.structural for c in changes):
            # The saved parameters / optimizer state do not fit: take the weights that do, a fresh optimizer.
            report = init_from(self.unwrapped, path)
            self._note(
                f"forced resume from {path} with a changed model or optimizer: the optimizer state and RNG are "
                f"not restored.\n{report.summary()}"
            )
        else:
            self.accelerator.load_state(str(path))
        self.load_state_dict(meta)
        if changes:
            self._apply_optim_config()
            # Tensors of another shape are in init_from's report above.
            settings = [c for c in changes if not c.is_tensor]
            if settings:
                self._note(f"forced resume from {path}: the new values apply: {describe_changes(settings)}")
        if mode != "auto" and self.out_dir.resolve() not in path.resolve().parents:
            self._note(
                f"continuing {mode} at step {self.step} with its optimizer state (train.resume); to start from "
                "its weights only, use model.init_from"
            )
        self._abandon_later_checkpoints(meta)
        return path

    def _abandon_later_checkpoints(self, meta: dict[str, Any]) -> None:
        """A rewind (this run continues at step s while its output_dir holds checkpoints after s, e.g. resumed
        from an earlier one after a divergence): move those aside, as metrics.jsonl is cut back to s, so that the
        next ``train.resume=auto`` continues this timeline, not the abandoned one. Collective (all ranks)."""
        best = None
        if meta.get("best_step") is not None and meta.get("best_value") is not None:
            metric = str(meta.get("best_metric", self.cfg.train.best_metric))
            best = (int(meta["best_step"]), metric, float(meta["best_value"]))
        folder, moved = self.checkpoints.abandon_after(self.step, best)
        if folder is not None:
            self._note(
                f"rewound to step {self.step}: the later checkpoints of this run ({', '.join(moved)}) were moved to "
                f"{folder} so that train.resume=auto continues from here; delete that folder once you no longer "
                "need them"
            )

    def _apply_optim_config(self) -> None:
        """Make this config's optimizer hyper-parameters apply at the current step (the restored optimizer and
        schedule carry the checkpoint's: base rates, weight decay, betas, momentum)."""
        o = self.cfg.optim
        fresh = self.unwrapped.parameter_groups(o.lr, o.head_lr_mult, o.weight_decay)
        factor = lr_factor(o, self.total_steps)(self.step)
        for group, new in zip(self.optimizer.param_groups, fresh):
            group["initial_lr"] = new["lr"]
            group["lr"] = new["lr"] * factor
            group["weight_decay"] = o.weight_decay
            if "betas" in group:
                group["betas"] = tuple(o.betas)
            if "momentum" in group:
                group["momentum"] = o.momentum
        self.scheduler.base_lrs = [g["lr"] for g in fresh]
        self.scheduler.last_epoch = self.step
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, Any]:
        """Retrieval metrics on ``data.test_split`` (all ranks; same numbers everywhere)."""
        self.sync_batchnorm()
        dtype = autocast_dtype(self.accelerator)
        with torch.random.fork_rng(devices=[]):  # evaluation must not shift the training RNG stream
            return evaluate_model(
                self.unwrapped,
                self.cfg,
                device=self.device,
                autocast_dtype=dtype,
                num_workers=self.cfg.data.num_workers,
            )

    def _maybe_best(self, metrics: dict[str, Any]) -> None:
        name = self.cfg.train.best_metric
        if name not in metrics:
            raise ConfigError(
                f"train.best_metric='{name}' is not among the evaluation metrics {sorted(metrics)}"
            )
        value = float(metrics[name])
        if self.progress.best_value is None or value > self.progress.best_value:
            self.progress.best_value, self.progress.best_step = value, self.step
            self.save_checkpoint()
            self.checkpoints.mark_best(self.step, name, value)
            if self.is_main:
                announce(f"new best {name} {100 * value:.2f} at step {self.step}")

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming if configured); returns a summary dict (same on every rank)."""
        cfg = self.cfg
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        resumed = self.resume()
        if self.is_main:
            self._announce_start(resumed)
            self._write_config()
            self.logger = MetricsLogger(
                self.out_dir / "metrics.jsonl",
                self.out_dir / "tensorboard" if cfg.train.tensorboard else None,
            )
            # A resumed run drops what the killed one logged after its checkpoint; a fresh one starts empty.
            self.logger.truncate_after(self.step if resumed else -1)
            self.logger.log(
                "data",
                self.step,
                {"steps_per_epoch": self.steps_per_epoch, "categories_left_out": self.stream.left_out},
            )
        self.accelerator.wait_for_everyone()
        has_eval = bool(cfg.data.test_split)
        eval_every = cfg.train.eval_every or self.steps_per_epoch
        ckpt_every = cfg.train.checkpoint_every
        last_eval: dict[str, Any] | None = None
        if has_eval and cfg.train.eval_at_start and self.step == 0:
            first = self.evaluate()
            self._report_eval(first)
        bar = self._progress_bar()
        self._show_lines = bar is None and self.is_main
        start_step, t_start = self.step, time.perf_counter()
        self._clock = (start_step, t_start)
        window: list[StepResult] = []
        while self.step < self.total_steps:
            res = self.train_step()
            window.append(res)
            s = self.step
            if bar is not None:
                bar.update(1)
                ips = cfg.data.global_batch_size / max(res.step_time, 1e-9)
                bar.set_postfix(loss=f"{res.loss:.4f}", img_s=f"{ips:.1f}", refresh=False)
            if s % cfg.train.log_every == 0 or s == self.total_steps:
                self._log_train(window)
                window = []
            if has_eval and (s % eval_every == 0 or s == self.total_steps):
                last_eval = self.evaluate()
                self._report_eval(last_eval)
                self._maybe_best(last_eval)
            if (ckpt_every and s % ckpt_every == 0) or s % self.steps_per_epoch == 0 or s == self.total_steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t_start
        summary = {
            "steps": self.step,
            "steps_this_run": self.step - start_step,
            "resumed_from": str(resumed) if resumed else None,
            "seconds": elapsed,
            "images_per_s": (self.step - start_step) * cfg.data.global_batch_size / max(elapsed, 1e-9),
            "world_size": self.world_size,
            "chunked": self.chunk_size is not None,
            "last_eval": last_eval,
            "best_value": self.progress.best_value,
            "best_step": self.progress.best_step,
            "data": {**gather_counts(self.data_events), "categories_left_out": self.stream.left_out},
        }
        if self.is_main:
            self._write_reports(summary)
        self.accelerator.wait_for_everyone()
        return summary

    def _write_config(self) -> None:
        """``config.yaml`` (what this start runs with), written only once the resume check has passed, and a copy
        per start in ``config-history/`` so the config of every earlier start stays readable."""
        history = self.out_dir / "config-history"
        current = self.out_dir / "config.yaml"
        if not history.is_dir() and current.is_file():  # a run started before the history existed
            history.mkdir(parents=True)
            atomic_write_text(history / "start-000-earlier.yaml", current.read_text())
        start = len(list(history.glob("start-*.yaml"))) + (
            0 if (history / "start-000-earlier.yaml").exists() else 1
        )
        save_config(self.cfg, history / f"start-{start:03d}-step-{self.step:08d}.yaml")
        save_config(self.cfg, current)

    def _announce_start(self, resumed: Path | None) -> None:
        where = f"{self.world_size} process(es) on {self.device.type}"
        step = f"chunked (chunks of {self.chunk_size})" if self.chunk_size else "direct"
        if resumed is not None:
            announce(f"resumed from {resumed} at step {self.step} of {self.total_steps}")
        announce(
            f"training steps {self.step + 1}-{self.total_steps} with {where}, global batch "
            f"{self.cfg.data.global_batch_size} ({self.local_batch} per rank, {step} step) into {self.out_dir}"
        )

    def _report_eval(self, metrics: dict[str, Any]) -> None:
        """Log an evaluation and print its table (rank 0)."""
        if self.logger is not None:
            self.logger.log("eval", self.step, metrics)
        if self.is_main:
            shown = {k: v for k, v in metrics.items() if not k.rsplit("/", 1)[-1].startswith("num_")}
            announce(
                f"evaluation at step {self.step} ({self.cfg.data.test_split}):\n"
                + format_table({f"step {self.step}": shown})
            )

    def _progress_bar(self) -> Any:
        # Without a terminal (a SLURM log, a pipe) a bar is noise: fit prints timestamped lines instead.
        if not (self.is_main and self.cfg.train.progress and sys.stderr.isatty()):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

    def _log_train(self, window: list[StepResult]) -> None:
        data = gather_counts(self.data_events)  # a collective: every rank, every log step
        if self.logger is None or not window:
            return
        step_time = sum(r.step_time for r in window) / len(window)
        values: dict[str, Any] = {
            "loss": sum(r.loss for r in window) / len(window),
            "lr": window[-1].lr,
            "images_per_s": self.cfg.data.global_batch_size / max(step_time, 1e-9),
            "step_time": step_time,
            "data_time": sum(r.data_time for r in window) / len(window),
            "chunks": window[-1].chunks,
            "epoch": self.step / self.steps_per_epoch,
        }
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        values["lr_backbone"], values["lr_head"] = lrs[0], lrs[-1]
        if window[-1].grad_norm is not None:
            values["grad_norm"] = window[-1].grad_norm
        values["data_replaced_classes"] = data["replaced_classes"]
        values["data_decode_errors"] = data["decode_errors"]
        values["data_bad_shards"] = data["bad_shards"]
        self.logger.log("train", self.step, values)
        if self._show_lines:
            start_step, t_start = self._clock
            done = self.step - start_step
            per_step = (time.perf_counter() - t_start) / max(done, 1)
            line = StepLine(
                step=self.step,
                total=self.total_steps,
                epoch=values["epoch"],
                loss=values["loss"],
                images_per_s=values["images_per_s"],
                data_time=values["data_time"],
                lrs=[lrs[0], lrs[-1]] if len(lrs) > 1 else lrs,
                memory=peak_memory(self.device),
                eta_s=per_step * (self.total_steps - self.step),
            )
            announce(str(line))

    def _write_reports(self, summary: dict[str, Any]) -> None:
        records = read_metrics(self.out_dir / "metrics.jsonl")
        plots = write_plots(records, self.out_dir) if self.cfg.train.plots else []
        evals = [r for r in records if r.get("kind") == "eval"]
        tables = {}
        if evals:
            rows = {
                f"step {r['step']}": {k: v for k, v in r.items() if k not in ("kind", "step")} for r in evals
            }
            tables["Evaluation"] = format_table(rows)
        facts = {
            "processes": f"{self.world_size} ({self.accelerator.distributed_type.value}, device {self.device.type})",
            "global batch": f"{self.cfg.data.global_batch_size} ({self.local_batch} per rank)",
            "step": "chunked, chunk " + str(self.chunk_size) if self.chunk_size else "direct",
            "steps": f"{summary['steps']} of {self.total_steps} ({summary['steps_this_run']} in this run)",
            "time": f"{summary['seconds']:.1f} s, {summary['images_per_s']:.1f} images/s",
        }
        if summary["resumed_from"]:
            facts["resumed from"] = summary["resumed_from"]
        data = summary["data"]
        facts["data"] = (
            f"{data['replaced_classes']} class(es) replaced, {data['decode_errors']} decode error(s), "
            f"bad shards: {', '.join(data['bad_shards']) or 'none'}"
        )
        if data["categories_left_out"]:
            facts["categories left out"] = "; ".join(data["categories_left_out"])
        for i, note in enumerate(self.notes, start=1):
            facts[f"note {i}"] = note.replace("\n", " ")
        if summary["best_step"] is not None:
            facts["best"] = (
                f"{self.cfg.train.best_metric} {100 * summary['best_value']:.2f} at step {summary['best_step']}"
            )
        write_summary(
            self.out_dir / "summary.md",
            title=f"Run {self.out_dir.name}",
            config=to_dict(self.cfg),
            records=records,
            facts=facts,
            tables=tables,
            plots=plots,
        )

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release files and the process group (safe to call twice)."""
        if self.logger is not None:
            self.logger.close()
            self.logger = None
        self._drop_feed()

    def _drop_feed(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None


def run_training(cfg: Config) -> dict[str, Any]:
    """Entry point: build the trainer, fit, and always tear down (STYLE 1: thin, try/finally).

    In a multi-process run, an exception other than the agreed ones (``AGREED_ERRORS``) is this rank's alone:
    the process prints it and ends at once, so that the launcher stops the ranks waiting for it in a collective.
    """
    trainer: Trainer | None = None
    try:
        trainer = Trainer(cfg)
        return trainer.fit()
    except AGREED_ERRORS:
        raise
    except Exception as exc:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if trainer is not None:
                trainer.close()  # flushes metrics.jsonl; no collective
            # The step that failed, counted from 1 as in the logs.
            end_process_after_failure(
                "ddp-rank train", exc, trainer.step + 1 if trainer is not None else None
            )
        raise
    finally:
        if trainer is not None:
            trainer.close()
            trainer.accelerator.end_training()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
