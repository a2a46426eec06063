"""What a training step holds on its device besides the activations of the images it is computing, by kind.

``distributed.chunk_size=auto`` sizes the chunk from the memory left for activations once these are counted. At
the time it measures, none of them is on the device yet (the model is still on the CPU, the optimizer has no state,
DDP has no buckets), so they are counted from the parameters and the run's settings:

- weights: every parameter and buffer of the model, as stored;
- gradients: one more copy of every trainable parameter (``.grad``);
- DDP's gradient buckets: with more than one process DDP keeps every gradient once more, in flat buckets of
  ``bucket_cap_mb`` (25 MiB, accelerate's default) that it all-reduces (``gradient_as_bucket_view=False``,
  the default: the buckets are copies, not views of ``.grad``); DeepSpeed keeps its own buffers instead,
  sized by its config, which are not counted here;
- collective buffers: NCCL's staging buffers, allocated outside PyTorch's allocator at a communicator's first
  collectives: ``NCCL_BUFFSIZE`` (4 MiB unless set) for each channel (``NCCL_MAX_NCHANNELS``, up to 32), for the
  send and the receive side, for the ring and the tree connections: an upper estimate (0 on CPU or alone);
- optimizer state: Adam's and AdamW's two moments, SGD's momentum (allocated at the first optimizer step);
- the loss's work space: the gathered embeddings of the global batch and their gradient, and the largest chunk
  of query rows of the loss's own chunk plan (``ListwiseLoss.work_space``);
- input batches: the local batch in the model's input form (uint8 pixels, or feature vectors), twice: the device
  feed copies the next batch while the step computes (``ddp_rank.train.device_feed``);
- the prepared batch: the chunked step converts and normalises the local batch's images once for both passes
  (``EmbeddingNet.prepare_batch``: floats in the weights' dtype, four times the uint8 bytes in float32) and holds
  them for the step;
- workspaces: what the probe's step held beyond its gradients that does not grow with the batch (cuDNN and cuBLAS
  workspaces, autocast's copies of the weights), measured on a GPU (0 on CPU, where saved weights are the
  parameters themselves).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

__all__ = ["FixedCosts", "collective_reserve", "fixed_costs", "format_size", "optimizer_state_copies"]

NCCL_DEFAULT_BUFFSIZE = 4 * 2**20
NCCL_DEFAULT_CHANNELS = 32


@dataclass(frozen=True)
class FixedCosts:
    """Bytes a step holds on one device besides its activations, by kind (see the module docstring)."""

    weights: int = 0
    gradients: int = 0
    ddp_buckets: int = 0
    collective_buffers: int = 0
    optimizer_state: int = 0
    loss_work_space: int = 0
    input_batches: int = 0
    prepared_batch: int = 0
    workspaces: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def not_yet_allocated(self) -> int:
        """What the confirmation step must hold aside to stand for the parts a first step allocates later than
        its backward: the optimizer's state (its first update), the loss's work space, NCCL's buffers, the input
        batches and the prepared batch (the trial makes only its own rows)."""
        return (
            self.optimizer_state
            + self.loss_work_space
            + self.collective_buffers
            + self.input_batches
            + self.prepared_batch
        )

    def with_workspaces(self, workspaces: int) -> FixedCosts:
        return replace(self, workspaces=max(int(workspaces), 0))

    def describe(self) -> str:
        """``weights 98.0 MiB + gradients 97.5 MiB + ...`` (the kinds that are not zero), for the log and the plan."""
        parts = [
            f"{f.name.replace('_', ' ')} {format_size(getattr(self, f.name))}"
            for f in fields(self)
            if getattr(self, f.name)
        ]
        return " + ".join(parts) if parts else "nothing"


def fixed_costs(
    model: nn.Module,
    optimizer: str,
    momentum: float,
    world_size: int,
    device: torch.device,
    loss_work_space: int,
    deepspeed: bool = False,
    extra_parameters: int = 0,
    input_batch_bytes: int = 0,
    prepared_batch_bytes: int = 0,
) -> FixedCosts:
    """The :class:`FixedCosts` of training ``model`` with ``optimizer`` (``adam`` / ``adamw`` / ``sgd`` and its
    ``momentum``) on ``world_size`` processes; ``extra_parameters``: bytes of trainable parameters outside the
    model (a proxy loss's proxies), which have gradients and optimizer state too; ``input_batch_bytes``: one
    local batch as the model takes it (held twice); ``prepared_batch_bytes``: the chunked step's prepared copy of
    it (held once)."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    trainable += extra_parameters
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) + extra_parameters
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    return FixedCosts(
        weights=weights,
        gradients=trainable,
        ddp_buckets=trainable if world_size > 1 and not deepspeed else 0,
        collective_buffers=collective_reserve(world_size, device),
        optimizer_state=optimizer_state_copies(optimizer, momentum) * trainable,
        loss_work_space=loss_work_space,
        input_batches=2 * input_batch_bytes,
        prepared_batch=prepared_batch_bytes,
    )


def optimizer_state_copies(optimizer: str, momentum: float = 0.0) -> int:
    """How many copies of the trainable parameters the optimizer keeps as state."""
    if optimizer in ("adam", "adamw"):
        return 2
    if optimizer == "sgd":
        return 1 if momentum else 0
    raise ValueError(f"optim.name={optimizer!r}: valid are adam, adamw, sgd")


def collective_reserve(world_size: int, device: torch.device) -> int:
    """NCCL's staging buffers on one GPU (an upper estimate, module docstring); 0 on CPU (gloo) or alone."""
    if device.type != "cuda" or world_size < 2:
        return 0
    size = _env_int("NCCL_BUFFSIZE", NCCL_DEFAULT_BUFFSIZE)
    channels = _env_int("NCCL_MAX_NCHANNELS", NCCL_DEFAULT_CHANNELS)
    return size * channels * 2 * 2  # send and receive side; ring and tree connections


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "")) or default
    except ValueError:
        return default


def format_size(n: float) -> str:
    """Bytes in KiB, MiB or GiB, whichever reads best, for the chunk choice's log lines and errors."""
    if abs(n) < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"
