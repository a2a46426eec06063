"""The generic path of GlobalBatchLoss: any loss called as loss(embeddings, labels) goes global, exactly.

Invariant (float64, W = 2 and 3 with uneven local sizes and a rank without any sample): on every rank the loss
is the single-process loss of the concatenated batch; the gradient of the rank's embeddings is W x ("mean") or
1 x ("sum") its rows of the single-process gradient; a loss's own parameters (proxies) get the full
single-process gradient on every rank. The losses are of different kinds: pytorch-metric-learning's pair-based
ContrastiveLoss, tuple-based TripletMarginLoss with a miner run on the global batch, NT-Xent, the proxy loss
ProxyAnchor, and a user's own function.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.distributed.agreement import RankFailure
from ddp_rank.losses import FastAPLoss
from tests.distributed.test_global_loss import SPLITS, global_batch, local_rows
from tests.helpers.distributed import run_distributed


@pytest.fixture(scope="module", autouse=True)
def _pytorch_metric_learning() -> None:
    """Imported by the worker that runs this file rather than by every worker that collects the suite (about
    a second each); the whole file is skipped where it is missing. The tests import it where they use it."""
    pytest.importorskip("pytorch_metric_learning")


NUM_CLASSES, WIDTH = 1001, 8  # global_batch's ids run to 1000 (its singleton class)
NAMES = ["contrastive", "triplet+miner", "ntxent", "proxy-anchor", "own-function"]


def centroid_loss(embeddings: Tensor, labels: Tensor) -> Tensor:
    """A user's own loss that is not decomposable by rows: the spread of each class around its batch mean,
    divided by the spread of all rows around the batch mean."""
    _, inverse = labels.unique(return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1, embeddings.shape[1], dtype=embeddings.dtype)
    sums = sums.index_add(0, inverse, embeddings)
    counts = torch.bincount(inverse).to(embeddings.dtype)[:, None]
    within = ((embeddings - (sums / counts)[inverse]) ** 2).sum()
    total = ((embeddings - embeddings.mean(0)) ** 2).sum()
    return within / total


def make(name: str) -> tuple[Any, Any]:
    """(loss, miner) of each case, the same on every rank (a proxy loss's proxies from a fixed seed)."""
    from pytorch_metric_learning import losses, miners

    if name == "contrastive":
        return losses.ContrastiveLoss(pos_margin=0.2, neg_margin=0.8), None
    if name == "triplet+miner":
        return losses.TripletMarginLoss(margin=0.3), miners.TripletMarginMiner(
            margin=0.3, type_of_triplets="all"
        )
    if name == "ntxent":
        return losses.NTXentLoss(temperature=0.5), None
    if name == "proxy-anchor":
        torch.manual_seed(3)
        return losses.ProxyAnchorLoss(NUM_CLASSES, WIDTH).double(), None
    return centroid_loss, None


def _parameter_grad(loss: Any) -> Tensor | None:
    params = list(loss.parameters()) if isinstance(loss, torch.nn.Module) else []
    return params[0].grad.clone() if params and params[0].grad is not None else None


def _worker(rank: int, world: int, sizes: tuple[int, ...]) -> dict[str, tuple[Any, ...]]:
    embeddings, labels = global_batch(sum(sizes), d=WIDTH)
    rows = local_rows(sizes, rank)
    out = {}
    for name in NAMES:
        for reduction in ("mean", "sum"):
            loss, miner = make(name)
            e = embeddings[rows].clone().requires_grad_()
            value = GlobalBatchLoss(loss, grad_reduction=reduction, miner=miner)(e, labels[rows])
            value.backward()
            out[f"{name}/{reduction}"] = (value.detach(), e.grad, _parameter_grad(loss))
    return out


@pytest.fixture(scope="module", params=sorted(SPLITS), ids=lambda w: f"W{w}")
def distributed_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_distributed(_worker, world, args=(SPLITS[world],), timeout=90)


def single_process(name: str, n: int) -> tuple[Tensor, Tensor, Tensor | None]:
    embeddings, labels = global_batch(n, d=WIDTH)
    loss, miner = make(name)
    e = embeddings.clone().requires_grad_()
    value = loss(e, labels) if miner is None else loss(e, labels, miner(e, labels))
    value.backward()
    assert e.grad is not None
    return value.detach(), e.grad, _parameter_grad(loss)


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", NAMES)
def test_any_loss_matches_single_process(distributed_results, name: str, reduction: str) -> None:
    world, results = distributed_results
    sizes = SPLITS[world]
    expected_loss, expected_grad, expected_param_grad = single_process(name, sum(sizes))
    assert expected_loss > 0 and expected_grad.abs().max() > 1e-6, "the reference must not be trivially zero"
    factor = world if reduction == "mean" else 1
    for rank, result in enumerate(results):
        value, grad, param_grad = result[f"{name}/{reduction}"]
        assert_close(value, expected_loss, rtol=1e-12, atol=1e-14, msg=f"loss on rank {rank}")
        assert grad.shape == (sizes[rank], WIDTH)
        expected = factor * expected_grad[local_rows(sizes, rank)]
        assert_close(grad, expected, rtol=1e-9, atol=1e-12, msg=f"gradient on rank {rank}")
        if expected_param_grad is not None:  # the proxies: the full gradient on every rank
            assert_close(param_grad, expected_param_grad, rtol=1e-9, atol=1e-12)


def test_single_process_is_the_plain_loss_with_its_miner() -> None:
    embeddings, labels = global_batch(13, d=WIDTH)
    loss, miner = make("triplet+miner")
    plain = loss(embeddings, labels, miner(embeddings, labels))
    assert_close(GlobalBatchLoss(loss, miner=miner)(embeddings, labels), plain, rtol=0, atol=0)


class OneArgument(torch.nn.Module):
    def forward(self, embeddings: Tensor) -> Tensor:
        return embeddings.sum()


REFUSED = {
    "not-callable": "cannot be called",
    "miner-as-loss": "pass it as miner=",
    "bad-miner": "miner must be called as miner(embeddings, labels)",
    "miner-with-listwise": "take no mined tuples",
    "no-indices": "takes no third argument",
    "one-arg": "cannot be called with two positional arguments",
    "twice": "already spans the ranks",
}
"""What ``GlobalBatchLoss`` refuses when built, each with the words of its refusal."""


def refused(case: str) -> tuple[Any, Any]:
    """The (loss, miner) of a case of ``REFUSED``."""
    from pytorch_metric_learning import losses, miners

    return {
        "not-callable": (42, None),
        "miner-as-loss": (miners.MultiSimilarityMiner(), None),
        "bad-miner": (losses.ContrastiveLoss(), 42),
        "miner-with-listwise": (FastAPLoss(), miners.MultiSimilarityMiner()),
        "no-indices": (centroid_loss, miners.MultiSimilarityMiner()),
        "one-arg": (OneArgument(), None),
        "twice": (GlobalBatchLoss(FastAPLoss()), None),
    }[case]


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_be_wrapped_is_refused_when_built(case: str) -> None:
    loss, miner = refused(case)
    with pytest.raises(TypeError, match=r"GlobalBatchLoss wraps|miner") as info:
        GlobalBatchLoss(loss, miner=miner)
    assert REFUSED[case] in str(info.value)


def test_pml_distributed_wrapper_is_refused() -> None:
    from pytorch_metric_learning import losses
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

    with pytest.raises(TypeError, match=r"already spans the ranks .*: wrap the plain loss"):
        GlobalBatchLoss(DistributedLossWrapper(losses.ContrastiveLoss()))


def _failing_worker(rank: int, world: int) -> dict[str, str]:
    """An exception inside the loss on one rank, and bad inputs on one rank, raise on EVERY rank (no hang)."""

    def fails_on_rank_1(embeddings: Tensor, labels: Tensor) -> Tensor:
        if rank == 1:
            raise RuntimeError("out of memory (simulated)")
        return embeddings.sum()

    from pytorch_metric_learning import losses

    embeddings, labels = global_batch(12, d=WIDTH)
    e, y = embeddings[local_rows((5, 7), rank)], labels[local_rows((5, 7), rank)]
    errors = {}
    with pytest.raises(RankFailure) as failure:
        GlobalBatchLoss(fails_on_rank_1)(e, y)
    errors["inside"] = str(failure.value)
    with pytest.raises(ValueError) as bad:
        GlobalBatchLoss(centroid_loss)(e, y.double() if rank == 0 else y)
    errors["labels"] = str(bad.value)
    with pytest.raises(ValueError) as other:
        GlobalBatchLoss(losses.ContrastiveLoss(neg_margin=rank + 1.0))(e, y)
    errors["different-loss"] = str(other.value)
    GlobalBatchLoss(centroid_loss)(e.clone().requires_grad_(), y).backward()  # the group is still in step
    nothing = e[:0].clone().requires_grad_()
    zero = GlobalBatchLoss(centroid_loss)(nothing, y[:0])  # no row on any rank: 0, and a gradient of 0 rows
    zero.backward()
    errors["empty"] = f"{float(zero)} {tuple(nothing.grad.shape)}"
    return errors


@pytest.mark.distributed
def test_failures_raise_on_every_rank_without_hanging() -> None:
    results = run_distributed(_failing_worker, 2, timeout=60)
    assert all("rank(s) [1]" in r["inside"] and "out of memory (simulated)" in r["inside"] for r in results)
    assert "integer class ids" in results[0]["labels"] and "rank(s) [0]" in results[1]["labels"]
    assert all("ranks run different losses" in r["different-loss"] for r in results)
    assert all(r["empty"] == f"0.0 (0, {WIDTH})" for r in results)
