"""The losses against independent implementations: pytorch-metric-learning, brute force, finite differences."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss
from tests.helpers import brute_force

VARIANTS = ["O", "Iu", "Ib", "Ds", "Dq"]


def _batch(seed: int, n: int = 40, dim: int = 16, singletons: bool = True, dtype=torch.float64):
    """Uneven classes (sizes 2..7), optional singletons, shuffled, clustered so ranks are not trivial."""
    g = torch.Generator().manual_seed(seed)
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(torch.randint(2, 8, (1,), generator=g)))
    labels = torch.cat([torch.full((s,), c) for c, s in enumerate(sizes)])[:n]
    if singletons:
        labels[-3:] = torch.tensor([100, 101, 102])
    labels = labels[torch.randperm(n, generator=g)]
    centres = torch.randn(int(labels.max()) + 1, dim, generator=g, dtype=dtype)
    x = centres[labels] + 0.8 * torch.randn(n, dim, generator=g, dtype=dtype)
    return x, labels


@pytest.fixture(scope="module")
def pml() -> Any:
    """pytorch-metric-learning's losses, imported by the worker that runs these tests rather than by every
    worker that collects the suite (about a second each)."""
    from pytorch_metric_learning import losses

    return losses


def _loss_and_grad(loss_fn, x, y):
    x = x.clone().requires_grad_(True)
    value = loss_fn(x, y)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_bins", [10, 25])
def test_fastap_matches_pytorch_metric_learning(pml, seed, num_bins):
    x, y = _batch(seed)
    ours = _loss_and_grad(FastAPLoss(num_bins), x, y)
    theirs = _loss_and_grad(pml.FastAPLoss(num_bins=num_bins), x, y)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("variant", VARIANTS)
def test_pnp_matches_pytorch_metric_learning(pml, seed, variant):
    x, y = _batch(seed)
    kwargs = {"b": 2.0, "alpha": 2.0}
    ours = _loss_and_grad(PNPLoss(variant, tau=0.05, **kwargs), x, y)
    pml_loss = pml.PNPLoss(b=kwargs["b"], alpha=kwargs["alpha"], anneal=0.05, variant=variant)
    theirs = _loss_and_grad(pml_loss, x, y)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_fastap_matches_brute_force(seed):
    x, y = _batch(seed, n=24)
    ours = _loss_and_grad(FastAPLoss(10), x, y)
    brute = _loss_and_grad(brute_force.fastap, x, y)
    torch.testing.assert_close(ours, brute, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("count_self", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_pnp_matches_brute_force(variant, count_self):
    x, y = _batch(7, n=24)
    ours = _loss_and_grad(PNPLoss(variant, tau=0.05, alpha=3.0, count_self=count_self), x, y)
    brute = _loss_and_grad(
        lambda a, b: brute_force.pnp(a, b, variant, tau=0.05, alpha=3.0, count_self=count_self), x, y
    )
    torch.testing.assert_close(ours, brute, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("count_self", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_smooth_ap_matches_brute_force(seed, count_self):
    x, y = _batch(seed, n=24)
    ours = _loss_and_grad(SmoothAPLoss(tau=0.05, count_self=count_self), x, y)
    brute = _loss_and_grad(lambda a, b: brute_force.smooth_ap(a, b, tau=0.05, count_self=count_self), x, y)
    torch.testing.assert_close(ours, brute, rtol=1e-9, atol=1e-12)


def test_count_self_false_is_the_papers_scaling_on_equal_classes():
    """With classes of size g and well-separated positives, the authors' PNP-O is (g-1)/g of the paper's."""
    x, y = _batch(3, n=32, singletons=False)
    y = torch.arange(32) // 4
    authors = PNPLoss("O", count_self=True)(x, y)
    paper = PNPLoss("O", count_self=False)(x, y)
    # R[a, a] is not exactly 0, so the relation is approximate; it is exact for the sum over P_a \ {a}.
    assert authors.item() == pytest.approx(paper.item() * 3 / 4, rel=1e-3, abs=1e-6)


LOSSES = {
    "fastap": lambda: FastAPLoss(10),
    "pnp_dq": lambda: PNPLoss("Dq", tau=0.1, alpha=2.0),
    "pnp_ib": lambda: PNPLoss("Ib", tau=0.1),
    "pnp_self_excluded": lambda: PNPLoss("Iu", tau=0.1, count_self=False),
    "smooth_ap": lambda: SmoothAPLoss(tau=0.1),
    "smooth_ap_self_excluded": lambda: SmoothAPLoss(tau=0.1, count_self=False),
}


@pytest.mark.parametrize("name", LOSSES)
def test_gradcheck(name):
    x, y = _batch(11, n=14, dim=6)
    x.requires_grad_(True)
    loss = LOSSES[name]()
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", LOSSES)
def test_chunk_size_does_not_change_loss_or_gradient(name):
    x, y = _batch(5, n=19)
    reference = _loss_and_grad(LOSSES[name](), x, y)
    for rows in (1, 4, 10, 18, 100):  # uneven last chunks included
        loss = LOSSES[name]()
        loss.chunk_rows = rows
        torch.testing.assert_close(_loss_and_grad(loss, x, y), reference, rtol=1e-12, atol=1e-14)
    tiny_budget = LOSSES[name]()
    tiny_budget.memory_budget = 1  # one row per chunk
    torch.testing.assert_close(_loss_and_grad(tiny_budget, x, y), reference, rtol=1e-12, atol=1e-14)
