"""Starting a run: the parts a trainer is built from (the loss, the data stream, the network, DeepSpeed's batch
settings). The checks that must fail before any process group exists are those of the layers that own them:
``ddp_rank.runtime.open_training_shards`` (the shards) and ``ddp_rank.eval.settings.check_evaluation``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_rank.config import ConfigError, DataConfig, LossConfig, ModelConfig
from ddp_rank.data.features.records import feature_dim
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.feature_stream import FeatureStream
from ddp_rank.data.reading.shard_cache import open_cache
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import transform_from_config
from ddp_rank.losses import FastAPLoss, ListwiseLoss, ListwiseOptions, PNPLoss, SmoothAPLoss
from ddp_rank.model import EmbeddingNet, build_model, init_from, is_convolutional
from ddp_rank.runtime import TrainError
from ddp_rank.runtime.data_setup import resolve_sampler, schedule_config
from ddp_rank.runtime.shards import model_input_dim
from ddp_rank.train.batchnorm import convert_to_cross_rank
from ddp_rank.train.bn_mode import BatchNormMode
from ddp_rank.train.chunking.layout import BatchLayout
from ddp_rank.train.ghost_batchnorm import convert_to_ghost
from ddp_rank.train.pml_loss import PML_PREFIX, build_pml

__all__ = [
    "TrainingLoss",
    "build_loss",
    "build_network",
    "build_stream",
    "build_training_loss",
    "configure_deepspeed",
    "trainable_loss_parameters",
    "uses_deepspeed",
    "wants_channels_last",
]

log = logging.getLogger(__name__)

_PLAN_FIX = "`ddp-rank plan --config ...` shows what the shards allow"
"""The fix a refused data stream names: the plan of the same config says what the shards hold."""


@dataclass(frozen=True)
class TrainingLoss:
    """The loss a run trains with: a listwise loss, or a pytorch-metric-learning loss with its optional miner
    and a line for the log saying how it was built."""

    loss: nn.Module
    miner: nn.Module | None = None
    description: str | None = None

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The loss's own trainable parameters (a proxy loss's proxies); empty for most losses."""
        return [p for p in self.loss.parameters() if p.requires_grad]


def build_training_loss(loss: LossConfig, embedding_dim: int, manifest: Manifest) -> TrainingLoss:
    """The loss of the ``loss`` section: a pml loss sized on the shards' class count and ``embedding_dim``
    (``model.embedding_dim``: a proxy loss's proxies), else :func:`build_loss`."""
    if loss.name.startswith(PML_PREFIX):
        parts = build_pml(loss.name, loss.miner, len(manifest.classes), embedding_dim)
        return TrainingLoss(parts.loss, parts.miner, parts.description)
    return TrainingLoss(build_loss(loss))


def trainable_loss_parameters(
    training_loss: TrainingLoss, accelerator: Any, device: torch.device, loss_name: str
) -> list[nn.Parameter]:
    """The loss's own parameters (a proxy loss's proxies), moved to ``device``; refused where ``accelerator``
    cannot train them exactly (``loss_name``: ``loss.name``, for the message)."""
    params = training_loss.parameters
    if not params:
        return []
    if uses_deepspeed(accelerator) or accelerator.mixed_precision == "fp16":
        raise TrainError(
            f"loss.name={loss_name} has parameters of its own, which this run cannot train: DeepSpeed and fp16 "
            "loss scaling handle only the model's parameters. Use DDP (no DeepSpeed config) with "
            "train.mixed_precision=bf16 or no, or a loss without parameters"
        )
    training_loss.loss.to(device)
    return params


