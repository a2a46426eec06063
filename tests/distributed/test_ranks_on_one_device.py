"""Two ranks over gloo give what one process gives: the global loss, and the chunked step under DDP (eager and
with a captured chunk), on CPU tensors and, marked ``cuda``, on CUDA tensors with both ranks on the same GPU.

Why the CUDA twin: the GPU machines at hand have one GPU each, and NCCL refuses two ranks on one GPU, so the
multi-rank CUDA path (CUDA tensors through the loss's gathers and reduce-scatter, DDP's reducer on CUDA
gradients, the captured chunk's no_sync chunks under DDP) is exercised short of NCCL here: gloo moves CUDA
tensors through host memory. The same worker runs on both devices.

Tolerances (float64): the loss to 1e-12 and the gradients to 1e-9 of the largest entry, from sums taken in another
order on each side (over ranks, over chunks, on another device).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.losses import FastAPLoss, PNPLoss
from ddp_rank.train import DDPBackend, PlainBackend, forward_backward
from ddp_rank.train.chunking.captured import CapturedChunk
from tests.helpers.distributed import run_distributed

SIZES, CHUNK, D_IN = (6, 10), 3, 6  # uneven ranks; chunks of 3: 2 and 3 full chunks and a last one of 1
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, 5)).double().to(device)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = sum(SIZES)
    return torch.randn(n, D_IN, generator=g, dtype=torch.float64), torch.randint(0, n // 3, (n,), generator=g)


def local(rank: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    start = sum(SIZES[:rank])
    return tuple(t[start : start + SIZES[rank]] for t in tensors)


def _worker(rank: int, world: int, device_type: str) -> dict[str, object]:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    inputs, labels = (t.to(device) for t in local(rank, *global_batch()))
    out: dict[str, object] = {}
    # The global loss of this rank's embeddings (the distributed layer alone).
    e = mlp(device)(inputs).detach().requires_grad_()
    loss = GlobalBatchLoss(FastAPLoss(num_bins=10))(e, labels)
    loss.backward()
    out["loss"], out["embedding grad"] = loss.detach().cpu(), e.grad.cpu()
    # The chunked step under DDP, eager and with the no_sync chunks compiled.
    for name in ("eager", "captured"):
        ddp = DistributedDataParallel(mlp(device), device_ids=[0] if device.type == "cuda" else None)
        captured = None
        if name == "captured":
            captured = CapturedChunk(ddp.module, CHUNK, "graphs", compiler="aot_eager")
        step = forward_backward(
            DDPBackend(ddp), inputs, labels, GlobalBatchLoss(PNPLoss("Dq", tau=0.1)), CHUNK, captured=captured
        )
        out[f"{name} step"] = (step.loss.cpu(), [p.grad.cpu() for p in ddp.parameters()], step.chunks)
        if captured is not None:
            out["compiled calls"] = captured.calls
    return out


def single_process() -> dict[str, object]:
    """The same batch in one process, on the CPU, the direct step."""
    inputs, labels = global_batch()
    e = mlp(torch.device("cpu"))(inputs).detach().requires_grad_()
    loss = FastAPLoss(num_bins=10)(e, labels)
    loss.backward()
    model = mlp(torch.device("cpu"))
    step = forward_backward(PlainBackend(model), inputs, labels, PNPLoss("Dq", tau=0.1))
    return {
        "loss": loss.detach(),
        "embedding grad": e.grad,
        "step": (step.loss, [p.grad for p in model.parameters()]),
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_on_one_device_give_what_one_process_gives(device: str) -> None:
    want = single_process()
    scale = max(float(g.abs().max()) for g in want["step"][1])  # type: ignore[index]
    for rank, got in enumerate(
        run_distributed(_worker, 2, args=(device,), timeout=300, cuda=device == "cuda")
    ):
        assert_close(got["loss"], want["loss"], rtol=1e-12, atol=1e-14)
        # GlobalBatchLoss hands each rank W x its rows of dL/dE, for DDP's mean (see its docstring).
        (rows,) = local(rank, want["embedding grad"])  # type: ignore[arg-type]
        assert_close(got["embedding grad"], 2 * rows, rtol=1e-9, atol=1e-12)
        for name in ("eager", "captured"):
            loss, grads, chunks = got[f"{name} step"]
            assert chunks == [2, 4][rank]  # 6 rows in chunks of 3; 10 rows: 3 + 3 + 3 + 1
            assert_close(loss, want["step"][0], rtol=1e-12, atol=1e-14)  # type: ignore[index]
            for g, w in zip(grads, want["step"][1]):  # type: ignore[index]
                assert_close(g, w, rtol=1e-9, atol=1e-9 * scale)
        # Rank 0: 6 rows = 2 chunks, the last synced (eager); rank 1: 10 rows = 3 full chunks and one of 1 row.
        assert got["compiled calls"] == [2 * 1, 2 * 3][rank]
