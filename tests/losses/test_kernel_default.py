"""``kernel="auto"``, the losses' default: the fused Triton kernels on CUDA float32 blocks (bf16 and fp16 inputs
are computed in float32) when Triton imports, the torch path elsewhere, said once in the log.

And what had to hold before it became the default: the kernels against the torch path and a float64 reference
across many chunks, with a class wider than one tile of 32 same-class columns (N = 65,536 on a GPU; on CPU, in
Triton's interpreter, the same structure at N = 96, as the interpreter takes seconds per call at N = 160 on the
2-core test machine), bit-identical repeats under deterministic algorithms, and the torch path where Triton
does not import.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator

import pytest
import torch

import ddp_rank.losses.base as base
from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss, cpu_kernels
from ddp_rank.losses.rows import compute_dtype
from ddp_rank.losses.triton_kernels import jit_kernels

LOSSES = (FastAPLoss, PNPLoss, SmoothAPLoss)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
LOSS_RTOL, GRAD_RTOL = (
    1e-5,
    1e-3,
)  # benchmarks/acceptance/gpu_targets.py's TRITON_LOSS_RTOL and TRITON_GRAD_RTOL


@pytest.fixture
def without_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import triton`` fails, as where it is not installed; the kernels are looked up afresh, and again
    after the test (the monkeypatch is undone after this fixture's teardown, before any later lookup)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    jit_kernels.cache_clear()
    yield
    jit_kernels.cache_clear()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def auto(self) -> list[str]:
        return [m for m in self.messages if "kernel=auto" in m]


@pytest.fixture
def kernel_log() -> Iterator[_Records]:
    """The losses' records, whatever the ``ddp_rank`` logger's propagation (a run's logging turns it off), with
    the once-per-process memory of what was said cleared before and after."""
    logger, records = logging.getLogger(base.__name__), _Records()
    level = logger.level
    base._log_auto_kernel.cache_clear()
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(records)
    logger.setLevel(level)
    base._log_auto_kernel.cache_clear()


@pytest.mark.parametrize("make", LOSSES)
def test_auto_is_the_default_and_takes_triton_on_cuda_float32_blocks_only(
    make: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv(
        "TRITON_INTERPRET", "1"
    )  # the interpreter would run the kernels on CPU: auto never asks it
    monkeypatch.setattr(base, "cuda_below_triton", lambda device: None)  # a GPU Triton compiles for
    auto, triton, plain = make(), make(kernel="triton"), make(kernel="torch")
    assert auto.kernel == "auto"
    for inputs in (torch.float32, torch.bfloat16, torch.float16):
        assert auto.takes_fused_kernels(CUDA, compute_dtype(inputs), log=False), inputs
    assert not auto.takes_fused_kernels(CUDA, compute_dtype(torch.float64), log=False)
    assert not auto.takes_fused_kernels(CPU, torch.float32, log=False)
    assert triton.takes_fused_kernels(CPU, torch.float32, log=False)  # an explicit "triton" runs interpreted
    assert not plain.takes_fused_kernels(CUDA, torch.float32, log=False)
    # The chunk plan follows: auto plans a CUDA batch as the fused path does, a CPU one as the torch path.
    for dtype in (torch.float32, torch.bfloat16):
        assert auto.work_space(4096, 4096, 40, CUDA, dtype) == triton.work_space(4096, 4096, 40, CUDA, dtype)
        assert auto.work_space(4096, 4096, 40, CUDA, dtype) != plain.work_space(4096, 4096, 40, CUDA, dtype)
    assert auto.work_space(4096, 4096, 40, CPU) == plain.work_space(4096, 4096, 40, CPU)


@pytest.mark.parametrize(
    ("hip", "capability", "why"),
    [(None, (6, 0), "compute capability 6.0 is below Triton's 7.0"), ("6.2", (9, 0), "ROCm (HIP 6.2)")],
)
def test_auto_takes_the_torch_path_on_a_gpu_triton_does_not_compile_for(
    hip: str | None,
    capability: tuple[int, int],
    why: str,
    monkeypatch: pytest.MonkeyPatch,
    kernel_log: _Records,
) -> None:
    """A P100 (Kaggle's default) or a GTX 10xx: Triton refuses them, so ``auto`` must not pick the fused kernels
    there (an explicit ``kernel="triton"`` is the user's own call); ROCm: never run, so not by default."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert base.cuda_below_triton(CUDA) is not None
    assert not FastAPLoss().takes_fused_kernels(CUDA, torch.float32)
    assert FastAPLoss(kernel="triton").takes_fused_kernels(CUDA, torch.float32, log=False)
    (said,) = kernel_log.auto()
    assert said.startswith("loss kernel=auto: the torch path on cuda, as ") and why in said
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert base.cuda_below_triton(CUDA) is None


@pytest.mark.parametrize("make", LOSSES)
def test_without_triton_auto_takes_the_torch_path_quietly(
    make: type, without_triton: None, kernel_log: _Records
) -> None:
    assert jit_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto does not warn: it is not a misuse
        auto = make()
    assert not auto.takes_fused_kernels(CUDA, torch.float32)
    assert not auto.takes_fused_kernels(CUDA, torch.float32)
    assert kernel_log.auto() == [
        "loss kernel=auto: the torch path on cuda, as Triton does not import (pip install triton for the fused "
        "kernels, about 2x faster at N = 65,536)"
    ]
    with pytest.warns(UserWarning, match="needs Triton, which is not installed"):
        make(kernel="triton")
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(40, 8, generator=g), torch.arange(40) // 4
    assert make()(x, labels).item() == make(kernel="torch")(x, labels).item()


def test_auto_says_once_per_device_and_dtype_which_path_it_took(
    kernel_log: _Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the rank losses' compiled passes: one thread
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(40, 8, generator=g), torch.arange(40) // 4
    for loss in (PNPLoss(), PNPLoss(), FastAPLoss()):
        for _ in range(2):
            loss(x.clone().requires_grad_(), labels).backward()
    compiled = (
        cpu_kernels.library() is not None
    )  # no C compiler: the torch path (tests/losses/test_cpu_kernels.py)
    assert kernel_log.auto() == [
        "loss kernel=auto: the passes compiled for this CPU for float32 blocks"
        if compiled
        else "loss kernel=auto: the torch path for float32 blocks on cpu (the fused Triton kernels take float32 on CUDA)"
    ]
    PNPLoss()(x.double(), labels)  # the compiled passes take float32 only
    assert len(kernel_log.auto()) == 2 and "float64 blocks on cpu" in kernel_log.auto()[1]
    kernel_log.messages.clear()
    PNPLoss(kernel="torch")(x.half(), labels)
    assert kernel_log.auto() == []


CHILD = textwrap.dedent(
    """
    import json, os, warnings
    os.environ["TRITON_INTERPRET"] = "1"
    warnings.filterwarnings("ignore", "overflow encountered in exp")  # exp(inf) of masked columns: exact 0
    import torch
    from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss
    from ddp_rank.runtime.determinism import set_deterministic

    set_deterministic(True)
    n = 96
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) // 4
    labels[:40] = -1  # a class of 40: two tiles of 32 same-class columns
    labels = labels[torch.randperm(n, generator=g)]
    x = torch.randn(n, 16, generator=g)

    def run(make, kernel, dtype=torch.float32):
        e = x.to(dtype, copy=True).requires_grad_()
        loss = make(kernel=kernel, chunk_rows=12)(e, labels)  # 8 chunks, the wide class across several
        loss.backward()
        return loss.item(), e.grad.double()

    out = {}
    for make in (FastAPLoss, PNPLoss, SmoothAPLoss):
        fused, plain, exact = run(make, "triton"), run(make, "torch"), run(make, "torch", torch.float64)
        name = make.__name__
        out[name] = {
            "loss_vs_float64": abs(fused[0] - exact[0]) / abs(exact[0]),
            "grad_vs_float64": float((fused[1] - exact[1]).abs().max() / exact[1].abs().max()),
            "grad_vs_torch": float((fused[1] - plain[1]).abs().max() / plain[1].abs().max()),
            "torch_grad_vs_float64": float((plain[1] - exact[1]).abs().max() / exact[1].abs().max()),
        }
        if make is not SmoothAPLoss:  # FastAP's two kernels and the two rank kernels Smooth-AP shares
            again = run(make, "triton")
            out[name]["bitwise_repeat"] = again[0] == fused[0] and bool(torch.equal(again[1], fused[1]))
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_the_fused_kernels_across_chunks_and_tiles_match_float64_and_repeat_bitwise() -> None:
    """The structure of the N = 65,536 CUDA test below at a size Triton's interpreter runs on CPU."""
    pytest.importorskip("triton")
    # One torch thread: the blocks are tiny, and two threads on a busy 2-core machine spin for each matmul.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name, found in out.items():
        assert found["loss_vs_float64"] <= LOSS_RTOL, (name, found)
        # As close to float64 as the float32 torch path is (both round the same sums in another order).
        assert found["grad_vs_float64"] <= max(GRAD_RTOL / 10, 2 * found["torch_grad_vs_float64"]), (
            name,
            found,
        )
        assert found["grad_vs_torch"] <= GRAD_RTOL, (name, found)
        assert found.get("bitwise_repeat", True), (name, found)
    assert sum("bitwise_repeat" in found for found in out.values()) == 2


def _big_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """N rows in classes of 8, one of 300 (ten tiles of same-class columns), shuffled."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) // 8
    labels[:300] = -1
    labels = labels[torch.randperm(n, generator=g)]
    return torch.randn(n, 64, generator=g), labels


@pytest.mark.cuda
@pytest.mark.parametrize("make", LOSSES)
def test_auto_on_cuda_at_65536_rows_matches_the_torch_path_and_float64(make: type) -> None:
    """The loss against float64; the gradient against the float32 torch path on the same inputs, and against
    float64 for the smooth rank losses. FastAP's gradient is piecewise constant in the distances: float64
    distances put a few thousand of the 4.3e9 positions in the neighbouring bin, which moves the gradient more
    than rounding, on either path."""
    pytest.importorskip("triton")
    x, labels = _big_batch(65_536)
    auto = make(memory_budget=256 * 2**20)  # about 100 chunks
    assert auto.takes_fused_kernels(CUDA, torch.float32, log=False)
    results = []
    for loss, dtype in (
        (auto, torch.float32),
        (make(kernel="torch"), torch.float32),
        (make(), torch.float64),
    ):
        e = x.cuda().to(dtype).requires_grad_()
        value = loss(e, labels.cuda())
        value.backward()
        results.append((value.item(), e.grad.double().cpu()))
    (loss_f, grad_f), (_, grad_t), (loss_x, grad_x) = results

    def off(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    assert abs(loss_f - loss_x) <= LOSS_RTOL * abs(loss_x)
    assert off(grad_f, grad_t) <= GRAD_RTOL
    if make is not FastAPLoss:
        assert off(grad_f, grad_x) <= GRAD_RTOL


@pytest.mark.cuda
@pytest.mark.parametrize("make", LOSSES)
def test_auto_on_cuda_repeats_bitwise_under_deterministic_algorithms(
    make: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    from ddp_rank.runtime.determinism import CUBLAS_WORKSPACE

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    x, labels = _big_batch(65_536, seed=1)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(2):
            e = x.cuda().requires_grad_()
            value = make(memory_budget=256 * 2**20)(e, labels.cuda())
            value.backward()
            results.append((value.item(), e.grad.cpu()))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.cuda
def test_without_triton_auto_runs_the_torch_path_on_cuda(without_triton: None) -> None:
    x, labels = _big_batch(4096)
    results = []
    for kernel in ("auto", "torch"):
        e = x.cuda().requires_grad_()
        value = PNPLoss(kernel=kernel)(e, labels.cuda())
        value.backward()
        results.append((value.item(), e.grad.cpu()))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
