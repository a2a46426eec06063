"""``distributed.chunk_size=auto`` on the real setup, and the device feed under CUDA's stream sanitizer: what
``benchmarks/acceptance/gpu_check.py --part chunk`` runs (its verdicts: ``gpu_targets.chunk_verdicts``).

    python -m benchmarks.acceptance.chunk_check --json OUT.json [--backbone resnet50 --image-size 224 --local-batch 2048
        --precision bf16 --steps 3]
    TORCH_CUDA_SANITIZER=1 python -m benchmarks.acceptance.chunk_check --sanitizer clean|control --json OUT.json

The first builds the trainer with ``chunk_size=auto`` (its probe and its trial step), trains ``--steps`` steps at
the chunk it chose on a fixed batch of the local batch's size (a batch that the device cannot hold in one step,
so the step is chunked), records the peak reserved memory, then finds by bisection the largest chunk with which
two training steps run without an out-of-memory error (the second with Adam's state allocated, as every later
step). The record: the chosen chunk, how the trial step confirmed it, whether the steps at it ran out of memory,
the largest chunk that fits, the peak memory, and the figures of the choice.

The second trains 3 steps of a small run through the trainer's own data path, the device feed copying each next
batch on a side stream, under ``TORCH_CUDA_SANITIZER=1`` (CSAN): an unsynchronised use of a copied batch is
reported and ends the run. CSAN follows the kernels of the thread that enabled it only, so the feed's reader
thread enters its mode too. ``control`` removes the feed's ``wait_stream``: that run must be reported, or the
sanitizer did not see the copies and the clean run proves nothing.

On CPU the same measurement runs against a simulated memory limit (``--cpu-limit-bytes``: one forward's saved
tensors past it raise ``torch.OutOfMemoryError``), which is how the tests inject a probe that under- or
over-counts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from ddp_rank.config import load_config
from ddp_rank.data.reading.batch import StreamBatch
from ddp_rank.train.chunking.choice import count_saved

CSAN_REPORT = "CSAN detected a possible data race"


def largest_fitting(fits: Callable[[int], bool], high: int, known_fit: int = 0) -> int:
    """The largest ``n`` in ``[1, high]`` with ``fits(n)`` (0: none), by bisection, for a ``fits`` that holds up
    to some size and fails above it; ``known_fit``: a size already seen to fit (the search starts above it)."""
    if fits(high):
        return high
    low, top = known_fit, high  # fits(low) (or low == 0), not fits(top)
    while top - low > 1:
        middle = (low + top) // 2
        if fits(middle):
            low = middle
        else:
            top = middle
    return low


@contextlib.contextmanager
def simulated_memory_limit(module: nn.Module, limit: int | None) -> Iterator[None]:
    """On CPU: every forward of ``module`` whose saved tensors pass ``limit`` bytes raises
    ``torch.OutOfMemoryError`` (a device's limit on one chunk's activations); nothing when ``limit`` is None."""
    if limit is None:
        yield
        return
    stack = contextlib.ExitStack()

    def enter(*_: Any) -> None:
        if torch.is_grad_enabled():
            stack.enter_context(count_saved(limit))

    def leave(*_: Any) -> None:
        stack.close()

    hooks = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        stack.close()
        for hook in hooks:
            hook.remove()


def measure(
    cfg_overrides: list[str],
    steps: int,
    cpu_limit: int | None = None,
    save: Callable[[dict[str, Any]], None] = lambda record: None,
) -> dict[str, Any]:
    """The record of ``chunk_size=auto`` for the trainer of ``cfg_overrides`` (module docstring); ``save`` is
    given the record after each phase, so that a run stopped at its time limit leaves what it measured."""
    from ddp_rank.train.trainer import Trainer

    record: dict[str, Any] = {}
    said = _LogLines("ddp_rank")
    cfg = load_config(None, cfg_overrides)
    t0 = time.perf_counter()
    try:
        with said:
            trainer = Trainer(cfg)
    except Exception as exc:  # the probe or the trial step failed: that is the result
        return {"error": f"{type(exc).__name__}: {exc}", "log": said.lines}
    record["start_s"] = time.perf_counter() - t0
    record["log"] = said.lines
    save(record)
    try:
        local = trainer.local_batch
        record["local_batch"] = local
        record["chosen"] = trainer.layout.chunk_size or local
        record["backed_off"] = any("backed off" in line for line in said.lines)
        batch = _batch(local, cfg.data.image_size, trainer.device)
        module = trainer.backend.bare_module

        def run(chunk: int, count: int) -> bool:
            trainer.layout = dataclasses.replace(trainer.layout, chunk_size=chunk if chunk < local else None)
            try:
                with simulated_memory_limit(module, cpu_limit):
                    for _ in range(count):
                        trainer.train_step(batch)
                return True
            except torch.OutOfMemoryError:
                trainer.optimizer.zero_grad(set_to_none=True)
                return False
            finally:
                gc.collect()
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()

        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        chosen_ok = run(record["chosen"], steps)
        record["oom_at_chosen"] = not chosen_ok
        if trainer.device.type == "cuda":
            record["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
            record["peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            record["device_mb"] = torch.cuda.get_device_properties(trainer.device).total_memory / 2**20
        save(record)
        t1 = time.perf_counter()
        record["largest_fitting"] = largest_fitting(
            lambda chunk: run(chunk, 2), local, known_fit=record["chosen"] if chosen_ok else 0
        )
        record["bisection_s"] = time.perf_counter() - t1
    finally:
        trainer.close()
    return record


def _batch(rows: int, image_size: int, device: torch.device) -> StreamBatch:
    """A fixed local batch: random pixels, 4 images to a class (the listwise losses need positives)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (rows, 3, image_size, image_size), dtype=torch.uint8, generator=generator)
    labels = torch.arange(rows) // 4
    return StreamBatch(images, labels, torch.zeros(rows, dtype=torch.int64), [str(i) for i in range(rows)],
                       0, 0, ()).to(device)  # fmt: skip


