"""Gradient equality of the chunked step: one chunked and one direct optimizer step from the same weights and the
same batch, under each engine, and their weight CHANGES compared parameter by parameter.

    python -m benchmarks.acceptance.grad_check --device cuda --runs plain:fp32,zero2:bf16 --json grads.json
    python -m benchmarks.acceptance.grad_check --device cpu --processes 2 --runs ddp:fp32,ddp:fp32:drop-chunks

The optimizer is SGD with lr 1, no momentum, no weight decay and no clipping (DeepSpeed's default clipping of the
norm to 1.0 is switched off), so a step's change of the float32 (master) weights IS minus the averaged gradient:
comparing the changes compares the gradients each engine applied, after its reductions and its precision path,
which is where a chunked step that lost chunks shows (DeepSpeed ZeRO-1/2 keep only the last backward's gradient
unless the step's backwards are coalesced, ``ddp_rank.train.backends.DeepSpeedBackend``). The model is the
trainer's ``EmbeddingNet`` with its BatchNorm frozen (eval mode: the chunked step refuses train-mode BatchNorm),
the loss FastAP through ``GlobalBatchLoss``, the batch uint8 images in classes of 4, the local batch cut into
``--batch / --chunk`` chunks (4 by default: a step that kept only the last chunk would be about 3/4 off).

Each ``--runs`` entry is ``ENGINE:PRECISION[:FAULT]``:

- engines: ``plain`` (no wrapper), ``ddp`` (``DistributedDataParallel``: ``no_sync`` on every chunk but the
  last), ``zero1`` and ``zero2`` (DeepSpeed, the engine driven directly);
- precisions: ``fp32`` (on CUDA with TF32 off, for matmuls and cuDNN alike: TF32 rounds to 10 bits and would
  blur a float32 comparison) and ``bf16`` (autocast for plain / DDP, DeepSpeed's bf16 mode for ZeRO, which casts
  every weight);
- faults, the broken builds the check must catch: ``drop-chunks`` (every backward starts from no gradient, as a
  ``zero_grad`` inside the chunk loop would do: the step keeps only its last chunk's) and ``no-coalescing``
  (DeepSpeed only: the chunks' backwards without ``engine.coalesce_grad_reduction()``, the regression the
  backend exists to prevent).

``--processes`` ranks are started here (spawn), one per GPU on CUDA (NCCL) or as gloo CPU processes; a rank's
part of the global batch is ``--batch`` rows. Every run is a row of ``--json`` (rewritten after each run, so a
run stopped part way keeps the rows it finished): the relative error of the whole update vector, the worst
tensor's, the direct update's norm, on CUDA the peak memory of each step, and the comparison's noise floor
(``floor_rel``, ``floor_worst_rel``): how far a second direct step, the convolutions in the other memory layout,
lands from the first. Two correct float32 steps of a freshly initialised ResNet-50 are that far apart: 2.1 % of
the whole update between contiguous and channels-last on CPU (2026-11-26), where the chunked step was 3e-6 from
the direct one; on an H200 the chunked step was 1.5 % off (cuDNN picks other kernels for a chunk's shape).
``benchmarks/acceptance/gpu_targets.py`` (``grads_verdicts``) judges them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

ENGINES = ("plain", "ddp", "zero1", "zero2")
PRECISIONS = ("fp32", "bf16")
FAULTS = ("none", "drop-chunks", "no-coalescing")
_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Run:
    """One comparison: the engine, the precision, and the fault built into the step (``none``: the real one)."""

    engine: str
    precision: str
    fault: str = "none"

    @classmethod
    def parse(cls, spec: str) -> Run:
        parts = spec.strip().split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"run {spec!r}: write ENGINE:PRECISION[:FAULT], e.g. zero2:bf16 or plain:fp32:drop-chunks")
        run = cls(*parts)
        for value, allowed, what in ((run.engine, ENGINES, "engine"), (run.precision, PRECISIONS, "precision"),
                                     (run.fault, FAULTS, "fault")):  # fmt: skip
            if value not in allowed:
                raise ValueError(f"run {spec!r}: unknown {what} {value!r}, one of {', '.join(allowed)}")
        if run.fault == "no-coalescing" and not run.engine.startswith("zero"):
            raise ValueError(f"run {spec!r}: no-coalescing is a DeepSpeed fault (zero1, zero2)")
        return run

    @property
    def name(self) -> str:
        return f"{self.engine}:{self.precision}" + (f":{self.fault}" if self.fault != "none" else "")


@dataclass(frozen=True)
class Setup:
    """What every run of one invocation shares: device kind, model and batch."""

    device: str
    backbone: str
    image_size: int
    batch: int
    chunk: int
    embedding_dim: int = 64


# ----------------------------------------------------------------------------------------- the comparison
def compare_updates(chunked: dict[str, Tensor], direct: dict[str, Tensor]) -> dict[str, Any]:
    """The chunked step's weight changes against the direct step's: ``update_rel`` = ||c - d|| / ||d|| over the
    whole update vector, ``worst_rel`` and ``worst_tensor``: the largest of the same ratio tensor by tensor (a
    tensor the direct step left unchanged counts as infinitely off if the chunked step moved it), and the direct
    update's norm (a step that moved nothing cannot be compared: the verdict then fails it)."""
    if chunked.keys() != direct.keys():
        raise ValueError(f"the two steps updated different tensors: {sorted(chunked.keys() ^ direct.keys())}")
    diff_sq = ref_sq = 0.0
    worst, worst_name = 0.0, ""
    for name, d in direct.items():
        c = chunked[name].double()
        d = d.double()
        diff, ref = float((c - d).norm()), float(d.norm())
        diff_sq, ref_sq = diff_sq + diff**2, ref_sq + ref**2
        rel = diff / ref if ref > 0 else (math.inf if diff > 0 else 0.0)
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
    update_rel = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.inf
    return {"update_rel": update_rel, "worst_rel": worst, "worst_tensor": worst_name, "direct_norm": math.sqrt(ref_sq)}


