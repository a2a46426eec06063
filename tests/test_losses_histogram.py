"""FastAP's cumulative histograms: the torch path against their definition, the fused Triton kernel (run by
Triton's interpreter on CPU, in a child process that sets TRITON_INTERPRET before importing Triton) against the
torch path, and the loss through either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ddp_rank.losses import FastAPLoss
from ddp_rank.losses.histogram import cumulative_histograms, triton_runs_on


def definition(t: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Per item, the triangular kernel's weights on every bin centre, summed over items, then cumulated."""
    centres = torch.arange(num_bins + 1, dtype=torch.float64)
    weights = (1 - (t.double()[..., None] - centres).abs()).clamp(min=0)  # [c, N, L]
    return weights.sum(1).cumsum(1)


@pytest.mark.parametrize("num_bins", [1, 10, 15])
def test_the_torch_path_is_the_definition(num_bins: int) -> None:
    g = torch.Generator().manual_seed(num_bins)
    t = torch.rand(7, 333, generator=g, dtype=torch.float64) * num_bins
    t[:, :4] = torch.tensor([0.0, 1.0, float(num_bins), num_bins / 2.0], dtype=torch.float64)  # on centres
    got = cumulative_histograms(t, num_bins, torch.empty_like(t))
    torch.testing.assert_close(got, definition(t, num_bins), rtol=1e-12, atol=1e-12)


def test_bad_kernel_names_and_where_triton_runs() -> None:
    with pytest.raises(ValueError, match="histogram must be one of torch, triton, got 'cuda'"):
        FastAPLoss(histogram="cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not triton_runs_on(torch.zeros(2, 3))  # CPU tensors take the torch path
    assert not triton_runs_on(torch.zeros(2, 3, dtype=torch.float64))


CHILD = textwrap.dedent(
    """
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.losses.histogram import cumulative_histograms, triton_runs_on

    out = {}
    g = torch.Generator().manual_seed(0)
    for bins, cols in ((10, 1000), (15, 257), (3, 64)):
        t = torch.rand(5, cols, generator=g) * bins
        t[:, 0], t[:, 1] = 0.0, float(bins)
        assert triton_runs_on(t)
        fused = cumulative_histograms(t, bins, torch.empty_like(t), "triton")
        plain = cumulative_histograms(t, bins, torch.empty_like(t), "torch")
        out[f"hist-{bins}-{cols}"] = float((fused - plain).abs().max() / plain.abs().max())
    x = torch.randn(300, 16, generator=g)
    labels = torch.randint(0, 40, (300,), generator=g)
    for kernel in ("torch", "triton"):
        e = x.clone().requires_grad_()
        loss = FastAPLoss(histogram=kernel, chunk_rows=64)(e, labels)
        loss.backward()
        out[kernel] = [loss.item(), e.grad.tolist()]
    print(json.dumps(out))
    """
)


def test_the_fused_triton_kernel_matches_the_torch_path() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for key, error in out.items():
        if key.startswith("hist-"):
            assert error <= 1e-6, (key, error)
    (loss_t, grad_t), (loss_f, grad_f) = out["torch"], out["triton"]
    assert loss_f == pytest.approx(loss_t, rel=1e-6)
    torch.testing.assert_close(torch.tensor(grad_f), torch.tensor(grad_t), rtol=1e-4, atol=1e-7)


@pytest.mark.cuda
def test_the_fused_triton_kernel_on_cuda() -> None:
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    labels = torch.randint(0, 512, (4096,), generator=g)
    results = []
    for kernel in ("torch", "triton"):
        e = x.cuda().requires_grad_()
        loss = FastAPLoss(histogram=kernel)(e, labels.cuda())
        loss.backward()
        results.append((loss.item(), e.grad.cpu()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-3, atol=1e-6)
