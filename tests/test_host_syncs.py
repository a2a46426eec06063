"""The host-read counter (``benchmarks/acceptance/host_syncs.py``, which the tests and the acceptance harness
share) sees every way a value reaches the host, once each, in the calling thread only, a custom backward's too, and names the place."""

from __future__ import annotations

import threading

import torch

from benchmarks.acceptance.host_syncs import count_host_syncs


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad.sum().item()  # the autograd engine runs this without the caller's function modes
        return grad


def test_every_kind_of_host_read_is_counted_once() -> None:
    t = torch.tensor([0.5, -1.0, 2.0])
    leaf = torch.ones(3, requires_grad=True)
    with count_host_syncs() as syncs:
        t[0].item()
        bool(t[0] > 0)
        int(t[0])
        float(t[0])
        t.tolist()
        t.cpu()
        t.numpy()
        t.nonzero()
        t[t > 0]
        t[t > 5] = 0.0
        torch.tensor(1.0, device="cpu")
        torch.as_tensor([1.0], device="cpu")
        t.to("cpu")
        torch.where(t > 0)
        repr(t)
        [0, 1][t.long()[0]]
        _ReadsInBackward.apply(leaf).sum().backward()
    expected = {"item": 2, "bool": 1, "int": 1, "float": 1, "tolist": 1, "cpu": 2, "numpy": 1, "nonzero": 2,
                "bool_index": 2, "tensor_from_host": 2, "format": 1, "index": 1}  # fmt: skip
    assert dict(syncs.by_kind()) == expected, syncs.report()
    assert syncs.places().most_common(1)[0][0].startswith("tests/test_host_syncs.py:")
    assert any("backward" in place for place in syncs.places()), "the custom backward's read"


def test_what_reads_nothing_is_not_counted_nor_another_threads_reads() -> None:
    t = torch.randn(4, 4)
    run_device = torch.device("cpu")
    with count_host_syncs() as syncs:
        (t @ t).relu().sum(dim=0).mul_(1 / 255)
        t.to(run_device)  # the run's device held in a variable: no move on a CPU-only run
        t.to(torch.float64)
        torch.tensor([1.0, 2.0])  # built on the host, for the host
        torch.where(t > 0, t, 0.0)
        t[t.argmax(dim=1)]  # an index tensor: no size to learn
        reader = threading.Thread(target=lambda: torch.randn(1).item())
        reader.start()
        reader.join()
    assert syncs.total == 0, syncs.report()