# ----------------------------------------------------------------------------------------- the faults
class _DropEarlierChunks:
    """Fault ``drop-chunks``: every backward starts from no gradient (a ``zero_grad`` inside the chunk loop), so a
    chunked step keeps only its last chunk's; the direct step, one backward, is unchanged."""

    def __init__(self, backend: Any, module: nn.Module) -> None:
        self._backend, self._module = backend, module

    def backward(self, objective: Tensor) -> None:
        for p in self._module.parameters():
            p.grad = None
        self._backend.backward(objective)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class _NoCoalescing:
    """Fault ``no-coalescing``: the step's backwards run outside ``engine.coalesce_grad_reduction()``; each is
    then its own reduction boundary and ZeRO-1/2 keep only the last one's gradient."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def accumulate(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


# ----------------------------------------------------------------------------------------- one step
def global_batch(setup: Setup, world: int) -> tuple[Tensor, Tensor]:
    """The global batch on the CPU, the same in every rank and run: uint8 images, classes of 4 rows.

    Each image is a smooth colour field, its class's (4 x 4 colours) plus a fainter one of its own (8 x 8),
    scaled up: unlike white noise, which a network's pooling averages into the same vector for every image,
    such images give embeddings that differ (see ``calibrate_batchnorm`` for why that matters)."""
    n, size = setup.batch * world, setup.image_size
    g = torch.Generator().manual_seed(1234)
    per_class = torch.rand(n // 4 + 1, 3, 4, 4, generator=g).repeat_interleave(4, dim=0)[:n]
    own = torch.rand(n, 3, 8, 8, generator=g)
    field = sum(w * nn.functional.interpolate(f, size=size, mode="bilinear", align_corners=False)
                for w, f in ((0.7, per_class), (0.3, own)))  # fmt: skip
    images = (cast(Tensor, field) * 255).round().clamp(0, 255).to(torch.uint8)
    return images, torch.arange(n) // 4


def calibrate_batchnorm(model: nn.Module, images: Tensor, chunk: int) -> None:
    """Set every BatchNorm's running statistics to those of ``images`` (chunk by chunk, averaged), then freeze.

    Why: a freshly initialised network has running statistics 0 and 1, so its frozen BatchNorm normalises
    nothing; through ResNet-50's residual sums one direction then dominates every image's features, the
    embeddings of all images nearly coincide (pairwise distances about 1e-3) and a parameter's gradient is the
    small remainder of large per-image terms that cancel (the update's norm was 4.8e-4, against 1.8 with these
    statistics). Measured on CPU, 2026-11-26: the chunked step was 1.5e-4 off the direct one without them, 3e-6
    with them. The network still amplifies rounding that differs between kernels (the noise floor,
    ``noise_floor``), but no longer a batch of 32 against one of 128 on the same kernels."""
    from ddp_rank.model.net import freeze_batchnorm

    norms = {m: m.momentum for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the chunks
        m.train()
    with torch.no_grad():
        for start in range(0, len(images), chunk):
            model(images[start : start + chunk])
    for m, momentum in norms.items():
        m.momentum = momentum
    freeze_batchnorm(model)


def one_step(
    run: Run, setup: Setup, rank: int, world: int, chunk_size: int | None, other_layout: bool = False
) -> tuple[dict[str, Tensor], float]:
    """One SGD step (lr 1) of ``run``'s engine on this rank's part of the global batch, from the seed-0 weights:
    the change of every float32 (master) weight, on the CPU, and the step's peak device memory in MB (0 on CPU).
    ``other_layout``: the convolutions in the memory layout the trainer would not pick (channels-last against
    contiguous), the same maths through other kernels: the noise floor of the comparison."""
    from ddp_rank.config import ModelConfig
    from ddp_rank.distributed import GlobalBatchLoss
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.model import build_model
    from ddp_rank.train import DDPBackend, DeepSpeedBackend, PlainBackend, StepBackend, forward_backward
    from ddp_rank.train.setup import wants_channels_last

    device = _device(setup.device, rank)
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=setup.backbone, weights="none", embedding_dim=setup.embedding_dim),
                        setup.image_size).to(device)  # fmt: skip
    deepspeed = run.engine.startswith("zero")
    if wants_channels_last(model, device, deepspeed) != other_layout:
        model.use_channels_last()  # the trainer's layout, unless asked for the other
    model.train()
    images, labels = global_batch(setup, world)
    calibrate_batchnorm(model, images.to(device), setup.chunk)
    bf16 = run.precision == "bf16"
    weights: Callable[[], dict[str, Tensor]]
    if deepspeed:
        engine = _deepspeed_engine(model, int(run.engine[-1]), bf16, setup.batch)
        backend: StepBackend = DeepSpeedBackend(engine)
        optimizer_step: Callable[[], None] = engine.step
        weights = lambda: _master_weights(engine.module)  # noqa: E731
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0, weight_decay=0.0)
        optimizer_step = optimizer.step
        autocast = torch.bfloat16 if bf16 else None
        if run.engine == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
            backend = DDPBackend(wrapped, autocast_dtype=autocast)
        else:
            backend = PlainBackend(model, autocast_dtype=autocast)
        weights = lambda: {n: p.detach().float().clone() for n, p in model.named_parameters()}  # noqa: E731
    if run.fault == "drop-chunks":
        backend = cast(StepBackend, _DropEarlierChunks(backend, backend.bare_module))
    elif run.fault == "no-coalescing":
        backend = cast(StepBackend, _NoCoalescing(backend))
    rows = slice(rank * setup.batch, (rank + 1) * setup.batch)
    inputs, local_labels = images[rows].to(device), labels[rows].to(device)
    before = weights()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start_mb = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    forward_backward(backend, inputs, local_labels, GlobalBatchLoss(FastAPLoss(num_bins=10)), chunk_size)
    optimizer_step()
    peak_mb = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20 - start_mb
    after = weights()
    return {name: (after[name] - before[name]).cpu() for name in before}, peak_mb


_FLOORS: dict[tuple[str, str], dict[str, Any]] = {}


def noise_floor(run: Run, setup: Setup, rank: int, world: int) -> dict[str, Any]:
    """Two direct steps of ``run``'s engine and precision, the convolutions in each memory layout, compared: how
    far apart two correct steps land (measured once per engine and precision). DeepSpeed cannot hold a
    channels-last model (its broadcast views every weight as bytes, which needs a contiguous tensor), so its rows
    take the plain engine's floor, the same maths in the same precision."""
    engine = "plain" if run.engine.startswith("zero") else run.engine
    key = (engine, run.precision)
    if key not in _FLOORS:
        base = Run(engine, run.precision)
        direct, _ = one_step(base, setup, rank, world, chunk_size=None)
        other, _ = one_step(base, setup, rank, world, chunk_size=None, other_layout=True)
        _FLOORS[key] = compare_updates(other, direct)
    return _FLOORS[key]


