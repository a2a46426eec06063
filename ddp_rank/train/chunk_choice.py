"""``distributed.chunk_size=auto``: the largest chunk of the chunked step whose activations fit the memory budget.

The choice itself (:func:`choose_chunk`) is a pure function of the per-image activation bytes, the budget and the
local batch: the largest chunk that fits, never more, and no chunk at all when the whole local batch fits. What
feeds it is measured at start-up on the real model at the real image size (:func:`measure_activation_bytes`):

- on a GPU, the peak of allocated memory during a forward + backward of probe batches of 2 and 4 images; the
  difference per image separates the activations from what does not grow with the batch (workspaces, the weights'
  gradients);
- on CPU, where nothing tracks allocations, the bytes of every tensor autograd saves for the backward pass
  (``torch.autograd.graph.saved_tensors_hooks``), which is what a training step holds per image.

Both probe a copy of the network with BatchNorm frozen (a train-mode layer keeps tensors of the same sizes for the
backward pass, and a probe of 2 images could not form a BatchNorm group), under the run's autocast and with
the RNG forked, so the run's model, buffers and random stream are untouched. One unmeasured forward + backward
comes first: the first step of a fresh copy sets up one-time state (cuBLAS / cuDNN workspaces), which would count
in the small probe only and make the growth per image look smaller than it is.

The budget (:func:`memory_budget`) is ``distributed.memory_fraction`` of one of three figures:

- on a GPU, its free memory (the caching allocator's unused blocks released first) less what the step needs
  besides activations (weights' gradients, Adam's two moments, the loss's work space);
- on CPU, ``distributed.memory_budget_mb`` when set. The fraction applies here too because the CPU figure per
  image is low: the resident memory of a step grows 8-11% more per image than the bytes autograd saves
  (ResNet-18 and EfficientNet-Lite0 at 64 px, measured through peak RSS), so 0.8 of the stated budget keeps the
  chunk inside it;
- else the node's available memory (the smaller of ``MemAvailable`` and what the process's cgroup still allows:
  a SLURM ``--mem`` job, a container; ``ddp_rank.train.host_memory``) shared by its processes, less the same
  fixed needs.

Every rank measures; all take the smallest chunk, so the ranks agree.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ddp_rank.config import Config
from ddp_rank.model import freeze_batchnorm
from ddp_rank.model.feature_head import example_input
from ddp_rank.train.host_memory import available_memory

__all__ = ["ChunkChoice", "auto_chunk", "choose_chunk", "measure_activation_bytes", "memory_budget"]

PROBE_SIZES = (2, 4)


@dataclass(frozen=True)
class ChunkChoice:
    """The chunk chosen (None: the local batch fits, direct step) and the figures it was chosen from."""

    chunk: int | None
    bytes_per_image: int
    budget_bytes: int
    local_batch: int
    how: str  # where the figures come from, for the log

    def describe(self) -> str:
        per_image, budget = _mib(self.bytes_per_image), _mib(self.budget_bytes)
        verdict = (
            f"the local batch of {self.local_batch:,} fits ({_mib(self.bytes_per_image * self.local_batch)}): "
            "direct step"
            if self.chunk is None
            else f"the local batch of {self.local_batch:,} runs in chunks of {self.chunk:,}"
        )
        return f"distributed.chunk_size=auto: {per_image} of activations per image, budget {budget} ({self.how}): {verdict}"


def auto_chunk(
    model: nn.Module,
    cfg: Config,
    local_batch: int,
    global_batch: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    loss_work_space: int,
    local_processes: int | None = None,
) -> ChunkChoice:
    """Measure this rank's model and budget and choose its chunk (the trainer then takes the smallest over the
    ranks). Besides activations the step holds the weights' gradients, Adam's two moments and the loss's work
    space (the gathered database, its gradient and one chunk of query rows)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    database = 2 * global_batch * cfg.model.embedding_dim * 4
    fixed = 3 * params + database + loss_work_space
    per_image, measured = measure_activation_bytes(model, cfg.data.image_size, device, autocast_dtype)
    if local_processes is None:  # the processes of this node share its memory
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget, decided = memory_budget(
        device, cfg.distributed.memory_fraction, cfg.distributed.memory_budget_mb, fixed, local_processes
    )
    chunk = choose_chunk(local_batch, per_image, budget)
    return ChunkChoice(chunk, per_image, budget, local_batch, f"{measured}; {decided}")


