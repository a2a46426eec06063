"""GlobalBatchLoss across W gloo processes equals the single-process loss on the concatenated batch.

Invariant checked (float64): on every rank the returned loss is the single-process loss of the global batch,
and the gradient of the rank's local embeddings is W x (grad_reduction="mean") or 1 x ("sum") the rank's rows
of the single-process gradient, for uneven local sizes and a rank with no sample.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ddp_rank.distributed import CommCounter, GlobalBatchLoss, global_batch_loss
from ddp_rank.losses import FastAPLoss, ListwiseLoss, PNPLoss, SmoothAPLoss
from tests.helpers.distributed import run_distributed

LOSSES = ["fastap", "fastap-chunked", "pnp-O", "pnp-Iu", "pnp-Ib", "pnp-Ds", "pnp-Dq", "smooth-ap"]
# (world size, local sizes): uneven, and one rank without any sample.
SPLITS = {2: (5, 11), 3: (9, 0, 14)}


def make_loss(name: str) -> ListwiseLoss:
    """Each loss under test. Temperatures of 0.1 keep the sigmoids off their flat tails with random data."""
    if name == "fastap":
        return FastAPLoss(num_bins=10)
    if name == "fastap-chunked":
        return FastAPLoss(num_bins=20, chunk_rows=3)
    if name == "smooth-ap":
        return SmoothAPLoss(tau=0.1)
    variant = name.split("-")[1]
    return PNPLoss(variant=variant, tau=0.1, alpha=4.0 if variant == "Dq" else 1.0)


def global_batch(n: int, seed: int = 0, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised float64 embeddings and shuffled labels: classes of 2-4 samples plus one singleton class
    (a query with no positive: not counted in the mean, still a negative for the others)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.arange(n - 1) // 3, torch.tensor([1000])])
    labels = labels[torch.randperm(n, generator=g)]
    return torch.randn(n, d, generator=g, dtype=torch.float64), labels


def local_rows(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _exactness_worker(rank: int, world: int, sizes: tuple[int, ...]) -> dict[str, tuple[torch.Tensor, ...]]:
    embeddings, labels = global_batch(sum(sizes))
    rows = local_rows(sizes, rank)
    out = {}
    for name in LOSSES:
        for reduction in ("mean", "sum"):
            e = embeddings[rows].clone().requires_grad_()
            value = GlobalBatchLoss(make_loss(name), grad_reduction=reduction)(e, labels[rows])
            value.backward()
            out[f"{name}/{reduction}"] = (value.detach(), e.grad)
    for name in ("fastap", "pnp-Dq"):  # float32 rows, as a model gives them: autocast's eligible dtype
        for under_autocast in (False, True):
            e = embeddings[rows].float().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
                value = GlobalBatchLoss(make_loss(name))(e, labels[rows])
            value.backward()
            out[f"{name}/autocast={under_autocast}"] = (value.detach(), e.grad)
    return out


@pytest.fixture(scope="module", params=sorted(SPLITS), ids=lambda w: f"W{w}")
def distributed_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_distributed(_exactness_worker, world, args=(SPLITS[world],))


def single_process(name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    embeddings, labels = global_batch(n)
    e = embeddings.clone().requires_grad_()
    value = make_loss(name)(e, labels)
    value.backward()
    assert e.grad is not None
    return value.detach(), e.grad


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LOSSES)
def test_global_loss_matches_single_process(distributed_results, name: str, reduction: str) -> None:
    world, results = distributed_results
    sizes = SPLITS[world]
    expected_loss, expected_grad = single_process(name, sum(sizes))
    assert expected_grad.abs().max() > 1e-6, "the reference gradient must not be trivially zero"
    factor = world if reduction == "mean" else 1
    for rank, result in enumerate(results):
        value, grad = result[f"{name}/{reduction}"]
        assert_close(value, expected_loss, rtol=1e-10, atol=1e-12, msg=f"loss on rank {rank}")
        assert grad.shape == (sizes[rank], 8)
        assert_close(
            grad,
            factor * expected_grad[local_rows(sizes, rank)],
            rtol=1e-9,
            atol=1e-12,
            msg=f"gradient on rank {rank}",
        )


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fastap", "pnp-Dq"])
def test_the_global_loss_inside_autocast_is_the_loss_of_its_inputs(distributed_results, name: str) -> None:
    """A user's loop under ``torch.autocast``: the global loss keeps its own precision, as the plain one does
    (``tests/losses/test_precision.py``), so the value and gradients are those outside autocast."""
    _, results = distributed_results
    for result in results:
        plain, autocast = result[f"{name}/autocast=False"], result[f"{name}/autocast=True"]
        assert torch.equal(autocast[0], plain[0]) and torch.equal(autocast[1], plain[1])


def test_single_process_is_the_plain_loss() -> None:
    embeddings, labels = global_batch(13)
    for name in LOSSES:
        e1, e2 = embeddings.clone().requires_grad_(), embeddings.clone().requires_grad_()
        plain, wrapped = make_loss(name)(e1, labels), global_batch_loss(make_loss(name), e2, labels)
        plain.backward()
        wrapped.backward()
        assert_close(wrapped, plain, rtol=0, atol=0)
        assert_close(e2.grad, e1.grad, rtol=0, atol=0)


def test_rejects_unknown_grad_reduction() -> None:
    with pytest.raises(ValueError, match="grad_reduction"):
        GlobalBatchLoss(FastAPLoss(), grad_reduction="avg")  # type: ignore[arg-type]


def _misuse_worker(rank: int, world: int) -> dict[str, str]:
    """Each scenario must raise on EVERY rank (not hang), and the group must stay usable afterwards."""
    embeddings, labels = global_batch(12)
    rows = local_rows((5, 7), rank)
    e, y = embeddings[rows], labels[rows]
    scenarios = {
        "width": lambda: (e if rank == 0 else e[:, :4], y),
        "nan": lambda: (e.clone().index_fill_(0, torch.tensor([0]), float("nan")) if rank == 1 else e, y),
        "float-labels": lambda: (e, y.double() if rank == 0 else y),
        "dtype": lambda: (e.float() if rank == 1 else e, y),
        # Half precision travels in its own dtype: both are float32 after prepare, not on the wire.
        "half-dtypes": lambda: (e.half() if rank == 0 else e.bfloat16(), y),
        "half-and-float": lambda: (e.bfloat16() if rank == 0 else e.float(), y),
        "empty-placeholder": lambda: (e.bfloat16() if rank == 0 else e.float()[:0], y[:0] if rank else y),
        "grad-mode": lambda: (e.clone().requires_grad_(rank == 0), y),
    }
    errors = {}
    loss = GlobalBatchLoss(FastAPLoss())
    for name, build in scenarios.items():
        with pytest.raises(ValueError) as info:
            loss(*build())
        errors[name] = str(info.value)
    value = loss(e.clone().requires_grad_(), y)  # still in step after the failures
    value.backward()
    return errors


@pytest.mark.distributed
def test_bad_inputs_fail_on_every_rank_without_hanging() -> None:
    results = run_distributed(_misuse_worker, 2, timeout=60)
    assert "embedding width" in results[0]["width"] and "embedding width" in results[1]["width"]
    assert "NaN" in results[1]["nan"] and "rank(s) [1]" in results[0]["nan"]
    assert "int64" in results[0]["float-labels"] and "rank(s) [0]" in results[1]["float-labels"]
    for name in ("dtype", "half-dtypes", "half-and-float", "empty-placeholder"):
        assert all("embedding dtype" in r[name] for r in results), name
    assert "['bfloat16', 'float32']" in results[0]["empty-placeholder"]
    assert all("grad mode" in r["grad-mode"] for r in results)


def _bytes_worker(rank: int, world: int) -> dict[str, int]:
    embeddings, labels = global_batch(16, d=8)
    counter = CommCounter()
    e = embeddings[local_rows((5, 11), rank)].clone().requires_grad_()
    GlobalBatchLoss(FastAPLoss(), comm_counter=counter)(e, labels[local_rows((5, 11), rank)]).backward()
    return counter.bytes_sent


@pytest.mark.distributed
def test_bytes_counted_per_collective() -> None:
    """W=2, padded width 11, d=8, float64: ring bytes = (W-1)/W x payload of each collective."""
    counts = run_distributed(_bytes_worker, 2)
    expected = {
        "all_gather_meta": 2 * 8 * 8 // 2,  # 8 ints: rows, width, dtype, grad, failed, loss, label range
        "all_gather": (2 * 11 * 8 * 8 + 2 * 11 * 4)
        // 2,  # embeddings float64 + labels int32 (ids up to 1000)
        "all_reduce": 2 * 3 * 8 // 2,  # loss sum, valid count, failure flag
        "reduce_scatter": 2 * 11 * 8 * 8 // 2,
    }
    assert counts == [expected, expected]


SUBGROUP_N = 15


def _subgroup_worker(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks 0 and 2 share a group (rank 2 is its member 1); rank 1 is alone in a group of size 1."""
    import torch.distributed as dist

    pair, solo = dist.new_group([0, 2]), dist.new_group([1])
    embeddings, labels = global_batch(SUBGROUP_N)
    rows = {0: slice(0, 6), 1: slice(0, SUBGROUP_N), 2: slice(6, SUBGROUP_N)}[rank]
    e = embeddings[rows].clone().requires_grad_()
    value = GlobalBatchLoss(make_loss("pnp-Ds"), group=solo if rank == 1 else pair)(e, labels[rows])
    value.backward()
    return value.detach(), e.grad


@pytest.mark.distributed
def test_process_subgroups_and_world_size_one() -> None:
    results = run_distributed(_subgroup_worker, 3)
    expected_loss, expected_grad = single_process("pnp-Ds", SUBGROUP_N)
    for rank, factor, rows in (
        (0, 2, slice(0, 6)),
        (1, 1, slice(0, SUBGROUP_N)),
        (2, 2, slice(6, SUBGROUP_N)),
    ):
        value, grad = results[rank]
        assert_close(value, expected_loss, rtol=1e-10, atol=1e-12)
        assert_close(grad, factor * expected_grad[rows], rtol=1e-9, atol=1e-12)
