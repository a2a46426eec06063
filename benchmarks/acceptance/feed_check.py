"""Does the device feed hide the reading of the next batch behind the step? The step fed by the trainer's
``DeviceFeed`` against the same step on a batch already on the device, and against the loader alone.

    python -m benchmarks.acceptance.feed_check --device cuda --backbone resnet50 --image-size 224 --batch 128 --workers 0,12
    python -m benchmarks.acceptance.feed_check --device cpu --image-size 16 --batch 16 --workers 0 --device-step-s 0.2 \
        --slow-loader 0.6 --feed synchronous          # a broken feed: the check must FAIL it

What ``DeviceFeed`` overlaps (``ddp_rank/train/device_feed.py``): when the trainer takes batch k, a reader thread
starts on batch k + 1: it asks the loader for it (with ``num_workers=0`` the thread itself reads and decodes;
with workers it only waits for their next batch, pinned) and, on CUDA, issues its copy to the device on a side
stream. The trainer's ``data_time`` is the time ``next(feed)`` blocks the host: the wait for a batch that is not
ready. The copy itself is ordered on the device (``wait_stream``), so what is left of it when the step starts
shows in the step's time, not in ``data_time``.

Measured for each ``--workers`` value, the step being the trainer's (``forward_backward`` with the model's
precision, the optimizer step, ``float(loss)``), the device synchronised before every clock read on CUDA (for
the fed step only the step's stream, as the trainer's ``float(loss)``: the feed's copy runs on a side stream):

- ``device_s``: the step on one batch already on the device (the median of a block before the fed steps and one
  after, so that a machine whose speed drifts does not favour either);
- ``loader_s``: the loader alone, each batch read and copied to the device and waited for;
- ``fed_s``: the step with ``next(feed)`` in it, as the trainer runs it; ``wait_s``: the ``next(feed)`` part
  (the trainer's ``data_time``).

All are medians over ``--steps`` after ``--warmup``. ``--slow-loader SHARE`` makes every batch's fetch sleep
SHARE x ``device_s`` (a slow disk or decoder, in whichever thread fetches), and ``--feed synchronous`` replaces
the feed by one that reads and copies in the caller's thread when asked (no overlap): the two faults the check
must FAIL. ``--device-step-s S`` stands a fixed S-second wait in for the model's step: what the host does while
a GPU computes (it waits in ``synchronize``), where a model stepping on a shared CPU would instead compete with
the reader thread for the cores and time the machine's load, not the feed. The rows go to ``--json``, rewritten after each configuration; ``gpu_targets.feed_verdicts`` judges
them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddp_rank.data.reading.batch import StreamBatch


class SynchronousFeed:
    """The fault ``--feed synchronous``: the next batch is read and copied only when asked, in the caller's
    thread (a feed without read-ahead: every step waits for the whole read and copy)."""

    def __init__(self, batches: Iterator[StreamBatch], device: torch.device) -> None:
        self._source, self.device = batches, device

    def __iter__(self) -> SynchronousFeed:
        return self

    def __next__(self) -> StreamBatch:
        return next(self._source).to(self.device)

    def close(self) -> None:
        self._source = iter(())


def slowed(batches: Iterator[StreamBatch], delay_s: float) -> Iterator[StreamBatch]:
    """``batches``, each one's fetch taking ``delay_s`` longer (in the thread that fetches it)."""
    for batch in batches:
        if delay_s > 0:
            time.sleep(delay_s)
        yield batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_step(device: torch.device) -> None:
    """Wait for the step's stream only, as the trainer's ``float(loss)`` does: the feed's copy of the next batch
    on its side stream goes on (a device-wide synchronize would wait for it and charge it to this step)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Bench:
    """The trainer's pieces for one ``num_workers``: the stream's loader, the model, its step."""

    def __init__(self, args: argparse.Namespace, shards: Path, workers: int) -> None:
        from ddp_rank.config import load_config
        from ddp_rank.data.format.manifest import Manifest
        from ddp_rank.data.reading.loader import StreamLoader
        from ddp_rank.model import build_model
        from ddp_rank.train import PlainBackend
        from ddp_rank.train.optim import build_optimizer
        from ddp_rank.train.setup import build_loss, build_stream, wants_channels_last

        cfg = load_config(None, [f"data.shards={shards}", "data.test_split=", f"data.image_size={args.image_size}",
                                 f"data.resize_size={args.image_size}", f"data.global_batch_size={args.batch}",
                                 "data.sampler=random", f"data.num_workers={workers}",
                                 f"model.backbone={args.backbone}", "model.weights=none", "model.embedding_dim=128"])  # fmt: skip
        self.device = torch.device(args.device)
        # The stream's position stays put (track_position=False): every iter starts the same epoch again.
        self.loader = StreamLoader(build_stream(cfg.data, cfg.data_seed, Manifest.load(shards), 0, 1),
                                   pin_memory=self.device.type == "cuda", track_position=False)  # fmt: skip
        self.step_s = args.device_step_s
        if self.step_s > 0:
            return  # a simulated device: no model
        torch.manual_seed(0)
        model = build_model(cfg.model, args.image_size).to(self.device)
        if wants_channels_last(model, self.device, deepspeed=False):
            model.use_channels_last()
        model.train()
        self.optimizer = build_optimizer(
            model.parameter_groups(cfg.optim.lr, cfg.optim.head_lr_mult, cfg.optim.weight_decay), cfg.optim
        )
        autocast = torch.bfloat16 if self.device.type == "cuda" else None
        self.backend = PlainBackend(model, autocast_dtype=autocast)
        self.loss_fn = build_loss(cfg.loss)

    def step(self, batch: StreamBatch) -> None:
        from ddp_rank.train import forward_backward

        if self.step_s > 0:
            time.sleep(self.step_s)
            return
        out = forward_backward(self.backend, batch.images, batch.labels, self.loss_fn)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        float(out.loss)  # as the trainer: the host waits for the step's end

    def device_steps(self, batch: StreamBatch, n: int) -> list[float]:
        times = []
        for _ in range(n):
            _sync(self.device)
            t0 = time.perf_counter()
            self.step(batch)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def loader_alone(self, n: int, delay_s: float) -> list[float]:
        batches, times = slowed(iter(self.loader), delay_s), []
        for _ in range(n):
            t0 = time.perf_counter()
            next(batches).to(self.device, non_blocking=True)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def fed_steps(self, feed_kind: str, n: int, delay_s: float) -> tuple[list[float], list[float]]:
        from ddp_rank.train.device_feed import DeviceFeed

        source = slowed(iter(self.loader), delay_s)
        feed = DeviceFeed(source, self.device) if feed_kind == "real" else SynchronousFeed(source, self.device)
        totals, waits = [], []
        try:
            for _ in range(n):
                _sync_step(self.device)
                t0 = time.perf_counter()
                batch = next(feed)
                t1 = time.perf_counter()
                self.step(batch)
                _sync_step(self.device)
                totals.append(time.perf_counter() - t0)
                waits.append(t1 - t0)
        finally:
            feed.close()
        return totals, waits


def measure(args: argparse.Namespace, shards: Path, workers: int) -> dict[str, Any]:
    bench = Bench(args, shards, workers)
    on_device = next(iter(bench.loader)).to(bench.device)
    n = args.warmup + args.steps
    device_before = bench.device_steps(on_device, n)[args.warmup :]
    delay = args.slow_loader * statistics.median(device_before)
    loader = bench.loader_alone(n, delay)[args.warmup :]
    fed, waits = (times[args.warmup :] for times in bench.fed_steps(args.feed, n, delay))
    device_after = bench.device_steps(on_device, args.steps)
    row = {"workers": workers, "feed": args.feed, "device_step_s": args.device_step_s, "slow_loader_s": delay, "batch": args.batch,
           "steps": args.steps, "device_s": statistics.median(device_before + device_after),
           "loader_s": statistics.median(loader), "fed_s": statistics.median(fed),
           "wait_s": statistics.median(waits)}  # fmt: skip
    if bench.device.type == "cuda":
        row["device"] = torch.cuda.get_device_name(bench.device)
    return row


def synthetic_shards(root: Path, image_size: int, images: int) -> Path:
    """Shards of at least ``images`` images (4 categories of classes of 4) at ``image_size``, built by the data
    layer as the trainer's would be."""
    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder

    classes = max(10, -(-images // 16))
    write_image_folder(root / "images", [[4] * classes] * 4, image_size=image_size, image_format="jpg", seed=0)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", default="0,12", help="comma-separated data.num_workers values")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--feed", choices=("real", "synchronous"), default="real",
                        help="synchronous: a feed without read-ahead (a fault the check must fail)")  # fmt: skip
    parser.add_argument("--slow-loader", type=float, default=0.0, metavar="SHARE",
                        help="every fetch sleeps SHARE x the on-device step (a slow loader)")  # fmt: skip
    parser.add_argument("--device-step-s", type=float, default=0.0, metavar="S",
                        help="a fixed S-second wait instead of the model's step (a simulated device)")  # fmt: skip
    parser.add_argument("--json", help="write the rows here (after each configuration)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (torch.cuda.is_available() is False)")
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="feed-check-") as tmp:
        shards = synthetic_shards(Path(tmp), args.image_size, (args.warmup + args.steps + 1) * args.batch)
        for w in workers:
            rows.append(measure(args, shards, w))
            print(json.dumps(rows[-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
