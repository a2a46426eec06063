"""``distributed.chunk_size=auto``: the largest chunk of the chunked step whose activations fit the memory budget.

The choice itself (:func:`choose_chunk`) is a pure function of the per-image activation bytes, the budget and the
local batch: the largest chunk that fits, never more, and no chunk at all when the whole local batch fits. What
feeds it is measured at start-up on the real model at the real image size (:func:`measure_activation_bytes`):

- on a GPU, the peak of allocated memory during a forward + backward of probe batches; the growth per image
  separates the activations from what does not grow with the batch (workspaces, the weights' gradients);
- on CPU, where nothing tracks allocations, the bytes of every tensor autograd saves for the backward pass
  (``torch.autograd.graph.saved_tensors_hooks``), which is what a training step holds per image.

The probe batches grow geometrically (``PROBE_START`` images, then twice as many each time) until the growth per
image of two successive doublings agrees within ``STABLE_SPREAD``, from ``SETTLED_SIZE`` images on: cuDNN picks
its algorithm and workspace per shape, so the growth between 2 and 4 images can be far from the growth between
32 and 64, where a real chunk runs. The probe stops earlier at the local batch, at ``LARGEST_PROBE``, where the
next size's predicted activations would pass the budget, or at an out-of-memory error (then it keeps what it
measured). The growth per image is the larger of the last two. Every size is run once unmeasured before it is
measured on a GPU (cuDNN's benchmark mode tries algorithms, with their workspaces, at a shape's first call); the
very first step of the probe is unmeasured everywhere (one-time cuBLAS / cuDNN state).

Both probe a copy of the network with BatchNorm frozen (a train-mode layer keeps tensors of the same sizes for the
backward pass, and a probe of 2 images could not form a BatchNorm group), under the run's autocast and with
the RNG forked, so the run's model, buffers and random stream are untouched.

The budget (:func:`memory_budget`) is ``distributed.memory_fraction`` of one of three figures:

- on a GPU, its free memory (the caching allocator's unused blocks released first) less what the step holds
  besides activations (``ddp_rank.train.chunking.step_memory``: weights, gradients, DDP's buckets, NCCL's buffers,
  optimizer state, the loss's work space, and the workspaces the probe measured);
- on CPU, ``distributed.memory_budget_mb`` when set. The fraction applies here too because the CPU figure per
  image is low: the resident memory of a step grows 8-11% more per image than the bytes autograd saves
  (ResNet-18 and EfficientNet-Lite0 at 64 px, measured through peak RSS), so 0.8 of the stated budget keeps the
  chunk inside it;
- else the node's available memory (the smaller of ``MemAvailable`` and what the process's cgroup still allows:
  a SLURM ``--mem`` job, a container; ``ddp_rank.train.chunking.host_memory``) shared by its processes, less the same
  fixed costs.

Every rank measures; all take the smallest chunk, so the ranks agree. One real step then confirms the chunk
before training starts, backing off on an out-of-memory error (``ddp_rank.train.chunking.confirm``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ddp_rank.config import DataConfig
from ddp_rank.losses import ListwiseLoss
from ddp_rank.model import freeze_batchnorm
from ddp_rank.model.feature_head import FeatureHeadNet
from ddp_rank.train.chunking.host_memory import available_memory
from ddp_rank.train.chunking.step import PreparesBatch
from ddp_rank.train.chunking.step_memory import FixedCosts, fixed_costs, format_size
from ddp_rank.train.pml_loss import generic_work_space
from ddp_rank.train.step_settings import StepSettings

__all__ = [
    "ActivationProbe",
    "ChunkChoice",
    "auto_chunk",
    "choose_chunk",
    "database_bytes",
    "example_input",
    "loss_work_space",
    "measure_activation_bytes",
    "memory_budget",
    "most_positives",
    "probe_sizes",
]

PROBE_START = {"cuda": 2, "cpu": 1}
"""The first probe batch (run twice: the first run only warms up). One image on CPU, where the saved bytes grow
exactly linearly: the three sizes the growth needs then cost what two sizes from 2 images would."""
LARGEST_PROBE = 256
"""No probe batch above this many images: the growth per image has settled long before on every backbone here."""
SETTLED_SIZE = {"cuda": 32, "cpu": 4}
"""The smallest batch whose growth per image may end the probe: on a GPU, where cuDNN's choices settle."""
STABLE_SPREAD = 0.05
"""Two successive growths per image within this share of each other: the growth has settled."""


