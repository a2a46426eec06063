"""Every host synchronisation of one chunked training step, with its place, and a profiler trace of two steps:
what ``benchmarks/acceptance/gpu_check.py --part syncs`` runs (its verdicts: ``gpu_targets.syncs_verdicts``).

    python -m benchmarks.acceptance.sync_check --json OUT.json [--trace TRACE.json.gz] [--device cuda --backbone resnet50
        --image-size 224 --batch 256 --chunk 64 --precision bf16]

The step is the trainer's: ``forward_backward`` on uint8 images (channels-last, frozen BatchNorm, autocast), the
global-batch loss, an Adam step, and the loss value read for the log. After one warm-up step (cuDNN's search,
Adam's first state), one step runs under ``torch.cuda.set_sync_debug_mode("warn")``: each synchronising call warns,
and its Python stack is recorded; a synchronisation whose stack passes through the chunk loops
(``_forward_no_grad``, ``_forward_backward`` of ``ddp_rank.train.chunking.step``) is "in the loop", where the target is
none (each one there makes the host wait for the GPU once per chunk). Then two steps run under
``torch.profiler`` (CPU and CUDA activities), their trace kept, gzipped, for Perfetto or chrome://tracing, and the
CUDA runtime's synchronising calls in it counted.

On a machine without CUDA (``--device cpu``, the tests) the same runs on a small model, the host reads of
``benchmarks/acceptance/host_syncs.py`` standing in for the debug mode: each is a synchronisation on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from ddp_rank.config import ModelConfig
from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.losses import FastAPLoss
from ddp_rank.model.net import build_model, freeze_batchnorm
from ddp_rank.train import PlainBackend, forward_backward

REPO = Path(__file__).resolve().parents[2]

LOOP_FUNCTIONS = frozenset({"_forward_no_grad", "_forward_backward"})
"""The chunk loops of ``ddp_rank.train.chunking.step``: a synchronisation while one of them runs is in the loop (also
one that the autograd engine's device thread reports, whose Python stack does not show the loop)."""
_IN_LOOP = [False]
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls in a trace that make the host wait (``cudaMemcpy``: the blocking copy, not the async one)."""


def _places(stack: traceback.StackSummary) -> list[str]:
    """``file:line in function`` of the frames outside torch, the installed packages and the standard library,
    innermost last."""
    torch_dir = str(Path(torch.__file__).parent)
    keep = []
    for frame in stack:
        path = str(Path(frame.filename).resolve())
        if path.startswith(torch_dir) or "/lib/python3" in path or path.endswith("host_syncs.py"):
            continue
        shown = str(Path(path).relative_to(REPO)) if path.startswith(str(REPO)) else path
        keep.append(f"{shown}:{frame.lineno} in {frame.name}")
    return keep


def _event(kind: str, stack: traceback.StackSummary, in_loop: bool) -> dict[str, Any]:
    places = _places(stack)
    return {
        "kind": kind,
        "place": places[-1] if places else "<torch> (autograd's device thread?)",
        "in_loop": in_loop or bool(LOOP_FUNCTIONS & {frame.name for frame in stack}),
        "stack": places[-8:],
    }


@contextlib.contextmanager
def marking_the_loops() -> Iterator[None]:
    """While a chunk loop of ``ddp_rank.train.chunking.step`` runs, ``_IN_LOOP[0]`` is True."""
    from ddp_rank.train.chunking import step as chunked

    def marked(function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            _IN_LOOP[0] = True
            try:
                return function(*args, **kwargs)
            finally:
                _IN_LOOP[0] = False

        return run

    with contextlib.ExitStack() as stack:
        for name in LOOP_FUNCTIONS:
            stack.enter_context(mock.patch.object(chunked, name, marked(getattr(chunked, name))))
        yield


@contextlib.contextmanager
def cuda_syncs() -> Iterator[list[dict[str, Any]]]:
    """Every synchronising CUDA call of the block (``set_sync_debug_mode("warn")``), with its Python stack."""
    events: list[dict[str, Any]] = []
    previous = torch.cuda.get_sync_debug_mode()

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            events.append(_event(str(message).split("\n")[0][:120], traceback.extract_stack()[:-1], _IN_LOOP[0]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield events
        finally:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def host_reads() -> Iterator[list[dict[str, Any]]]:
    """The CPU stand-in: every call that brings a value to the host (``benchmarks/acceptance/host_syncs.py``)."""
    from benchmarks.acceptance.host_syncs import count_host_syncs

    events: list[dict[str, Any]] = []
    with count_host_syncs() as syncs:
        yield events
    events += [_event(f"{e.kind} ({e.name})", e.stack, False) for e in syncs.events]


def build_step(args: argparse.Namespace) -> tuple[Callable[[], float], int]:
    """The trainer's step on a fixed batch, and its number of chunks."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=args.backbone, weights="none"), args.image_size).to(device)
    model.use_channels_last()
    model.train()
    freeze_batchnorm(model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}[args.precision]
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    backend = PlainBackend(model, scaler=scaler, autocast_dtype=dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (args.batch, 3, args.image_size, args.image_size), dtype=torch.uint8, generator=g)
    images, labels = images.to(device), (torch.arange(args.batch) // 4).to(device)
    loss_fn = GlobalBatchLoss(FastAPLoss())
    chunks = -(-args.batch // args.chunk)

    def step() -> float:
        out = forward_backward(backend, images, labels, loss_fn, args.chunk)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(out.loss)  # the trainer reads it for its log, once a step

    return step, chunks


def trace_two_steps(step: Callable[[], float], path: Path, cuda: bool) -> dict[str, int]:
    """Two steps under the profiler; the trace written gzipped to ``path``; the synchronising runtime calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        step()
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(raw))
        path.parent.mkdir(parents=True, exist_ok=True)
        with raw.open("rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)
    return {e.key: int(e.count) for e in prof.key_averages() if e.key in SYNC_CALLS}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    record: dict[str, Any] = {
        "setup": f"{args.backbone}, {args.image_size} px, batch {args.batch}, chunk {args.chunk}, {args.precision}, "
        f"{args.device}",
    }
    step, record["chunks"] = build_step(args)
    step()  # warm-up: cuDNN's algorithm search, Adam's state, lazy initialisations
    with marking_the_loops(), cuda_syncs() if cuda else host_reads() as events:
        step()
    record["syncs"] = events
    record["in_loop"] = sum(e["in_loop"] for e in events)
    if args.trace:
        record["trace_sync_calls"] = trace_two_steps(step, args.trace, cuda)
        record["trace"] = str(args.trace)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--trace", type=Path, help="write the profiler trace of two steps here (gzipped JSON)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backbone", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "no"))
    args = p.parse_args(argv)
    if args.chunk >= args.batch:
        p.error(f"--chunk ({args.chunk}) must be smaller than --batch ({args.batch}): the step must be chunked")
    try:
        record = run(args)
    except Exception as exc:  # the record says what broke; the part reports it
        record = {"error": f"{type(exc).__name__}: {exc}"}
    args.json.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "syncs"}, indent=1))
    for e in record.get("syncs", []):
        print(f"{'IN THE LOOP ' if e['in_loop'] else ''}{e['kind']} at {e['place']}")
    return 0 if "error" not in record else 1


if __name__ == "__main__":
    sys.exit(main())