def choose_chunk(local_batch: int, bytes_per_image: int, budget_bytes: int) -> int | None:
    """The largest chunk whose activations fit ``budget_bytes``; None when the whole local batch fits. Raises
    ValueError when not even one image fits (the message says what to change)."""
    if bytes_per_image <= 0 or local_batch * bytes_per_image <= budget_bytes:
        return None
    chunk = budget_bytes // bytes_per_image
    if chunk < 1:
        raise ValueError(
            f"one image's activations ({_mib(bytes_per_image)}) exceed the memory budget ({_mib(budget_bytes)}): "
            "use a smaller data.image_size or backbone, raise distributed.memory_fraction / memory_budget_mb, or "
            "set distributed.chunk_size by hand"
        )
    return int(chunk)


def memory_budget(
    device: torch.device,
    fraction: float,
    budget_mb: int,
    fixed_bytes: int = 0,
    local_processes: int = 1,
) -> tuple[int, str]:
    """(bytes the step's activations may take, how that was decided); see the module docstring. ``fixed_bytes``:
    what the step needs besides activations on this device (gradients, optimizer state, the loss's work space)."""
    if device.type == "cuda":
        # The probe's blocks stay in PyTorch's cache after it returns: free them, or they count as used.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(fraction * free) - fixed_bytes
        return max(
            budget, 0
        ), f"{fraction:g} of {_mib(free)} free on {device}, less {_mib(fixed_bytes)} for the rest"
    if budget_mb:
        # The fraction is the margin for the resident memory the per-image count misses (module docstring).
        return int(fraction * budget_mb * 2**20), (
            f"distributed.memory_fraction={fraction:g} of distributed.memory_budget_mb={budget_mb}"
        )
    available, source = available_memory()
    share = available // max(local_processes, 1)
    budget = int(fraction * share) - fixed_bytes
    return max(budget, 0), (
        f"{fraction:g} of {_mib(share)} available ({source}) to each of {local_processes} process(es), less "
        f"{_mib(fixed_bytes)} for the rest"
    )


def measure_activation_bytes(
    model: nn.Module, image_size: int, device: torch.device, autocast_dtype: torch.dtype | None = None
) -> tuple[int, str]:
    """(activation bytes per image of a training forward + backward, how it was measured); see the module
    docstring. The model is not modified."""
    probe = copy.deepcopy(model).to(device)
    probe.train()
    freeze_batchnorm(probe)
    sizes: list[int] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for n in (PROBE_SIZES[0], *PROBE_SIZES):  # the first step only warms up: not measured
            images = example_input(probe, n, image_size, device)
            sizes.append(_step_bytes(probe, images, autocast_dtype))
    small, large = sizes[1:]
    grown = (large - small) // (PROBE_SIZES[1] - PROBE_SIZES[0])
    # The growth per image leaves out what does not grow with the batch (weights saved for backward, workspaces).
    per_image = max(grown if grown > 0 else small // PROBE_SIZES[0], 1)
    how = "peak allocated" if device.type == "cuda" else "saved for backward"
    precision = f" under {str(autocast_dtype).removeprefix('torch.')} autocast" if autocast_dtype else ""
    return per_image, f"{how}, probe of {PROBE_SIZES[0]} and {PROBE_SIZES[1]} images{precision}"


def _step_bytes(model: nn.Module, images: torch.Tensor, autocast_dtype: torch.dtype | None) -> int:
    """Bytes one forward + backward of ``images`` holds: peak allocated on CUDA, saved tensors on CPU."""
    device = images.device
    cast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else contextlib.nullcontext()
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with cast:
            model(images).float().sum().backward()
        torch.cuda.synchronize(device)
        used = torch.cuda.max_memory_allocated(device) - base
        model.zero_grad(set_to_none=True)
        return used
    with _count_saved() as saved, cast:
        out = model(images).float().sum()
    out.backward()
    model.zero_grad(set_to_none=True)
    return saved[0]


@contextlib.contextmanager
def _count_saved() -> Iterator[list[int]]:
    """Count the bytes of the tensors autograd saves for backward (each storage once)."""
    total = [0]
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _mib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