@dataclass(frozen=True)
class ActivationProbe:
    """What the probe measured: bytes per image, the bytes of the step that do not grow with the batch
    (``intercept``: workspaces and the weights' gradients on a GPU, saved weights on CPU), the batch sizes run,
    whether the growth settled, and why it stopped."""

    per_image: int
    intercept: int
    sizes: tuple[int, ...]
    settled: bool
    stopped: str
    how: str


@dataclass(frozen=True)
class ChunkChoice:
    """The chunk chosen (None: the local batch fits, direct step) and the figures it was chosen from."""

    chunk: int | None
    bytes_per_image: int
    budget_bytes: int
    local_batch: int
    how: str  # where the figures come from, for the log
    fixed: FixedCosts = field(default_factory=FixedCosts)
    probe: ActivationProbe | None = None

    def describe(self) -> str:
        per_image, budget = format_size(self.bytes_per_image), format_size(self.budget_bytes)
        verdict = (
            f"the local batch of {self.local_batch:,} fits ({format_size(self.bytes_per_image * self.local_batch)}): "
            "direct step"
            if self.chunk is None
            else f"the local batch of {self.local_batch:,} runs in chunks of {self.chunk:,}"
        )
        fixed = (
            f"; fixed {format_size(self.fixed.total)}: {self.fixed.describe()}" if self.fixed.total else ""
        )
        return (
            f"distributed.chunk_size=auto: {per_image} of activations per image, budget {budget} ({self.how}"
            f"{fixed}): {verdict}"
        )


def auto_chunk(
    model: nn.Module,
    step: StepSettings,
    local_batch: int,
    global_batch: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    loss_work_space: int,
    local_processes: int | None = None,
    world_size: int = 1,
    deepspeed: bool = False,
    extra_parameters: int = 0,
) -> ChunkChoice:
    """Measure this rank's model and budget and choose its chunk (the trainer then takes the smallest over the
    ranks and confirms it with one real step). Besides activations the step holds the fixed costs of
    ``ddp_rank.train.chunking.step_memory``; the loss's work space is ``loss_work_space`` plus the gathered database and
    its gradient."""
    fixed = step_fixed_costs(
        model,
        step,
        local_batch,
        global_batch,
        device,
        loss_work_space,
        world_size,
        deepspeed,
        extra_parameters,
    )
    if local_processes is None:  # the processes of this node share its memory
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget, decided = memory_budget(
        device,
        step.distributed.memory_fraction,
        step.distributed.memory_budget_mb,
        fixed.total,
        local_processes,
    )
    probe = measure_activation_bytes(
        model, step.data.image_size, device, autocast_dtype, budget_bytes=budget, largest=local_batch
    )
    if device.type == "cuda":  # what the probe held beyond its gradients and the activations: workspaces
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        fixed = fixed.with_workspaces(probe.intercept - grads)
        budget = max(budget - fixed.workspaces, 0)
    chunk = choose_chunk(local_batch, probe.per_image, budget)
    return ChunkChoice(chunk, probe.per_image, budget, local_batch, f"{probe.how}; {decided}", fixed, probe)


def step_fixed_costs(
    model: nn.Module,
    step: StepSettings,
    local_batch: int,
    global_batch: int,
    device: torch.device,
    loss_work_space: int,
    world_size: int,
    deepspeed: bool = False,
    extra_parameters: int = 0,
) -> FixedCosts:
    """What the step holds on one device besides activations (``step_memory.fixed_costs``), the loss's work
    space being ``loss_work_space`` plus the gathered database and its gradient (float32). The trainer's chunk
    choice and ``ddp-rank plan`` both take it (the plan without DeepSpeed and without a loss's own
    parameters, which only the trainer knows)."""
    database = database_bytes(global_batch, step.model.embedding_dim)
    fed, prepared = input_bytes(model, step.data.image_size)
    return fixed_costs(
        model,
        step.optim.name,
        step.optim.momentum,
        world_size,
        device,
        database + loss_work_space,
        deepspeed=deepspeed,
        extra_parameters=extra_parameters,
        input_batch_bytes=local_batch * fed,
        prepared_batch_bytes=local_batch * prepared,
    )


def database_bytes(global_batch: int, embedding_dim: int) -> int:
    """What every rank holds of the gathered batch while the loss runs: its embeddings and their gradient,
    float32."""
    return 2 * global_batch * embedding_dim * 4


def example_input(model: nn.Module, n: int, image_size: int, device: torch.device) -> torch.Tensor:
    """A batch of ``n`` inputs of the shape ``model`` takes, for the probe and the trial step: random vectors for
    a feature head, random uint8 images else."""
    if isinstance(model, FeatureHeadNet):
        return torch.randn(n, model.input_dim, device=device)
    return torch.randint(0, 256, (n, 3, image_size, image_size), dtype=torch.uint8, device=device)


