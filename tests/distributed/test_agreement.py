"""Cross-rank agreement, in real gloo processes: a failure on one rank stops every rank with its message."""

from __future__ import annotations

import pytest

from ddp_rank.distributed.agreement import RankFailure, agree, gather_counts, raise_if_any_failed
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _one_rank_fails(rank: int, world: int) -> str:
    raise_if_any_failed(None)  # all well: nobody raises
    try:
        raise_if_any_failed("shard train/x.tar is gone" if rank == 1 else None)
    except RankFailure as exc:
        return str(exc)
    return "no error"


def test_a_failure_on_one_rank_is_raised_on_every_rank() -> None:
    assert run_distributed(_one_rank_fails, world_size=3) == ["rank 1: shard train/x.tar is gone"] * 3


def _stop_on_one_rank(rank: int, world: int) -> list[bool]:
    seen = [agree(None, stop=False), agree(None, stop=rank == 2)]
    try:
        agree("disk full" if rank == 0 else None, stop=rank == 1)  # a failure wins over a stop request
    except RankFailure as exc:
        seen.append("disk full" in str(exc))
    return seen


def test_a_stop_request_on_one_rank_is_seen_by_every_rank_at_the_same_call() -> None:
    assert run_distributed(_stop_on_one_rank, world_size=3) == [[False, True, True]] * 3


def _counts(rank: int, world: int) -> dict:
    return gather_counts({"replaced_classes": rank + 1, "bad_shards": [f"s{rank % 2}.tar"]})


def test_counts_are_summed_and_names_merged() -> None:
    merged = run_distributed(_counts, world_size=3)
    assert merged == [{"replaced_classes": 6, "bad_shards": ["s0.tar", "s1.tar"]}] * 3


def test_without_a_process_group() -> None:
    raise_if_any_failed(None)
    with pytest.raises(RankFailure, match=r"^boom$"):
        raise_if_any_failed("boom")
    assert gather_counts({"a": 2, "b": ["x"]}) == {"a": 2, "b": ["x"]}
    assert agree(None, stop=True) and not agree(None)


# --------------------------------------------------------------------------------- the global-batch loss


def _mismatch_worker(rank: int, world: int) -> dict[str, str]:
    import torch

    from ddp_rank.distributed import GlobalBatchLoss
    from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

    e = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    y = torch.arange(6) // 2 + 10 * rank
    errors = {}
    for name, loss in (
        ("tau", PNPLoss("Dq", tau=0.1 if rank == 0 else 0.01)),
        ("family", FastAPLoss() if rank == 0 else SmoothAPLoss()),
    ):
        try:
            GlobalBatchLoss(loss)(e, y)
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


@pytest.mark.distributed
def test_ranks_with_different_losses_fail_alike() -> None:
    results = run_distributed(_mismatch_worker, 2)
    assert results[0] == results[1]
    assert "tau=0.1" in results[0]["tau"] and "tau=0.01" in results[0]["tau"]
    assert "rank 0: FastAPLoss" in results[0]["family"] and "rank 1: SmoothAPLoss" in results[0]["family"]


def _failing_rows_worker(rank: int, world: int) -> str:
    import torch

    from ddp_rank.distributed import GlobalBatchLoss
    from ddp_rank.losses import FastAPLoss

    class Exploding(FastAPLoss):
        def rows(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if rank == 1:
                raise RuntimeError("CUDA out of memory (simulated)")
            return super().rows(*args, **kwargs)

    e = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    try:
        GlobalBatchLoss(Exploding())(e, torch.arange(6) // 2)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_an_exception_inside_the_loss_on_one_rank_is_raised_on_every_rank() -> None:
    results = run_distributed(_failing_rows_worker, 2, timeout=60)
    assert results[0] == results[1]
    assert "failed on rank(s) [1]" in results[0] and "CUDA out of memory (simulated)" in results[0]


def _half_traffic_worker(rank: int, world: int) -> dict[str, object]:
    import torch

    from ddp_rank.distributed import CommCounter, GlobalBatchLoss
    from ddp_rank.losses import PNPLoss

    g = torch.Generator().manual_seed(0)
    full = torch.randn(20, 16, generator=g).to(torch.bfloat16)
    labels = torch.arange(20) // 4
    rows = slice(0, 8) if rank == 0 else slice(8, 20)
    out: dict[str, object] = {}
    for name, e in (("bf16", full[rows].clone()), ("fp32", full[rows].float())):
        counter = CommCounter()
        e.requires_grad_()
        value = GlobalBatchLoss(PNPLoss("Dq", tau=0.1), comm_counter=counter)(e, labels[rows])
        value.backward()
        out[name] = (value.detach(), e.grad.float(), dict(counter.bytes_sent))
    counter = CommCounter()
    e = full[rows].clone().requires_grad_()
    GlobalBatchLoss(PNPLoss("Dq", tau=0.1), comm_counter=counter, grad_dtype=torch.bfloat16)(
        e, labels[rows]
    ).backward()
    out["bf16-grads"] = dict(counter.bytes_sent)
    return out


@pytest.mark.distributed
def test_half_precision_embeddings_travel_in_half_precision() -> None:
    """bf16 inputs: the same loss as their float32 upcast (the rows are upcast after the gather, as prepare
    does locally), gradients equal up to the final rounding to bf16, half the embedding bytes; labels < 128
    travel as int8; the gradient reduce-scatter stays float32 unless grad_dtype asks for bf16."""
    import torch

    for result in run_distributed(_half_traffic_worker, 2):
        (v16, g16, b16), (v32, g32, b32) = result["bf16"], result["fp32"]
        assert torch.equal(v16, v32)
        torch.testing.assert_close(g16, g32.to(torch.bfloat16).float(), rtol=0, atol=0)
        padded_rows, d = 12, 16
        assert b32["all_gather"] == padded_rows * (d * 4 + 1)  # (W-1)/W x 2 ranks x rows x (d fp32 + int8)
        assert b16["all_gather"] == padded_rows * (d * 2 + 1)
        assert b16["reduce_scatter"] == b32["reduce_scatter"] == padded_rows * d * 4
        assert result["bf16-grads"]["reduce_scatter"] == padded_rows * d * 2
