"""Edge cases, input errors, dtypes and the row interface of the losses."""

from __future__ import annotations

import pytest
import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

ALL = {
    "fastap": FastAPLoss,
    "pnp_o": lambda **kw: PNPLoss("O", **kw),
    "pnp_dq": lambda **kw: PNPLoss("Dq", **kw),
    "smooth_ap": SmoothAPLoss,
    "smooth_ap_self_excluded": lambda **kw: SmoothAPLoss(count_self=False, **kw),
}


def _grad(loss, x, y):
    x = x.clone().requires_grad_(True)
    value = loss(x, y)
    value.backward()
    return value, x.grad


@pytest.mark.parametrize("name", ALL)
def test_no_valid_query_gives_zero_loss_and_zero_gradient(name):
    x = torch.randn(6, 8)
    y = torch.arange(6)  # every query alone in its class
    # The authors' Smooth-AP counts the query as its own positive: only count_self=False has invalid queries.
    loss, grad = _grad(SmoothAPLoss(count_self=False) if name.startswith("smooth") else ALL[name](), x, y)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", ALL)
def test_one_sample_and_empty_batch(name):
    for n in (0, 1):
        loss, grad = _grad(ALL[name](), torch.randn(n, 4), torch.zeros(n, dtype=torch.long))
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert grad.shape == (n, 4)


@pytest.mark.parametrize("name", ALL)
def test_all_one_label_is_a_perfect_ranking(name):
    """With no negative every positive ranks first: AP is 1, PNP penalties are 0."""
    loss, grad = _grad(ALL[name](), torch.randn(9, 5), torch.zeros(9, dtype=torch.long))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("name", ALL)
def test_duplicate_embeddings_are_finite(name):
    x = torch.randn(4, 8).repeat(3, 1)
    y = torch.tensor([0, 1, 2, 3] * 3)
    loss, grad = _grad(ALL[name](), x, y)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_finite_gradients_close_to_float32(name, dtype):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(64) // 4
    # Hard batch (classes overlap) so that gradients are well above fp16's resolution.
    x = (torch.randn(16, 32, generator=g)[y] + 1.5 * torch.randn(64, 32, generator=g)).to(dtype)
    loss_h, grad_h = _grad(ALL[name](), x, y)
    loss_f, grad_f = _grad(ALL[name](), x.float(), y)
    assert loss_h.dtype == torch.float32 and grad_h.dtype == dtype
    assert torch.isfinite(grad_h).all()
    assert loss_h.item() == pytest.approx(loss_f.item(), abs=1e-6)
    scale = grad_f.abs().max().item()
    assert scale > 1e-3
    torch.testing.assert_close(grad_h.float(), grad_f, rtol=0.02, atol=0.02 * scale)


@pytest.mark.parametrize("name", ALL)
def test_grad_output_is_honoured(name):
    x, y = torch.randn(20, 6, dtype=torch.float64), torch.arange(20) % 5
    _, grad = _grad(ALL[name](), x, y)
    x2 = x.clone().requires_grad_(True)
    (ALL[name]()(x2, y) * -3.5).backward()
    torch.testing.assert_close(x2.grad, -3.5 * grad)


@pytest.mark.parametrize(
    ("embeddings", "labels", "message"),
    [
        (torch.randn(4, 3), torch.tensor([0.0, 1.0, 0.0, 1.0]), "integer class ids"),
        (torch.randn(4, 3), torch.tensor([[0, 1], [0, 1]]), "1-D"),
        (torch.randn(4, 3), torch.tensor([0, 1, 0]), "one label per row"),
        (torch.randn(4, 3), [0, 1, 0, 1], "torch.Tensor"),
        (torch.randn(4), torch.tensor([0, 1, 0, 1]), "2-D"),
        (torch.arange(12).reshape(4, 3), torch.tensor([0, 1, 0, 1]), "floating point"),
        (torch.tensor([[1.0, 0.0], [float("nan"), 1.0]]), torch.tensor([0, 0]), "NaN or Inf"),
        (torch.tensor([[1.0, 0.0], [float("inf"), 1.0]]), torch.tensor([0, 0]), "NaN or Inf"),
        (torch.tensor([[1.0, 0.0], [1e20, 1.0]]), torch.tensor([0, 0]), "row 1 is too long to normalise"),
    ],
)
@pytest.mark.parametrize("name", ALL)
def test_bad_input_raises_value_error_naming_the_problem(name, embeddings, labels, message):
    with pytest.raises(ValueError, match=message):
        ALL[name]()(embeddings, labels)