class _Tee(io.TextIOBase):
    """Write to two streams (what CSAN prints is kept and still shown)."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)


class _LogLines(logging.Handler):
    """Collect the ``chunk_size=auto`` lines the trainer logs."""

    def __init__(self, logger: str) -> None:
        super().__init__(logging.INFO)
        self.logger = logging.getLogger(logger)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "chunk_size=auto" in message:
            self.lines.append(message)

    def __enter__(self) -> _LogLines:
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def synthetic_shards(root: Path, classes: int, image_size: int = 32) -> Path:
    """4 categories of ``classes // 4`` classes of 4 small images: the trainer resizes them to the run's size."""
    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder

    write_image_folder(root / "images", [[4] * (classes // 4)] * 4, image_size=image_size, seed=0)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def real_setup(shards: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The run's overrides: one process, ``--local-batch`` images of ``--image-size`` px through
    ``--backbone`` (random weights: the machine has no network), ``--precision``, ``chunk_size=auto``."""
    return [f"data.shards={shards}", f"train.output_dir={out}", f"model.backbone={args.backbone}",
            "model.weights=none", f"data.image_size={args.image_size}", f"data.resize_size={args.image_size}",
            f"data.global_batch_size={args.local_batch}", "data.sampler=random", "data.test_split=",
            "data.num_workers=0", f"train.mixed_precision={args.precision}", "train.progress=false",
            "train.eval_every=0", "train.steps=1000", "distributed.chunk_size=auto"]  # fmt: skip


# ----------------------------------------------------------------------------------------- the sanitizer
def sanitizer_run(shards: Path, out: Path, control: bool) -> dict[str, Any]:
    """3 steps of a small run through the device feed under CSAN (module docstring); ``control`` drops the feed's
    ``wait_stream``. The record: whether CSAN was on, the run's error (a CSAN report ends it), if any."""
    import torch.cuda._sanitizer as csan

    from ddp_rank.train import device_feed
    from ddp_rank.train.trainer import Trainer

    record: dict[str, Any] = {"sanitizer_enabled": bool(csan.cuda_sanitizer.enabled), "control": control}
    if not record["sanitizer_enabled"]:
        return {**record, "error": "TORCH_CUDA_SANITIZER is not set: CSAN is off"}
    read, handed = device_feed.DeviceFeed._to_device, device_feed.DeviceFeed.__next__

    def read_traced(self: Any, host: StreamBatch) -> StreamBatch:
        with csan.cuda_sanitizer.dispatch:  # CSAN's mode is per thread: enter it in the reader thread too
            return read(self, host)

    def handed_without_wait(self: Any) -> StreamBatch:
        with mock.patch.object(torch.cuda.Stream, "wait_stream", lambda stream, other: None):
            return handed(self)

    patches = [mock.patch.object(device_feed.DeviceFeed, "_to_device", read_traced)]
    if control:
        patches.append(mock.patch.object(device_feed.DeviceFeed, "__next__", handed_without_wait))
    cfg = load_config(None, [f"data.shards={shards}", f"train.output_dir={out}", "model.backbone=resnet18",
                             "model.weights=none", "data.image_size=64", "data.resize_size=64",
                             "data.global_batch_size=32", "data.sampler=random", "data.test_split=",
                             "data.num_workers=0", "train.mixed_precision=bf16", "train.progress=false",
                             "train.eval_every=0", "train.steps=3", "train.checkpoint_every=0",
                             "distributed.chunk_size=0"])  # fmt: skip
    reports = io.StringIO()  # CSAN prints each report to stderr, then raises CUDASanitizerErrors
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(contextlib.redirect_stderr(_Tee(reports, sys.stderr)))
        trainer = None
        try:
            trainer = Trainer(cfg)
            for _ in range(3):
                trainer.train_step()
            torch.cuda.synchronize()
            record["steps"] = 3
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if trainer is not None:
                trainer.close()
    text = reports.getvalue()
    record["reports"] = text.count(CSAN_REPORT)
    if record["reports"]:
        record["first_report"] = text[text.index(CSAN_REPORT) :][:600]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True, help="write the record here")
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--local-batch", type=int, default=2048, help="one process: the global batch")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "no"))
    parser.add_argument("--steps", type=int, default=3, help="training steps at the chosen chunk")
    parser.add_argument("--cpu-limit-bytes", type=int, help="on CPU: the simulated limit of one forward")
    parser.add_argument("--sanitizer", choices=("clean", "control"), help="the device feed under CSAN")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chunk-check-") as scratch:
        root = Path(scratch)
        if args.sanitizer:
            shards = synthetic_shards(root, classes=64)
            record = sanitizer_run(shards, root / "run", control=args.sanitizer == "control")
        else:
            # A few more images than one batch: the trainer's stream must fill a step (the check feeds its own).
            shards = synthetic_shards(root, classes=args.local_batch // 4 + 16)
            overrides = real_setup(shards, root / "run", args)
            cpu = ["distributed.cpu=true"] if args.cpu_limit_bytes is not None else []
            setup = f"{args.backbone}, {args.image_size} px, {args.precision}, local batch {args.local_batch}"

            def save(partial: dict[str, Any]) -> None:
                args.json.write_text(json.dumps({**partial, "setup": setup}, indent=1))

            record = {**measure([*overrides, *cpu], args.steps, args.cpu_limit_bytes, save), "setup": setup}
    args.json.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
