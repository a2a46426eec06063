"""Helpers of the trainer tests: tiny shards built with the data layer, the tiny-run overrides."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from ddp_rank.config import Config
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.settings import check_evaluation, evaluation_settings
from ddp_rank.runtime.shards import open_training_shards

REPO = Path(__file__).resolve().parents[2]

TINY_OVERRIDES = [
    "distributed.cpu=true",  # bit-exact comparisons mean CPU, also on a machine with a GPU
    "model.backbone=tiny_cnn",
    "model.embedding_dim=16",
    "data.image_size=16",
    "data.resize_size=16",
    "data.global_batch_size=16",
    "data.sampler=hard",
    "data.batches_per_pair=1",
    "data.num_workers=0",
    "optim.lr=1e-3",
    "train.progress=false",
    "train.log_every=1",
    "train.eval_every=0",
    "eval.ks=1,2",
    "eval.batch_size=16",
]


def build_tiny_shards(root: Path) -> Path:
    """3 categories x 6 classes x 4 images of 16 px, a third of each category's classes held out."""
    write_image_folder(root / "images", [[4] * 6, [4] * 6, [4] * 6], image_size=16, seed=0)
    out = root / "shards"
    build_shards(read_image_folder(root / "images"), out, BuildOptions(test_fraction=0.34, progress=False))
    return out


def check_inputs(cfg: Config) -> Manifest:
    """The trainer's start-up checks of ``cfg``'s shards and evaluation; returns the manifest."""
    manifest = open_training_shards(cfg.data, cfg.model.backbone)
    check_evaluation(evaluation_settings(cfg), cfg.train.best_metric, manifest)
    return manifest


def final_weights(run_dir: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The model weights of checkpoint ``step`` of a run (default: its latest)."""
    from safetensors.torch import load_file

    from ddp_rank.model.checkpoint_read import resolve_checkpoint

    ckpt = (
        run_dir / "checkpoints" / f"step-{step:08d}"
        if step is not None
        else resolve_checkpoint(run_dir, "latest")
    )
    return load_file(str(ckpt / "model.safetensors"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_cmd(*args: str, processes: int = 2) -> list[str]:
    """``accelerate launch`` with the repository's CPU launcher file and a free port."""
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "launch" / "accelerate_cpu_2proc.yaml"),
        "--num_processes", str(processes),
        "--main_process_port", str(free_port()),
        "-m", "ddp_rank.cli", *args,
    ]  # fmt: skip


def cpu_env() -> dict[str, str]:
    """The environment of a launched CPU job, whatever GPUs the machine has: no CUDA device for the ranks (a
    1-GPU machine would otherwise put both on cuda:0) and DeepSpeed's CPU accelerator; one thread per rank."""
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = cpu_env()
    return subprocess.run(
        accelerate_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
