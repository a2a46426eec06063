"""Your own `torchrun` training loop (plain DDP) with a pytorch-metric-learning loss made global by ddp_rank.

    pip install pytorch-metric-learning
    torchrun --nproc-per-node 2 examples/torchrun_loop.py --shards SHARD_DIR    # gloo on CPU, NCCL on GPUs

SHARD_DIR is what `ddp-rank shards build` (or `ddp-rank demo`) wrote. The miner runs on the GLOBAL batch, and
the loss value is that of one process on all ranks' images together. Copy this file and put your model in.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from pytorch_metric_learning import losses, miners
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_rank.data import ShardStream, StreamLoader, TransformConfig
from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.train import DDPBackend, forward_backward


def build_model(embedding_dim: int = 32, seed: int = 0) -> nn.Module:
    """Any model that maps images [n, 3, H, W] to embeddings [n, d] (this one has no BatchNorm)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, embedding_dim),
    )  # fmt: skip


def build_loss() -> GlobalBatchLoss:
    """Any loss called as loss(embeddings, labels); a miner is applied to the gathered global batch."""
    return GlobalBatchLoss(
        losses.MultiSimilarityLoss(), miner=miners.MultiSimilarityMiner(epsilon=0.1), grad_reduction="mean"
    )


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
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    """Train ``args.steps`` steps; the process group is already up."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    # Rank and world size come from the process group; every rank reads only its part of each step.
    stream = ShardStream(
        args.shards,
        args.global_batch,
        split="train",
        transform=TransformConfig(resize=args.image_size, crop=args.image_size),
    )
    model = DistributedDataParallel(build_model().to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    backend = DDPBackend(model)
    loss_fn = build_loss()  # "mean": DDP averages the parameter gradients over the ranks

    step = 0
    while step < args.steps:
        for batch in StreamLoader(stream):
            batch = batch.to(device)
            out = forward_backward(
                backend, batch.images, batch.labels, loss_fn, args.chunk_size, return_embeddings=True
            )  # forward, global loss, backward (chunked beyond chunk_size): step the optimizer next
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            assert out.embeddings is not None
            norms = out.embeddings.norm(dim=1).mean().item() if len(batch) else float("nan")
            say(
                f"rank {rank} step {step} loss {out.loss.item():.10f} chunks {out.chunks} "
                f"local_batch {len(batch)} mean_norm {norms:.4f}"
            )
            if step == args.steps:
                break
    checksum = sum(float(p.detach().double().sum()) for p in model.module.parameters())
    say(f"rank {rank} weights_sum {checksum:.12f}")


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():  # one GPU per rank: the collectives' small tensors go to the current device
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...: the process group reads them.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(args)
    finally:
        # The DDP model sits in a reference cycle and holds the process group: collected here, the group ends
        # while Python runs; left to the interpreter's exit, gloo aborts a finished rank now and then
        # ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
