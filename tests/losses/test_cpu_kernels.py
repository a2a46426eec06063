"""The losses' passes compiled for the CPU (``ddp_rank/losses/cpu_kernels.py``) against the torch path and a
float64 definition: FastAP's at the edges of the bins, the sigmoid ranks with masked columns, positives too far
apart to share an exponential and saturated sigmoids, both across tiles and threads; each loss through
``kernel="auto"``; the build's cache, its atomic publication by processes building at once, and the torch path
where no compiler builds them."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss, cpu_kernels
from ddp_rank.losses.base import ListwiseLoss
from ddp_rank.losses.histogram import bin_gradient, cumulative_histograms
from ddp_rank.losses.rows import CPU_PASS_BYTES, Workspace
from ddp_rank.losses.sigmoid_ranks import NegativeRanks

NUM_BINS = 10
# Positions on every edge, just either side of it, outside [0, num_bins] and inside; 2,500 columns: a tile of
# 2,048 and a tail that is not a whole vector.
EDGES = torch.tensor([-3.0, -1e-6, -0.0, 0.0, 1e-6, 1.0, 2.5, 9.0, 9.999999, 10.0, 10.000001, 11.0, 40.0])


@pytest.fixture(scope="module")
def built() -> None:
    """Skipped where no C compiler is installed (the losses then take the torch path, as the last tests here
    check); where one is, a failed build fails."""
    if cpu_kernels.c_compiler() is None:
        pytest.skip(reason="no C compiler on this machine (CC, cc, gcc, clang): the passes cannot be built")
    if cpu_kernels.library() is None:
        pytest.fail("a C compiler is installed but the compiled CPU passes did not build (see the log)")


def _positions(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(rows, cols, generator=g) * 14 - 2
    t[0, : EDGES.numel()] = EDGES
    t[1] = 3.0  # one level only, exactly on an edge
    t[2] = -5.0  # every level saturated: all 1
    t[3] = 12.0  # every level saturated: all 0
    t[4, ::2] = 4.25  # a narrow tile: most levels skipped
    t[4, 1::2] = 4.75
    return t


def _workspace(native: bool) -> Workspace:
    return Workspace(torch.device("cpu"), CPU_PASS_BYTES, native=native)


@pytest.mark.parametrize("cols", [13, 2500, 9000])
def test_histograms_match_the_torch_path_and_float64(built: None, cols: int) -> None:
    t = _positions(9, cols)
    native = cumulative_histograms(t, NUM_BINS, _workspace(True))
    plain = cumulative_histograms(t, NUM_BINS, _workspace(False))
    levels = torch.arange(1, NUM_BINS + 2, dtype=torch.float64)
    clamped = t.double().clamp(0, NUM_BINS)  # the histograms are those of the clamped positions
    exact = (levels[None, :, None] - clamped[:, None, :]).clamp(0, 1).sum(2)
    assert native.shape == (9, NUM_BINS + 1) and native.dtype == torch.float32
    # Each level's float32 sum in tiles of doubles: within a few float32 ulps of the exact sum.
    torch.testing.assert_close(native.double(), exact, rtol=2e-7, atol=0)
    torch.testing.assert_close(native, plain, rtol=2e-6, atol=1e-6)
    assert torch.equal(native[2], torch.full((NUM_BINS + 1,), float(cols)))
    assert torch.equal(native[3, :-1], torch.zeros(NUM_BINS))


@pytest.mark.parametrize("cols", [13, 2500, 9000])
def test_the_bin_gradient_is_the_torch_paths_bit_for_bit_in_place_or_not(built: None, cols: int) -> None:
    t = _positions(9, cols, seed=1)
    slopes = torch.randn(9, NUM_BINS, generator=torch.Generator().manual_seed(2))
    plain = bin_gradient(t, slopes, torch.empty_like(t), _workspace(False))
    native = bin_gradient(t, slopes, torch.empty_like(t), _workspace(True))
    assert torch.equal(native, plain)
    in_place = t.clone()
    assert bin_gradient(in_place, slopes, in_place, _workspace(True)) is in_place
    assert torch.equal(in_place, plain)
    # The edges: bin l on [l, l + 1), the last bin at num_bins exactly, 0 outside [0, num_bins].
    expected = [0.0, 0.0, slopes[0, 0], slopes[0, 0], slopes[0, 0], slopes[0, 1], slopes[0, 2], slopes[0, 9]]
    expected += [slopes[0, 9], slopes[0, 9], 0.0, 0.0, 0.0]
    assert native[0, : EDGES.numel()].tolist() == torch.tensor(expected).tolist()


def test_a_nan_position_reads_no_bin(built: None) -> None:
    """The loss refuses non-finite embeddings before any pass; called directly, a NaN (here first in its tile,
    where it decides the tile's range) reads 0 and no slope from outside the table."""
    t = _positions(6, 2500, seed=7)
    t[:, 0] = math.nan
    t[1, 2048] = math.nan  # first of the second tile
    slopes = torch.randn(6, NUM_BINS, generator=torch.Generator().manual_seed(8))
    native = cpu_kernels.native_bin_gradient(t, slopes, torch.empty_like(t))
    assert native[:, 0].eq(0).all() and native[1, 2048] == 0
    finite = t.isfinite()
    plain = bin_gradient(t.nan_to_num(nan=-1.0), slopes, torch.empty_like(t), _workspace(False))
    assert torch.equal(native[finite], plain[finite])


def test_rows_split_over_threads_give_the_same_bits(built: None) -> None:
    t = _positions(64, 3000, seed=3)
    slopes = torch.randn(64, NUM_BINS, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            results.append(
                (
                    cpu_kernels.native_cumulative_histograms(t, NUM_BINS),
                    cpu_kernels.native_bin_gradient(t, slopes, torch.empty_like(t)),
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _rank_inputs(rows: int, cols: int, p: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``S / tau`` (``scale`` = 1 / tau) and each row's ``p`` same-class columns: the row's own column
    first (its highest score, as a query's similarity to itself is 1), the others anywhere."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.rand(rows, cols, generator=g) * 2 - 1) * scale
    index = torch.stack([torch.randperm(cols, generator=g)[:p] for _ in range(rows)])
    scores.scatter_(1, index[:, :1], scale)
    return scores, index


def _ranks(scores: torch.Tensor, index: torch.Tensor, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, G)`` of ``NegativeRanks`` with ``d(loss)/dR = 1 / (1 + R)`` (PNP-Ds), on a copy of ``scores``."""
    ranks = NegativeRanks(scores.clone(), index, _workspace(native), dloss_dranks=lambda r, rows: 1 / (1 + r))
    assert ranks.gradient is not None
    return ranks.values, ranks.gradient


@pytest.mark.parametrize(
    ("cols", "p", "scale"),
    [(13, 4, 100.0), (2500, 4, 100.0), (4099, 7, 100.0), (2500, 4, 1000.0), (300, 33, 10.0)],
)
def test_sigmoid_ranks_match_the_torch_path_and_float64(built: None, cols: int, p: int, scale: float) -> None:
    """tau = 0.01 (the papers'), tau = 0.001 (positives far apart: several groups sharing an exponential, most
    sigmoids saturated at 0 or 1) and tau = 0.1 with a class wider than a vector of columns."""
    scores, index = _rank_inputs(24, cols, p, scale, seed=cols + p)
    scores[1] = -math.inf  # every column masked or below every positive: exactly 0 from every sigmoid
    scores[1].scatter_(0, index[1], torch.linspace(-scale, scale, p))
    native, native_grad = _ranks(scores, index, native=True)
    plain, plain_grad = _ranks(scores, index, native=False)
    exact, exact_grad = _ranks(scores.double(), index, native=False)
    torch.testing.assert_close(native.double(), exact, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-6)
    scale_grad = exact_grad.abs().max()
    assert (native_grad.double() - exact_grad).abs().max() <= 1e-5 * scale_grad
    assert (native_grad - plain_grad).abs().max() <= 1e-5 * scale_grad
    assert torch.equal(native[1], torch.zeros(p)) and torch.equal(native_grad[1], torch.zeros(cols))


def test_sigmoid_ranks_without_a_gradient(built: None) -> None:
    scores, index = _rank_inputs(40, 3000, 4, 100.0, seed=9)
    alone = NegativeRanks(scores.clone(), index, _workspace(True))
    assert alone.gradient is None
    assert torch.equal(alone.values, _ranks(scores, index, native=True)[0])


def test_the_rank_losses_take_them_on_one_thread_only(built: None) -> None:
    """On the 2-core test machine the compiled rank passes did not scale to two threads and were then slower
    than the torch path; FastAP's gained there too."""
    threads = torch.get_num_threads()
    cpu = torch.device("cpu")
    try:
        torch.set_num_threads(2)
        assert FastAPLoss().takes_native_passes(cpu, torch.float32)
        assert not PNPLoss().takes_native_passes(cpu, torch.float32)
        assert not SmoothAPLoss().takes_native_passes(cpu, torch.float32)
        torch.set_num_threads(1)
        assert all(
            make().takes_native_passes(cpu, torch.float32) for make in (FastAPLoss, PNPLoss, SmoothAPLoss)
        )
    finally:
        torch.set_num_threads(threads)


def test_blocks_the_passes_cannot_read_are_refused(built: None) -> None:
    with pytest.raises(ValueError, match="float32 \\[rows, columns\\] CPU tensors with contiguous rows"):
        cpu_kernels.native_cumulative_histograms(torch.zeros(4, 8, dtype=torch.float64), NUM_BINS)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_kernels.native_cumulative_histograms(torch.zeros(8, 4).T, NUM_BINS)


@pytest.mark.parametrize("make", [FastAPLoss, PNPLoss, SmoothAPLoss])
def test_each_loss_with_auto_takes_them_on_cpu_float32_and_matches_the_torch_path(
    built: None, make: type
) -> None:
    g = torch.Generator().manual_seed(5)
    x, labels = torch.randn(300, 16, generator=g), torch.randint(0, 40, (300,), generator=g)
    auto, plain = make(chunk_rows=64), make(chunk_rows=64, kernel="torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the rank losses take the compiled passes on one thread only
    try:
        _compare_paths(auto, plain, x, labels)
    finally:
        torch.set_num_threads(threads)


def _compare_paths(auto: ListwiseLoss, plain: ListwiseLoss, x: torch.Tensor, labels: torch.Tensor) -> None:
    assert auto.takes_native_passes(torch.device("cpu"), torch.float32)
    assert not auto.takes_native_passes(torch.device("cpu"), torch.float64)
    assert not plain.takes_native_passes(torch.device("cpu"), torch.float32)
    out = []
    for loss, dtype in ((auto, torch.float32), (plain, torch.float32), (plain, torch.float64)):
        e = x.to(dtype, copy=True).requires_grad_()
        value = loss(e, labels)
        value.backward()
        out.append((value.item(), e.grad.double()))
    (native, native_grad), (torch_path, torch_grad), (exact, exact_grad) = out
    assert native == pytest.approx(torch_path, rel=1e-6) and native == pytest.approx(exact, rel=1e-5)
    scale = exact_grad.abs().max()
    # FastAP's gradient is piecewise constant in the positions: the two float32 paths read the same bins, so
    # they agree to rounding; float64 may put a position in the next bin, as it may for the torch path.
    assert (native_grad - torch_grad).abs().max() <= 1e-5 * scale
    assert (native_grad - exact_grad).abs().max() <= 2 * (torch_grad - exact_grad).abs().max() + 1e-6 * scale


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty kernel cache, and the library looked up afresh (and again after the test)."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("DDP_RANK_KERNEL_CACHE", str(cache))
    cpu_kernels.library.cache_clear()
    yield cache
    cpu_kernels.library.cache_clear()


def test_without_a_compiler_fastap_takes_the_torch_path_and_says_why(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(fresh_library))  # no cc, gcc or clang either
    g = torch.Generator().manual_seed(6)
    x, labels = torch.randn(64, 8, generator=g), torch.arange(64) // 4
    logger = logging.getLogger(cpu_kernels.__name__)
    with caplog.at_level(logging.INFO, logger=logger.name), _propagating(logger):
        assert not FastAPLoss().takes_native_passes(torch.device("cpu"), torch.float32)
    assert "no C compiler found (set CC, or install gcc or clang)" in caplog.text
    assert FastAPLoss()(x, labels).item() == FastAPLoss(kernel="torch")(x, labels).item()
    assert not fresh_library.exists() or not any(fresh_library.iterdir())


def test_a_failed_build_leaves_nothing_and_the_torch_path_runs(
    built: None, fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = fresh_library.parent / "broken.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    logger = logging.getLogger(cpu_kernels.__name__)
    with caplog.at_level(logging.INFO, logger=logger.name), _propagating(logger):
        assert cpu_kernels.library() is None
    assert "could not build broken.c" in caplog.text
    assert list(fresh_library.iterdir()) == []  # no partial file


BUILD = textwrap.dedent(
    """
    import torch
    from ddp_rank.losses import cpu_kernels
    t = torch.linspace(-1, 11, 5000).reshape(2, 2500)
    print(cpu_kernels.native_cumulative_histograms(t, 10).sum().item())
    """
)


def test_processes_building_at_once_share_one_library(built: None, tmp_path: Path) -> None:
    """Two processes with an empty cache build at the same moment: each loads a whole library (written under
    a temporary name and renamed), one file stays, and a third process reuses it without building."""
    cache = tmp_path / "kernels"
    env = {**os.environ, "DDP_RANK_KERNEL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    racing = [
        subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in racing]
    assert [process.returncode for process in racing] == [0, 0]
    (library,) = cache.iterdir()
    assert library.suffix == ".so" and library.name.startswith("cpu_kernels-")
    built_at = library.stat().st_mtime_ns
    again = subprocess.run(
        [sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr
    assert outputs[0] == outputs[1] == again.stdout
    assert [p.name for p in cache.iterdir()] == [library.name] and library.stat().st_mtime_ns == built_at


class _propagating:
    """The ``ddp_rank`` loggers propagate to the root (where caplog listens) inside the block."""

    def __init__(self, logger: logging.Logger) -> None:
        self.loggers = [logger, logging.getLogger("ddp_rank")]

    def __enter__(self) -> None:
        self.saved = [lg.propagate for lg in self.loggers]
        for lg in self.loggers:
            lg.propagate = True

    def __exit__(self, *exc: object) -> None:
        for lg, saved in zip(self.loggers, self.saved, strict=True):
            lg.propagate = saved