def _device(kind: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def _deepspeed_engine(model: nn.Module, stage: int, bf16: bool, batch: int) -> Any:
    import deepspeed

    from ddp_rank.train.batchnorm import match_batchnorm_buffers_to_weights

    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed clips the norm to 1.0 when the config does not say
        "bf16": {"enabled": bf16},
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    match_batchnorm_buffers_to_weights(engine.module)  # as the trainer: bf16 weights, float32 running statistics
    return engine


def _master_weights(module: nn.Module) -> dict[str, Tensor]:
    """The float32 weights ZeRO's optimizer steps (in bf16 the module holds only their bf16 copies, which would
    round a small update away)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in module.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[name] = (full if full is not None else p).detach().float().clone()
    return out


def compare(run: Run, setup: Setup, rank: int, world: int) -> dict[str, Any]:
    """``run``'s row: the chunked step's update against the direct step's, from the same weights and batch."""
    fp32 = run.precision == "fp32"
    if setup.device == "cuda":  # float32 means float32: TF32 (on by default for cuDNN) rounds to 10 bits
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's default
        torch.backends.cudnn.allow_tf32 = not fp32  # torch's default is True
    direct, direct_mb = one_step(run, setup, rank, world, chunk_size=None)
    chunked, chunked_mb = one_step(run, setup, rank, world, chunk_size=setup.chunk)
    floor = noise_floor(run, setup, rank, world)
    row = {"engine": run.engine, "precision": run.precision, "fault": run.fault, "processes": world,
           "local_batch": setup.batch, "chunk": setup.chunk, "chunks": math.ceil(setup.batch / setup.chunk),
           **compare_updates(chunked, direct), "floor_rel": floor["update_rel"], "floor_worst_rel": floor["worst_rel"]}  # fmt: skip
    if setup.device == "cuda":
        row.update(peak_mb_direct=direct_mb, peak_mb_chunked=chunked_mb, device=torch.cuda.get_device_name(rank))
    return row


# ----------------------------------------------------------------------------------------- the ranks
def rank_main(rank: int, world: int, port: int, setup: Setup, runs: list[Run], out: str | None) -> None:
    """One rank: join the group, run every comparison (rank 0 writes the rows after each), leave the group."""
    from ddp_rank.distributed import end_process_group

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR=_HOST, MASTER_PORT=str(port))  # fmt: skip
    if setup.device == "cpu":
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")  # before DeepSpeed picks its accelerator
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(rank)
    store = dist.TCPStore(_HOST, port, world_size=None, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl" if setup.device == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))  # fmt: skip
    rows: list[dict[str, Any]] = []
    failed = False
    try:
        for run in runs:
            try:
                row = compare(run, setup, rank, world)
            except Exception as exc:  # the next runs still go; the row says why this one has no figures
                traceback.print_exc()
                failed = True
                row = {"engine": run.engine, "precision": run.precision, "fault": run.fault, "processes": world,
                       "error": f"{type(exc).__name__}: {exc}"[:500]}  # fmt: skip
            rows.append(row)
            if rank == 0 and out:
                Path(out).write_text(json.dumps(rows, indent=1))
            if rank == 0:
                print(json.dumps(row), flush=True)
    finally:
        end_process_group()
    if failed:
        sys.exit(1)


def launch(setup: Setup, runs: list[Run], processes: int, out: str | None) -> int:
    """Start ``processes`` ranks (spawn) around a rendezvous store this process holds on a port the OS picked;
    0 when every rank ended well."""
    import torch.multiprocessing as mp

    store = dist.TCPStore(_HOST, 0, world_size=None, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, processes, store.port, setup, runs, out)) for r in range(processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--runs", required=True, help="comma-separated ENGINE:PRECISION[:FAULT]")
    parser.add_argument("--processes", type=int, default=1, help="ranks (CUDA: one per GPU)")
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128, help="rows per rank")
    parser.add_argument("--chunk", type=int, default=32, help="rows per chunk of the chunked step")
    parser.add_argument("--json", help="write the rows here (after each run)")
    args = parser.parse_args(argv)
    try:
        runs = [Run.parse(spec) for spec in args.runs.split(",") if spec.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if args.chunk >= args.batch:
        parser.error(f"--chunk {args.chunk} holds the whole local batch of {args.batch}: no chunked step to check")
    if args.device == "cuda" and torch.cuda.device_count() < args.processes:
        parser.error(f"--processes {args.processes}: {torch.cuda.device_count()} GPU(s) visible, one per rank")
    setup = Setup(args.device, args.backbone, args.image_size, args.batch, args.chunk)
    return launch(setup, runs, args.processes, args.json)


if __name__ == "__main__":
    sys.exit(main())
