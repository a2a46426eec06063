"""Your own `accelerate` training loop with ddp_rank's global-batch loss, chunked step and shard stream.

Two processes on a CPU (accelerate's `--cpu` flag alone starts only ONE process):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no examples/accelerate_loop.py --shards SHARD_DIR --cpu

On GPUs: `accelerate launch --num_processes 8 examples/accelerate_loop.py --shards SHARD_DIR`.
SHARD_DIR is what `ddp-rank shards build` (or `ddp-rank demo`) wrote. Copy this file and put your model in.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from accelerate import Accelerator
from torch import nn

from ddp_rank.data import ShardStream, StreamLoader, TransformConfig
from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.losses import FastAPLoss
from ddp_rank.train import backend_for_accelerator, forward_backward


def build_model(embedding_dim: int = 32, seed: int = 0) -> nn.Module:
    """Any model that maps images [n, 3, H, W] to embeddings [n, d] (this one has no BatchNorm)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, embedding_dim),
    )  # fmt: skip


def batch_recall_at_1(embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    """A metric of your own on the step's detached embeddings: does each row's nearest other row share its
    class?"""
    if embeddings.shape[0] < 2:
        return float("nan")
    unit = nn.functional.normalize(embeddings.float(), dim=1)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(-2.0)
    return float((labels[similarity.argmax(dim=1)] == labels).float().mean())


def say(line: str) -> None:
    """Print ``line`` in one write: the ranks share the terminal, and ``print``'s text and newline, written apart
    when the output is unbuffered, let another rank's line land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, help="shard directory (manifest.json + tars)")
    parser.add_argument("--global-batch", type=int, default=16, help="images per step over ALL ranks")
    parser.add_argument("--chunk-size", type=int, default=None, help="most images per forward with a graph")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU even where a GPU is visible")
    return parser.parse_args()


def train(accelerator: Accelerator, args: argparse.Namespace) -> None:
    """Train ``args.steps`` steps on the processes ``accelerator`` joined."""
    # The stream deals each step's global batch to the ranks itself: it must NOT go through
    # accelerator.prepare (that would make rank 0 read everything and could duplicate samples).
    stream = ShardStream(
        args.shards,
        args.global_batch,
        split="train",
        transform=TransformConfig(resize=args.image_size, crop=args.image_size),
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
    )
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)  # the model and optimizer only
    backend = backend_for_accelerator(accelerator, model)
    loss_fn = GlobalBatchLoss(FastAPLoss(), grad_reduction="mean")  # accelerate averages gradients

    step = 0
    while step < args.steps:
        for batch in StreamLoader(stream):
            batch = batch.to(accelerator.device)
            # Forward, loss of the GLOBAL batch, and backward (chunked when the local batch exceeds
            # chunk_size); it calls backward itself: only the optimizer step is left to do.
            out = forward_backward(
                backend, batch.images, batch.labels, loss_fn, args.chunk_size, return_embeddings=True
            )
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            assert out.embeddings is not None
            recall = batch_recall_at_1(out.embeddings, batch.labels)
            say(
                f"rank {accelerator.process_index} step {step} loss {out.loss.item():.10f} chunks {out.chunks} "
                f"local_batch {len(batch)} batch_recall@1 {recall:.3f}"
            )
            if step == args.steps:
                break
    checksum = sum(float(p.detach().double().sum()) for p in accelerator.unwrap_model(model).parameters())
    say(f"rank {accelerator.process_index} weights_sum {checksum:.12f}")


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=args.cpu)
    try:
        train(accelerator, args)
    finally:
        # The DDP model sits in a reference cycle and holds the process group: released and collected here, the
        # group ends while Python runs; left to the interpreter's exit, gloo aborts a finished rank now and then
        # ("terminate called without an active exception").
        accelerator.free_memory()
        gc.collect()
        accelerator.end_training()


if __name__ == "__main__":
    main()
