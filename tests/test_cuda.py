"""What only a GPU shows: the losses on CUDA, the chunked step's CUDA RNG replay, AMP, determinism, a 1-GPU
trainer run and DeepSpeed bf16. Marked ``cuda``: skipped with the reason on a machine without one (conftest.py).

References are independent of the GPU: CPU float64 for the losses, the float32 step for AMP, a second run for
determinism.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss
from ddp_rank.train import PlainBackend, forward_backward

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")


def embeddings(n: int = 96, d: int = 32, classes: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.arange(n) % classes


@pytest.mark.parametrize(
    "make", [FastAPLoss, lambda: PNPLoss("Dq", tau=0.1), lambda: SmoothAPLoss(tau=0.05)], ids=["fastap", "pnp", "sap"]
)
def test_losses_on_cuda_match_cpu_float64(make) -> None:  # type: ignore[no-untyped-def]
    x, labels = embeddings()
    cpu = x.clone().requires_grad_()
    want = make()(cpu, labels)
    want.backward()
    gpu = x.float().to(CUDA).requires_grad_()
    got = make()(gpu, labels.to(CUDA))
    got.backward()
    assert_close(got.double().cpu(), want.detach(), rtol=1e-5, atol=1e-6)
    assert_close(gpu.grad.double().cpu(), cpu.grad, rtol=1e-4, atol=1e-6)


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 5)).to(CUDA)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(11, 6, generator=g).to(CUDA), (torch.arange(11) % 4).to(CUDA)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_dropout_masks_are_replayed_on_cuda() -> None:
    """The chunked step records and replays the CUDA generator: its gradient is that of the same chunk forwards
    in one graph, and another seed (other masks) gives another gradient."""
    inputs, labels = batch()
    loss_fn = PNPLoss(variant="O", tau=0.1)

    def reference(seed: int) -> list[torch.Tensor]:
        model = mlp(dropout=0.5)
        torch.manual_seed(seed)
        loss_fn(torch.cat([model(c) for c in inputs.split(4)]), labels).backward()
        return grads(model)

    model = mlp(dropout=0.5)
    torch.manual_seed(7)
    forward_backward(PlainBackend(model), inputs, labels, loss_fn, chunk_size=4)
    for got, want in zip(grads(model), reference(7)):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(reference(8)[0], reference(7)[0])


def test_ghost_batchnorm_chunked_equals_direct_on_cuda_channels_last() -> None:
    """Ghost batch normalisation on cuDNN's channels-last BatchNorm: the chunked step (chunks of two groups) gives
    the direct step's loss, gradients and running statistics, as on CPU (tests/train/test_ghost_batchnorm.py)."""
    from ddp_rank.train import convert_to_ghost
    from ddp_rank.train.batchnorm import batchnorm_buffers

    def net() -> nn.Module:
        torch.manual_seed(0)
        conv = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
        model = convert_to_ghost(nn.Sequential(*conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 6)), 4)
        return model.to(CUDA, memory_format=torch.channels_last)

    g = torch.Generator().manual_seed(2)
    images = torch.randn(16, 3, 8, 8, generator=g).to(CUDA).contiguous(memory_format=torch.channels_last)
    labels = (torch.arange(16) % 4).to(CUDA)
    direct, chunked = net(), net()
    out_d = forward_backward(PlainBackend(direct), images, labels, FastAPLoss())
    out_c = forward_backward(PlainBackend(chunked), images, labels, FastAPLoss(), chunk_size=8)
    assert out_c.chunks == 2
    assert_close(out_c.loss, out_d.loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads(chunked), grads(direct)):
        assert_close(got, want, rtol=1e-4, atol=1e-5)
    for got, want in zip(batchnorm_buffers(chunked), batchnorm_buffers(direct)):
        assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_amp_chunked_step_on_cuda(dtype: torch.dtype) -> None:
    """Autocast (+ GradScaler for fp16) in the chunked step: after unscaling, the float32 gradients."""
    inputs, labels = batch()
    loss_fn = SmoothAPLoss(tau=0.1)
    reference = mlp()
    forward_backward(PlainBackend(reference), inputs, labels, loss_fn)
    model = mlp()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if dtype == torch.float16 else None
    out = forward_backward(PlainBackend(model, scaler, dtype), inputs, labels, loss_fn, chunk_size=4)
    assert out.loss.dtype == torch.float32 and out.chunks == 3
    if scaler is not None:
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    for got, want in zip(grads(model), grads(reference)):
        assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize(
    "make", [FastAPLoss, lambda: PNPLoss("Dq", tau=0.1), lambda: SmoothAPLoss(tau=0.05)], ids=["fastap", "pnp", "sap"]
)
def test_losses_are_bit_identical_under_deterministic_algorithms(make) -> None:  # type: ignore[no-untyped-def]
    """PNP's and Smooth-AP's gradient scatter-adds use atomics on CUDA (FastAP has none, but its row sums must
    not vary either); in deterministic mode two runs agree bit for bit, and nothing raises for want of a
    deterministic kernel."""
    from ddp_rank.runtime.determinism import set_deterministic

    x, labels = embeddings(n=4096, d=64, classes=512)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        set_deterministic(True)
        results = []
        for _ in range(2):
            e = x.float().to(CUDA).requires_grad_()
            loss = make()(e, labels.to(CUDA))
            loss.backward()
            results.append((loss.detach(), e.grad))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.training import build_tiny_shards

    return build_tiny_shards(tmp_path_factory.mktemp("tiny-cuda"))


def _train_on_gpu(shards: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    from accelerate.state import AcceleratorState

    from ddp_rank.config import load_config
    from ddp_rank.train.trainer import Trainer
    from tests.helpers.training import TINY_OVERRIDES

    AcceleratorState._reset_state(True)  # earlier tests left a CPU accelerator state in this process
    cfg = load_config(
        None,
        [*TINY_OVERRIDES, "distributed.cpu=false", f"data.shards={shards}", f"train.output_dir={out}", *extra],
    )
    trainer = Trainer(cfg)
    try:
        assert trainer.device.type == "cuda"
        for _ in range(3):
            assert 0.0 <= trainer.train_step().loss <= 1.0
        return {k: v.detach().cpu().clone() for k, v in trainer.unwrapped.state_dict().items()}
    finally:
        trainer.close()
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("chunk", [0, 4], ids=["direct", "chunked"])
def test_one_gpu_trainer_is_deterministic(shards: Path, tmp_path: Path, chunk: int) -> None:
    extra = ("train.deterministic=true", f"distributed.chunk_size={chunk}", "model.freeze_bn=auto")
    first = _train_on_gpu(shards, tmp_path / "a", *extra)
    second = _train_on_gpu(shards, tmp_path / "b", *extra)
    for key in first:
        assert torch.equal(first[key], second[key]), key


@pytest.mark.slow
def test_deepspeed_bf16_on_one_gpu(shards: Path, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from tests.helpers.training import REPO, TINY_OVERRIDES, free_port

    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "launch" / "accelerate_deepspeed_zero2.yaml"),
        "--num_processes", "1", "--main_process_port", str(free_port()),
        "-m", "ddp_rank.cli", "train", *TINY_OVERRIDES, "distributed.cpu=false", f"data.shards={shards}",
        f"train.output_dir={tmp_path / 'run'}", "train.steps=3", "distributed.chunk_size=4",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 3 steps" in proc.stdout
