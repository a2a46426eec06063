"""Safe autograd around the closed-form gradients: no double backward, no gradient work nobody asked for,
FastAP's kernel never extrapolated outside [0, 4]."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

LOSSES = {"fastap": FastAPLoss, "pnp": lambda **kw: PNPLoss("Dq", **kw), "smoothap": SmoothAPLoss}


def batch(n: int = 24, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g), torch.arange(n) // 3


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_double_backward_is_refused(name: str) -> None:
    x, y = batch()
    for loss in (LOSSES[name](), GlobalBatchLoss(LOSSES[name]())):
        e = x.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="once-differentiable"):
            torch.autograd.grad(loss(e, y), e, create_graph=True)
        (grad,) = torch.autograd.grad(loss(e, y), e)  # a plain backward is unaffected
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_no_gradient_work_under_no_grad(name: str) -> None:
    x, y = batch()
    e = F.normalize(x, dim=1).requires_grad_()
    loss = LOSSES[name](normalize=False)
    with mock.patch.object(loss, "rows", wraps=loss.rows) as rows:
        with torch.no_grad():
            value = loss(e, y)
        assert rows.call_args.kwargs["need_grad"] is False and not value.requires_grad
        loss(e, y)
        assert rows.call_args.kwargs["need_grad"] is True


def test_fastap_clamps_distances_to_the_kernel_range() -> None:
    """Rows a hair longer than 1 (inside normalize=False's tolerance), duplicated: distances just below 0.
    Unclamped, the kernel extrapolates and the loss came out negative (-0.00126)."""
    x, _ = batch(12)
    rows = F.normalize(x, dim=1) * 1.0009
    e = torch.cat([rows, rows]).requires_grad_()
    y = torch.cat([torch.arange(12), torch.arange(12)])
    value = FastAPLoss(normalize=False)(e, y)
    assert 0.0 <= float(value.detach()) <= 1.0
    value.backward()
    assert torch.isfinite(e.grad).all()
