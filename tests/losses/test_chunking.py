"""Chunks follow their own classes: queries sorted by class size, each chunk padded to its own widest class
(the plan is asserted here; its time is measured in benchmarks/loss_classes.py)."""

from __future__ import annotations

import itertools

import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss
from ddp_rank.losses.rows import plan_chunks

N = 4096


def _bytes(width: int) -> int:
    return (width + 2) * N * 4  # a rank loss's [c, P, N] work per query row (float32)


def test_one_big_class_does_not_widen_the_other_chunks() -> None:
    sizes = [4] * (N - 256) + [256] * 256  # sorted by class size, as rows() sorts them
    chunks = plan_chunks(sizes, _bytes, 32 * 2**20, torch.device("cpu"))
    assert [start for start, _, _ in chunks] == sorted({start for start, _, _ in chunks})
    assert chunks[0][0] == 0 and chunks[-1][1] == N
    small = [(a, b, p) for a, b, p in chunks if b <= N - 256]
    assert small and all(p == 4 for _, _, p in small)
    big = [(a, b, p) for a, b, p in chunks if a >= N - 256]
    assert all(p == 256 for _, _, p in big)
    assert len([c for c in chunks if c[0] < N - 256 < c[1]]) <= 1, "at most one chunk mixes the two sizes"
    padded = sum((b - a) * (p + 2) for a, b, p in chunks)
    exact = sum(s + 2 for s in sizes)
    assert padded <= 1.05 * exact, "the padded work stays that of the classes themselves"
    for a, b, p in chunks:  # every chunk fits the budget at its own width (or is a single row)
        assert (b - a) * _bytes(p) <= 32 * 2**20 or b - a == 1


def test_a_forced_row_count_is_kept() -> None:
    chunks = plan_chunks([2, 2, 3, 5, 9, 9, 9], _bytes, None, torch.device("cpu"), override=3)
    assert chunks == [(0, 3, 3), (3, 6, 9), (6, 7, 9)]


def test_sorted_chunks_give_the_same_loss_and_gradient_as_one_chunk() -> None:
    g = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.full((40,), 0), torch.arange(1, 61).repeat_interleave(2)])
    labels = labels[torch.randperm(labels.numel(), generator=g)]
    x = torch.randn(labels.numel(), 16, generator=g, dtype=torch.float64)
    results = []
    for rows in (None, 7):
        e = x.clone().requires_grad_()
        loss = PNPLoss("Dq", tau=0.1, chunk_rows=rows, memory_budget=None if rows else 2**40)
        value = loss(e, labels)
        value.backward()
        results.append((value.detach(), e.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-10, atol=1e-13)


def test_work_space_is_the_plan_rows_makes() -> None:
    """``work_space`` (what ``ddp-rank plan`` reports) sizes chunks exactly as ``rows`` does on a batch of
    equal classes: the same rows per chunk, and within the budget."""
    budget = 2**20
    loss = PNPLoss("Dq", memory_budget=budget)
    n, per_class = 512, 4
    x = torch.nn.functional.normalize(torch.randn(n, 32), dim=1)
    y = torch.arange(n) // per_class
    blocks: list[int] = []
    score = loss._score_chunk

    def spy(block, chunk, need_grad):  # type: ignore[no-untyped-def]
        blocks.append(block.shape[0])
        return score(block, chunk, need_grad)

    loss._score_chunk = spy  # type: ignore[method-assign]
    loss.rows(x, torch.arange(n), x, y)
    work, rows = loss.work_space(n, n, per_class, "cpu")
    assert rows == max(blocks) and len(blocks) == -(-n // rows)
    assert 0 < work <= budget


def test_work_space_follows_the_budget_not_the_cap() -> None:
    """A small batch on the CPU uses far less than the 32 MiB default budget, and the report says so."""
    work, rows = PNPLoss("Dq").work_space(64, 128, 4, "cpu")
    assert rows == 64 and work < 2**20


def test_no_row_is_padded_past_half_again_its_own_class_by_the_real_plan() -> None:
    """With a loss's own row costs on CPU (its ``[P, N]`` passes walk sub-blocks, so a row's budget leaves them
    out and a chunk holds hundreds of rows), the chunk at the seam of classes of 4 and one of 256 held 366 rows of
    4 padded to 256: PNP took 2.1x the time of uniform classes with as many positive pairs."""
    sizes = [4] * (N - 256) + [256] * 256
    for loss in (PNPLoss("Dq"), SmoothAPLoss(), FastAPLoss()):
        row_bytes, budget, _ = loss._plan(N, torch.float32, torch.device("cpu"), False)
        chunks = plan_chunks(sizes, row_bytes, budget, torch.device("cpu"))
        for start, stop, width in chunks:
            assert width <= 1.5 * sizes[start], (type(loss).__name__, start, stop, width)
        assert [(a, b) for a, b, _ in chunks] == sorted((a, b) for a, b, _ in chunks)
        assert chunks[-1][1] == N and all(b == c for (_, b, _), (c, _, _) in itertools.pairwise(chunks))
    growing = list(range(1, 200))  # classes of every size: bands of half again the first
    chunks = plan_chunks(growing, lambda width: width, 10**9, torch.device("cpu"))
    assert [(a, b) for a, b, _ in chunks][:4] == [(0, 1), (1, 3), (3, 6), (6, 10)]
    assert len(chunks) < 20