def input_bytes(model: nn.Module, image_size: int) -> tuple[int, int]:
    """Bytes of one input of ``model``: as the trainer feeds it (uint8 pixels, or a feature vector), and as the
    chunked step keeps it prepared for both passes (a :class:`PreparesBatch` model fed uint8 images: floats in
    the weights' dtype; 0 where nothing is prepared ahead: feature vectors, which are taken as they are, or a
    model that prepares each chunk in its own forward)."""
    one = example_input(model, 1, image_size, torch.device("meta"))
    prepares = isinstance(model, PreparesBatch) and one.dtype == torch.uint8
    prepared = one.numel() * next(model.parameters()).element_size() if prepares else 0
    return one.numel() * one.element_size(), prepared


def loss_work_space(
    loss: nn.Module | None, local_batch: int, global_batch: int, positives: int, device: torch.device
) -> tuple[int, int]:
    """(bytes, query rows) of the largest chunk of this rank's query rows a step's loss holds besides the gathered
    database: a listwise loss's own chunk plan for classes of up to ``positives`` images, else (a
    pytorch-metric-learning loss, or None for one not built) :func:`generic_work_space` over the whole batch.
    The run's chunk choice and ``ddp-rank plan`` both take it."""
    if isinstance(loss, ListwiseLoss):
        return loss.work_space(local_batch, global_batch, positives, device)
    return generic_work_space(global_batch), local_batch


def most_positives(data: DataConfig, largest_class: int) -> int:
    """The most images of one class a step can hold: K under the ``pk`` sampler (``data.sampler=auto`` never
    resolves to it), else the largest class of the split, at most the global batch."""
    return data.images_per_class if data.sampler == "pk" else min(largest_class, data.global_batch_size)