def build_loss(lc: LossConfig) -> ListwiseLoss:
    """The listwise loss the ``loss`` section names (it knows no ranks; :class:`GlobalBatchLoss` spreads it)."""
    if lc.name.startswith(PML_PREFIX):
        raise ConfigError(f"loss.name={lc.name} is not a listwise loss: build it with build_training_loss")
    budget = lc.memory_budget_mb * 2**20 if lc.memory_budget_mb else None
    common: ListwiseOptions = {
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


def build_stream(
    data: DataConfig, seed: int, manifest: Manifest, rank: int, world_size: int, run_dir: Path | None = None
) -> ShardStream:
    """The data layer's category-aware stream of this rank's local batches (uint8 pixels), from the ``data``
    section and ``seed`` (``Config.data_seed``). Feature shards are read once into one array
    (``FeatureStream``): a large split is memory-mapped from one file in the node-local cache folder
    (``data.cache_dir``), else beside the run in ``run_dir``."""
    if rank == 0 and data.sampler == "auto":
        strategy, why = resolve_sampler(data, manifest)
        log.info(f"sampler {strategy}: {why}")
    try:  # settings that cannot go together (steps_per_epoch with hard_unlabelled, say)
        schedule = schedule_config(data, manifest, seed)
    except ValueError as exc:
        raise TrainError(f"data: {exc}; {_PLAN_FIX}") from exc
    cache = open_cache(data.cache_dir, data.cache_max_gb)
    features = feature_dim(manifest) is not None
    table_dir = cache.directory if cache is not None else run_dir / "feature-table" if run_dir else None
    try:
        return (partial(FeatureStream, table_dir=table_dir) if features else ShardStream)(
            manifest,
            data.global_batch_size,
            split=data.train_split,
            schedule=schedule,
            transform=transform_from_config(data, augment=data.augment, pixels="uint8"),
            augment=data.augment,
            num_workers=data.num_workers,
            rank=rank,
            world_size=world_size,
            cache_dir=cache,
        )
    except ValueError as exc:  # the sampler settings cannot be met by these shards
        raise TrainError(f"data: {exc}; {_PLAN_FIX}") from exc


def build_network(
    model_cfg: ModelConfig,
    image_size: int,
    device: torch.device,
    batchnorm: BatchNormMode,
    deepspeed: bool = False,
    *,
    manifest: Manifest,
) -> tuple[EmbeddingNet, list[str]]:
    """The embedding network on this device's layout, with what the user must hear about it (``init_from``'s
    report), from the ``model`` section at ``image_size`` (``data.image_size``). Channels-last where
    :func:`wants_channels_last` says; BatchNorm as ``batchnorm`` (the layout's mode) says: across ranks with
    ``model.sync_bn``, over groups of local images with ``model.bn_group_size``.
    ``manifest``: the run's shards (loaded once), whose vectors' length a feature head takes."""
    notes: list[str] = []
    model = build_model(model_cfg, image_size, model_input_dim(model_cfg.backbone, manifest))
    if model_cfg.init_from:
        notes.append(init_from(model, model_cfg.init_from).summary())
    if wants_channels_last(model, device, deepspeed):
        model.use_channels_last()
    if batchnorm.kind == "groups":
        convert_to_ghost(model, batchnorm.group)
    if model_cfg.sync_bn:
        # In place (an EmbeddingNet is not itself a BatchNorm layer); PyTorch's fused SyncBatchNorm on CUDA.
        convert_to_cross_rank(model, cuda=device.type == "cuda")
    return model, notes


def wants_channels_last(model: EmbeddingNet, device: torch.device, deepspeed: bool) -> bool:
    """Channels-last weights and inputs for a convolutional backbone on CUDA (cuDNN's fast layout), except under
    DeepSpeed: ZeRO makes every weight a view of its flat buffer in the standard layout, so channels-last set
    before ``prepare`` fails there (DeepSpeed 0.19 broadcasts each weight viewed as bytes) or would be lost in
    the views, and set after it, it would give the weights new storage apart from the buffer the optimizer
    updates: training would silently stop (tests/train/test_zero_layout.py shows both)."""
    return device.type == "cuda" and is_convolutional(model) and not deepspeed


def uses_deepspeed(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs DeepSpeed (its launcher gave it a DeepSpeed plugin)."""
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def configure_deepspeed(accelerator: Any, layout: BatchLayout, grad_clip: float) -> bool:
    """Give DeepSpeed the batch sizes accelerate would otherwise take from a prepared loader; False when the
    run does not use DeepSpeed."""
    if not uses_deepspeed(accelerator):
        return False
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = layout.local_batch
    ds["train_batch_size"] = layout.global_batch
    ds["gradient_accumulation_steps"] = 1
    # Always set: DeepSpeed clips the gradient norm to 1.0 when the key is absent, which would silently
    # change the update (0.0 turns clipping off, as optim.grad_clip = 0 means here).
    ds["gradient_clipping"] = float(grad_clip)
    return True