@pytest.mark.parametrize("name", ALL)
def test_normalize_false_requires_unit_rows(name):
    x = torch.randn(8, 4) * 3
    with pytest.raises(ValueError, match="unit-length"):
        ALL[name](normalize=False)(x, torch.arange(8) % 2)
    unit = torch.nn.functional.normalize(x, dim=1)
    torch.testing.assert_close(
        ALL[name](normalize=False)(unit, torch.arange(8) % 2), ALL[name]()(x, torch.arange(8) % 2)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: FastAPLoss(0),
        lambda: PNPLoss("X"),
        lambda: PNPLoss(tau=0),
        lambda: SmoothAPLoss(tau=-1),
        lambda: FastAPLoss(memory_budget=0),
        lambda: PNPLoss(chunk_rows=0),
    ],
)
def test_bad_hyperparameters_are_rejected(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("name", ALL)
def test_rows_of_a_partition_add_up_to_the_full_loss(name):
    """What the distributed layer relies on: per-query rows over a split of the queries sum to the whole."""
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 6, (30,), generator=g)
    x = torch.nn.functional.normalize(torch.randn(30, 8, generator=g, dtype=torch.float64), dim=1)
    loss = ALL[name]()
    full = loss.rows(x, torch.arange(30), x, y)
    parts = [
        torch.tensor([0, 5, 7]),
        torch.arange(8, 30),
        torch.tensor([1, 2, 3, 4, 6]),
        torch.tensor([], dtype=torch.long),
    ]
    losses = torch.zeros(30, dtype=torch.float64)
    grad_queries = torch.zeros_like(x)
    grad_database = torch.zeros_like(x)
    n_valid = 0
    for index in parts:
        out = loss.rows(x[index], index, x, y)
        losses[index] = out.losses
        grad_queries[index] = out.grad_queries
        grad_database += out.grad_database
        n_valid += out.n_valid
    assert n_valid == full.n_valid
    torch.testing.assert_close(losses, full.losses)
    torch.testing.assert_close(grad_queries, full.grad_queries)
    torch.testing.assert_close(grad_database, full.grad_database)


def test_rows_without_grad_returns_no_gradients():
    x = torch.nn.functional.normalize(torch.randn(10, 4), dim=1)
    out = FastAPLoss().rows(x, torch.arange(10), x, torch.arange(10) % 3, need_grad=False)
    assert out.grad_queries is None and out.grad_database is None
    assert out.losses.shape == (10,)


def test_rows_rejects_mismatched_inputs():
    x = torch.nn.functional.normalize(torch.randn(10, 4), dim=1)
    with pytest.raises(ValueError, match="share d"):
        FastAPLoss().rows(x[:, :3], torch.arange(10), x, torch.arange(10))
    with pytest.raises(ValueError, match="outside the database"):
        FastAPLoss().rows(x, torch.arange(10) + 5, x, torch.arange(10))


def test_forward_without_grad_skips_the_gradient():
    x = torch.randn(12, 4)
    with torch.no_grad():
        value = PNPLoss()(x, torch.arange(12) % 3)
    assert value.requires_grad is False
    assert value.item() == pytest.approx(PNPLoss()(x, torch.arange(12) % 3).item())


def test_fastap_runs_no_scatter_and_keeps_float32_digits_at_large_n():
    """FastAP's histograms are cumulative sums, not scatter-adds (atomics on a GPU, a sort under deterministic
    algorithms): record the ATen calls of a forward + backward. At N = 4,096 the float32 loss and gradient stay
    within 1e-5 of float64 (a cumulative count formed as (l + 1) N minus a sum would lose those digits)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(4096, 32, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 512, (4096,), generator=g)
    x32 = x64.float().requires_grad_()
    calls = Calls()
    with calls:
        loss32 = FastAPLoss()(x32, labels)
        loss32.backward()
    assert not {n for n in calls.names if "scatter" in n or "index_add" in n}, sorted(calls.names)
    x64.requires_grad_()
    loss64 = FastAPLoss()(x64, labels)
    loss64.backward()
    assert abs(loss32.item() - loss64.item()) <= 1e-5 * loss64.item()
    assert (x32.grad.double() - x64.grad).norm() <= 1e-5 * x64.grad.norm()