def choose_chunk(local_batch: int, bytes_per_image: int, budget_bytes: int) -> int | None:
    """The largest chunk whose activations fit ``budget_bytes``; None when the whole local batch fits. Raises
    ValueError when not even one image fits (the message says what to change)."""
    if bytes_per_image <= 0 or local_batch * bytes_per_image <= budget_bytes:
        return None
    chunk = budget_bytes // bytes_per_image
    if chunk < 1:
        raise ValueError(
            f"one image's activations ({format_size(bytes_per_image)}) exceed the memory budget ({format_size(budget_bytes)}): "
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
    what the step needs besides activations on this device (``ddp_rank.train.chunking.step_memory``)."""
    if device.type == "cuda":
        # The probe's blocks stay in PyTorch's cache after it returns: free them, or they count as used.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(fraction * free) - fixed_bytes
        return (
            max(budget, 0),
            f"{fraction:g} of {format_size(free)} free on {device}, less {format_size(fixed_bytes)} for the rest",
        )
    if budget_mb:
        # The fraction is the margin for the resident memory the per-image count misses (module docstring).
        return int(fraction * budget_mb * 2**20), (
            f"distributed.memory_fraction={fraction:g} of distributed.memory_budget_mb={budget_mb}"
        )
    available, source = available_memory()
    share = available // max(local_processes, 1)
    budget = int(fraction * share) - fixed_bytes
    return max(budget, 0), (
        f"{fraction:g} of {format_size(share)} available ({source}) to each of {local_processes} process(es), less "
        f"{format_size(fixed_bytes)} for the rest"
    )


def probe_sizes(
    measured: dict[int, int], device_type: str, budget_bytes: int | None, largest: int | None
) -> tuple[int | None, str]:
    """(the next probe batch after the sizes ``measured`` (batch -> bytes, in the order run), or None to stop;
    why it stops): the growth per image settled, or the next batch would pass the local batch, ``LARGEST_PROBE``
    or (by the growth so far) the budget. The first two sizes are always ``PROBE_START`` and twice that."""
    start = _start(device_type)
    sizes = list(measured)
    if len(sizes) < 2:
        return start * 2 ** len(sizes), ""
    growths = _growths(measured)
    if sizes[-1] >= SETTLED_SIZE.get(device_type, SETTLED_SIZE["cpu"]) and _settled(growths):
        return None, "the growth per image settled"
    following = 2 * sizes[-1]
    if following > LARGEST_PROBE:
        return None, f"the largest probe, {LARGEST_PROBE} images"
    if largest is not None and following > max(largest, 2 * start):
        return None, f"the local batch of {largest}"
    if budget_bytes is not None and following * max(growths[-1], 0) > budget_bytes:
        return None, f"{following} images would pass the budget"
    return following, ""


def measure_activation_bytes(
    model: nn.Module,
    image_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    budget_bytes: int | None = None,
    largest: int | None = None,
) -> ActivationProbe:
    """The activation bytes per image of a training forward + backward, and how it was measured; see the module
    docstring. ``budget_bytes``, ``largest`` (the local batch) bound the probe's batches. The model is not
    modified."""
    probe = copy.deepcopy(model).to(device)
    probe.train()
    freeze_batchnorm(probe)
    measured: dict[int, int] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        start = _start(device.type)
        _step_bytes(probe, example_input(probe, start, image_size, device), autocast_dtype)  # warm-up
        n, stopped = probe_sizes(measured, device.type, budget_bytes, largest)
        while n is not None:
            images = example_input(probe, n, image_size, device)
            try:
                # A new shape on a GPU: cuDNN chooses its algorithm first, then the step is measured.
                if device.type == "cuda" and n > start:
                    _step_bytes(probe, images, autocast_dtype)
                measured[n] = _step_bytes(probe, images, autocast_dtype)
            except torch.OutOfMemoryError:
                if len(measured) < 2:
                    raise
                stopped = f"out of memory at {n} images"
            if stopped.startswith("out of memory"):  # out of the except block: its frames hold no tensor now
                probe.zero_grad(set_to_none=True)
                del images
                torch.cuda.empty_cache()
                break
            n, stopped = probe_sizes(measured, device.type, budget_bytes, largest)
    growths = _growths(measured)
    settled = _settled(growths)
    stopped = stopped if settled or stopped.startswith("out of") else f"{stopped}, before the growth settled"
    grown = max(growths[-2:])
    sizes = tuple(measured)
    per_image = max(grown if grown > 0 else measured[sizes[0]] // sizes[0], 1)
    intercept = max(measured[sizes[-1]] - per_image * sizes[-1], 0)
    kind = "peak allocated" if device.type == "cuda" else "saved for backward"
    precision = f" under {str(autocast_dtype).removeprefix('torch.')} autocast" if autocast_dtype else ""
    how = f"{kind}, probes of {', '.join(map(str, sizes))} images{precision} (stopped: {stopped})"
    return ActivationProbe(per_image, intercept, sizes, settled, stopped, how)


def _start(device_type: str) -> int:
    return PROBE_START.get(device_type, PROBE_START["cpu"])


def _growths(measured: dict[int, int]) -> list[int]:
    """The growth per image between successive probe sizes."""
    sizes = list(measured)
    return [(measured[b] - measured[a]) // (b - a) for a, b in itertools.pairwise(sizes)]


def _settled(growths: list[int]) -> bool:
    return (
        len(growths) >= 2
        and growths[-1] > 0
        and abs(growths[-1] - growths[-2]) <= STABLE_SPREAD * growths[-1]
    )


def _step_bytes(model: nn.Module, images: torch.Tensor, autocast_dtype: torch.dtype | None) -> int:
    """Bytes one forward + backward of ``images`` holds: peak allocated on CUDA, saved tensors on CPU."""
    device = images.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with _autocast(device, autocast_dtype):
            model(images).float().sum().backward()
        torch.cuda.synchronize(device)
        used = torch.cuda.max_memory_allocated(device) - base
        model.zero_grad(set_to_none=True)
        return used
    with count_saved() as saved, _autocast(device, autocast_dtype):
        out = model(images).float().sum()
    out.backward()
    model.zero_grad(set_to_none=True)
    return saved[0]


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    return (
        torch.autocast(device_type=device.type, dtype=dtype)
        if dtype is not None
        else contextlib.nullcontext()
    )


@contextlib.contextmanager
def count_saved(limit: int | None = None) -> Iterator[list[int]]:
    """Count the bytes of the tensors autograd saves for backward; past ``limit`` bytes raise
    ``torch.OutOfMemoryError``, as a GPU's allocator would (the CPU stand-in of a memory limit).

    A tensor saved twice counts once. A saved view counts its own bytes, never more than its storage's in all:
    the chunked step's chunks are views of the batch prepared once before the loop (a fixed cost of its own),
    and a chunk's forward costs its rows of it, not the whole batch."""
    total = [0]
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    per_storage: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        view = (storage.data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
        if view not in seen:
            seen.add(view)
            before = per_storage.get(view[0], 0)
            after = min(storage.nbytes(), before + t.numel() * t.element_size())
            per_storage[view[0]] = after
            total[0] += after - before
            if limit is not None and total[0] > limit:
                raise torch.OutOfMemoryError(
                    f"the step's saved tensors reached {format_size(total[0])}, past the limit of {format_size(limit)}"
                )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
