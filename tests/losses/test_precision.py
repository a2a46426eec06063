"""The opt-in faster similarity matmul: bf16 (and TF32, a no-op on CPU) moves the loss only slightly."""

from __future__ import annotations

import pytest
import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

MAKE = {
    "fastap": lambda p: FastAPLoss(matmul_precision=p),
    "pnp": lambda p: PNPLoss("Dq", alpha=4.0, matmul_precision=p),
    "smoothap": lambda p: SmoothAPLoss(matmul_precision=p),
}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(512) // 4
    return torch.randn(129, 128, generator=g)[labels] + torch.randn(512, 128, generator=g), labels


@pytest.mark.parametrize("name", sorted(MAKE))
def test_bf16_similarities_move_the_loss_by_little(name: str) -> None:
    x, y = batch()
    values, grads = {}, {}
    for precision in ("highest", "tf32", "bf16"):
        e = x.clone().requires_grad_()
        value = MAKE[name](precision)(e, y)
        value.backward()
        values[precision], grads[precision] = float(value.detach()), e.grad
    assert values["tf32"] == values["highest"], "TF32 only changes CUDA matmuls"
    assert values["bf16"] != values["highest"], "bf16 operands must actually be used"
    assert abs(values["bf16"] - values["highest"]) < 1e-3
    cosine = torch.nn.functional.cosine_similarity(grads["bf16"].flatten(), grads["highest"].flatten(), dim=0)
    assert cosine > 0.95, f"the gradient direction survives bf16 similarities (cosine {cosine:.3f})"
    change = float((grads["bf16"] - grads["highest"]).norm() / grads["highest"].norm())
    assert change < (0.2 if name == "fastap" else 0.05), f"bf16 moved the gradient by {change:.1%}"


def test_unknown_precision_and_ranks_must_agree() -> None:
    with pytest.raises(ValueError, match="matmul_precision must be one of highest, tf32, bf16"):
        FastAPLoss(matmul_precision="fp8")
    assert FastAPLoss(matmul_precision="bf16").signature() != FastAPLoss().signature()
