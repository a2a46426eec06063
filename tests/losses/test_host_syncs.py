"""A loss call reads values on the host a fixed number of times: its input checks, the chunk plan and the count
of valid queries, once per call. Not once per chunk of query rows, nor per block pass (FastAP's torch path
checked ``t.max() > num_bins`` twice a chunk), so that on a GPU the host queues every chunk's kernels without
waiting for the previous ones. Counted on CPU with ``benchmarks/acceptance/host_syncs.py`` (its own test: ``tests/test_host_syncs.py``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.acceptance.host_syncs import HostSyncs, count_host_syncs
from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

LOSSES = (FastAPLoss, PNPLoss, SmoothAPLoss)
# The checks that stay, once per call: finite embeddings, norms that fit, query indices in range, the label
# index's classes, the chunk plan's class sizes, the number of valid queries.
PER_CALL_SYNCS = 6


def _count(make: type, n: int, chunks: int, seed: int = 0) -> HostSyncs:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, n // 8, (n,), generator=g)
    labels[: n // 8] = n  # one class of n / 8: wider than the others, and than one Triton tile past n = 256
    e = torch.randn(n, 16, generator=g).requires_grad_()
    with count_host_syncs() as syncs:
        loss = make(chunk_rows=n // chunks)(e, labels)
        loss.backward()
    assert e.grad is not None and torch.isfinite(e.grad).all()
    return syncs


@pytest.mark.parametrize("make", LOSSES)
def test_a_loss_call_reads_the_host_as_often_at_8_chunks_as_at_2(make: type) -> None:
    two, eight = _count(make, 256, 2), _count(make, 256, 8)
    assert eight.places() == two.places(), f"syncs that grow with the chunks: {eight.places() - two.places()}"
    assert two.total <= PER_CALL_SYNCS, two.report()


@pytest.mark.parametrize("make", LOSSES)
def test_a_loss_call_reads_the_host_as_often_at_any_batch_size(make: type) -> None:
    small, large = _count(make, 128, 4), _count(make, 1024, 4)
    assert large.places() == small.places(), f"syncs that grow with N: {large.places() - small.places()}"


def test_the_counter_sees_the_reads_a_loss_could_make() -> None:
    """Each call below is one synchronisation on a GPU; the counter must see each once (or the tests above
    could pass with reads it misses). The kinds in general: ``tests/test_host_syncs.py``."""
    x = torch.randn(4, 3)
    mask = x > 0
    ways = {
        "if": lambda: 1 if (x > 0).any() else 0,
        "masked_select": lambda: x.masked_select(mask),
        "unique": lambda: torch.unique(x),
        "repeat_interleave": lambda: torch.repeat_interleave(x[0], torch.tensor([1, 2, 1])),
    }
    for name, way in ways.items():
        with count_host_syncs() as syncs:
            way()
        assert syncs.total == 1, (name, syncs.report())
    with count_host_syncs() as syncs:  # device work alone: no read
        y = (x @ x.T).relu_()
        y[torch.arange(2)] = y[:2].flip(0)
        torch.zeros(3, device=x.device).scatter_add_(0, torch.tensor([0, 1]), torch.ones(2))
    assert syncs.total == 0, syncs.report()
