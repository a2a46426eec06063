"""The losses' two kernel paths: the torch paths against their definitions, the fused Triton kernels (run by
Triton's interpreter on CPU, in a child process that sets TRITON_INTERPRET before importing Triton) against the
torch paths, every loss through either, and the kernels compiled for real GPUs without one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss
from ddp_rank.losses.base import SAME_CLASS_BYTES
from ddp_rank.losses.histogram import bin_gradient, cumulative_histograms
from ddp_rank.losses.rows import Workspace
from ddp_rank.losses.sigmoid_ranks import NegativeRanks
from ddp_rank.losses.triton_kernels import fused_cumulative_histograms, fused_kernels_run

LOSSES = (FastAPLoss, PNPLoss, SmoothAPLoss)


def histogram_definition(t: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Per item, the triangular kernel's weights on every bin centre, summed over items, then cumulated."""
    centres = torch.arange(num_bins + 1, dtype=torch.float64)
    weights = (1 - (t.double()[..., None] - centres).abs()).clamp(min=0)  # [c, N, L]
    return weights.sum(1).cumsum(1)


@pytest.mark.parametrize("num_bins", [1, 10, 15])
def test_the_torch_histograms_are_the_definition(num_bins: int) -> None:
    g = torch.Generator().manual_seed(num_bins)
    t = torch.rand(7, 333, generator=g, dtype=torch.float64) * num_bins
    t[:, :4] = torch.tensor([0.0, 1.0, float(num_bins), num_bins / 2.0], dtype=torch.float64)  # on centres
    t[:, 4:6] = torch.tensor([-1e-3, num_bins + 1e-3], dtype=torch.float64)  # a hair outside: clamped
    got = cumulative_histograms(t, num_bins, Workspace(t.device))
    expected = histogram_definition(t.clamp(0, num_bins), num_bins)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_the_torch_bin_gradient_reads_each_lower_bin_and_is_zero_outside() -> None:
    g = torch.Generator().manual_seed(2)
    num_bins = 10
    slopes = torch.randn(3, num_bins, generator=g, dtype=torch.float64)
    outside = [-1e-3, 10.001, 10.999, 11.0, 11.5, 1e6, -7.0]
    t = torch.tensor([[0.0, 0.5, 1.0, 9.99, 10.0, *outside]] * 3, dtype=torch.float64)
    for in_place in (False, True):  # into a buffer, or over the positions themselves
        positions = t.clone()
        out = positions if in_place else torch.empty_like(t)
        got = bin_gradient(positions, slopes, out, Workspace(t.device))
        lower = torch.tensor([0, 0, 1, 9, 9])
        torch.testing.assert_close(got[:, :5], slopes[:, lower], rtol=0, atol=0)
        assert torch.equal(got[:, 5:], torch.zeros(3, len(outside), dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_bins", [1, 2, 10])
def test_the_torch_bin_gradient_tells_every_edge_from_its_neighbours(
    dtype: torch.dtype, num_bins: int
) -> None:
    """Each edge ``l`` exactly and the nearest representable positions on either side of it, against the lower bin
    found by comparisons: the key ``floor(t) + ceil(t)`` must tell ``t = l`` from ``(l - 1, l)`` and from ``(l, l +
    1)``, and ``t = num_bins`` (the last slope) from a hair above it (0), with sub-blocks of a few rows."""
    edges = torch.arange(-1, num_bins + 2, dtype=dtype)
    t_row = torch.cat([
        torch.nextafter(edges, edges - 1), edges, torch.nextafter(edges, edges + 1), edges + 0.5
    ])  # fmt: skip
    t = t_row.repeat(5, 1)
    slopes = torch.randn(5, num_bins, generator=torch.Generator().manual_seed(num_bins), dtype=dtype)
    inside = (t >= 0) & (t <= num_bins)
    lower = t.floor().clamp(0, num_bins - 1).long()
    expected = torch.where(inside, slopes.gather(1, lower), torch.zeros_like(t))
    workspace = Workspace(t.device, pass_bytes=2 * t.shape[1] * 40)  # sub-blocks of two rows
    got = bin_gradient(t.clone(), slopes, torch.empty_like(t), workspace)
    assert torch.equal(got, expected)


def test_the_torch_sigmoid_ranks_are_the_definition() -> None:
    """R and the scores' gradient of ``sum_ai w_ai f(R_ai)`` against autograd through a dense mask."""
    g = torch.Generator().manual_seed(1)
    c, n, p = 5, 40, 3
    scores = torch.randn(c, n, generator=g, dtype=torch.float64) * 3
    index = torch.stack([torch.randperm(n, generator=g)[:p] for _ in range(c)])
    weights = torch.randn(c, p, generator=g, dtype=torch.float64)

    leaf = scores.clone().requires_grad_()
    negative = torch.ones(c, n, dtype=torch.bool).scatter_(1, index, False)
    sigma = torch.sigmoid(leaf[:, None, :] - leaf.gather(1, index)[:, :, None]) * negative[:, None, :]
    ranks = sigma.sum(2)
    (ranks.square() * weights).sum().backward()

    got = NegativeRanks(
        scores.clone(), index, Workspace(scores.device), dloss_dranks=lambda r, rows: 2 * r * weights[rows]
    )
    torch.testing.assert_close(got.values, ranks.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.gradient, leaf.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss", LOSSES)
def test_bad_kernel_names_and_where_triton_runs(loss: type) -> None:
    with pytest.raises(ValueError, match="kernel must be one of auto, torch, triton, got 'cuda'"):
        loss(kernel="cuda")
    cpu = torch.device("cpu")
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not fused_kernels_run(cpu, torch.float32)  # CPU tensors take the torch path
    assert not fused_kernels_run(cpu, torch.float64)


def test_the_kernels_refuse_blocks_they_cannot_read() -> None:
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=r"float32 .* contiguous rows, got torch.float32 of shape \(2, 3\)"):
        fused_cumulative_histograms(torch.zeros(3, 2).T, 10)
    with pytest.raises(ValueError, match=r"got torch\.float64"):
        fused_cumulative_histograms(torch.zeros(2, 3, dtype=torch.float64), 10)


@pytest.mark.parametrize("make", LOSSES)
def test_the_fused_path_plans_larger_chunks(make: type) -> None:
    """Without the ``[c, P, N]`` sigmoids (and FastAP's int64 bins), a row costs less work space, so the same
    budget holds more rows; the plan follows the path the chunks take (checked under the interpreter below)."""
    loss = make()
    for width in (1, 4, 64):
        fused = loss._bytes_per_query_row(65_536, width, 4, True)
        plain = loss._bytes_per_query_row(65_536, width, 4, False)
        # One same-class column: the torch path's [1, N] sigmoids take the room of the fused path's G buffer.
        assert fused < plain or (width == 1 and make is not FastAPLoss and fused == plain)
        assert fused <= 2 * 65_536 * 4 + width * (2 * 11 * 4 + 2 * width * 4 + SAME_CLASS_BYTES)


def test_asking_for_triton_without_triton_warns_and_takes_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ddp_rank.losses.base as base
    import ddp_rank.losses.triton_kernels as triton_kernels

    monkeypatch.setenv(
        "TRITON_INTERPRET", "1"
    )  # CPU tensors would take the fused kernels if Triton were there
    monkeypatch.setattr(base, "jit_kernels", lambda: None)
    monkeypatch.setattr(triton_kernels, "jit_kernels", lambda: None)
    with pytest.warns(UserWarning, match="needs Triton, which is not installed: the torch path runs"):
        loss = PNPLoss(kernel="triton")
    assert not fused_kernels_run(torch.device("cpu"), torch.float32)
    x, labels = torch.randn(8, 4), torch.arange(8) // 2
    assert loss(x, labels).item() == PNPLoss()(x, labels).item()


CHILD = textwrap.dedent(
    """
    import json, os, warnings
    os.environ["TRITON_INTERPRET"] = "1"
    warnings.filterwarnings("ignore", "overflow encountered in exp")  # exp(inf) of masked columns: exact 0
    import torch
    from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss
    from ddp_rank.losses.histogram import bin_gradient, cumulative_histograms
    from ddp_rank.losses.rows import Workspace
    from ddp_rank.losses.sigmoid_ranks import NegativeRanks
    import ddp_rank.losses.base as base
    from ddp_rank.losses.triton_kernels import fused_kernels_run

    def relative(a, b):
        return float((a - b).abs().max() / b.abs().max())

    out = {}
    g = torch.Generator().manual_seed(0)
    # The interpreter runs one program per row, which its cost follows: three rows read at three row offsets.
    # Columns: several tiles and a partial one of the histograms' 256 (16 levels), less than one tile.
    for bins, cols in ((10, 1000), (15, 257), (3, 64)):
        t = torch.rand(3, cols, generator=g) * (bins + 0.2) - 0.1  # some a hair outside [0, bins]
        t[:, 0], t[:, 1] = 0.0, float(bins)
        assert fused_kernels_run(t.device, t.dtype)
        fused = cumulative_histograms(t, bins, Workspace(t.device), fused=True)
        plain = cumulative_histograms(t, bins, Workspace(t.device), fused=False)
        out[f"hist-{bins}-{cols}"] = relative(fused, plain)
        slopes = torch.randn(3, bins, generator=g)
        fused = bin_gradient(t, slopes, torch.empty_like(t), Workspace(t.device), fused=True)
        plain = bin_gradient(t, slopes, torch.empty_like(t), Workspace(t.device), fused=False)
        out[f"bins-{bins}-{cols}"] = float((fused - plain).abs().max())  # the same reads: exact

    # Same-class widths below, at and past one tile of 32; row lengths off the tile.
    for width, cols in ((1, 300), (4, 1500), (32, 129), (45, 200)):
        scores = torch.randn(3, cols, generator=g) * 20
        index = torch.stack([torch.randperm(cols, generator=g)[:width] for _ in range(3)])
        weights = torch.randn(3, width, generator=g)
        results = []
        for fused in (False, True):
            ranks = NegativeRanks(
                scores.clone(), index, Workspace(scores.device), fused, lambda r, rows: weights[rows]
            )
            results.append((ranks.values, ranks.gradient))
        out[f"ranks-{width}-{cols}"] = relative(results[1][0], results[0][0])
        out[f"grad-{width}-{cols}"] = relative(results[1][1], results[0][1])

    # The losses under a small budget: the chunk plan and the work space taken are recorded, to see both
    # follow the path. Every row is a query, and each query row is a program (two for the class of 45) in
    # every launch: 96 rows (off every tile) in classes of 1 to 8 and one of 45 give each path chunks of
    # several rows and of a few, most of them cut by the budget (the tiles' loops over many columns are
    # the sections above).
    plan = base.plan_chunks
    planned = []
    base.plan_chunks = lambda *args, **kwargs: planned.append(plan(*args, **kwargs)) or planned[-1]
    take = Workspace.take
    taken = []  # per chunk (each starts with its similarity block): {name: bytes of the view asked for}

    def recording_take(self, name, shape, dtype):
        if name == "block":
            taken.append({})
        view = take(self, name, shape, dtype)
        taken[-1][name] = view.numel() * view.element_size()
        return view

    Workspace.take = recording_take
    x = torch.randn(96, 16, generator=g)
    labels = torch.randint(0, 12, (96,), generator=g)
    labels[:45] = 1000  # one class of 45: two tiles of same-class columns
    for make in (FastAPLoss, PNPLoss, SmoothAPLoss):
        for kernel in ("torch", "triton"):
            e = x.clone().requires_grad_()
            taken.clear()
            loss = make(kernel=kernel, memory_budget=64 * 1024)(e, labels)
            loss.backward()
            names = sorted({name for chunk in taken for name in chunk})
            largest = max(sum(chunk.values()) for chunk in taken)
            out[f"{make.__name__}-{kernel}"] = [loss.item(), e.grad.tolist(), len(planned[-1]), names, largest]
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_the_fused_triton_kernels_match_the_torch_paths() -> None:
    pytest.importorskip("triton")
    # One torch thread: the blocks are tiny, and two threads on a busy 2-core machine spin for each matmul.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for key, error in out.items():
        if key.split("-")[0] in ("hist", "ranks", "grad"):
            assert error <= 1e-5, (key, error)
        if key.startswith("bins-"):
            assert error == 0.0, (key, error)
    for make in LOSSES:
        loss_t, grad_t, chunks_t, names_t, largest_t = out[f"{make.__name__}-torch"]
        loss_f, grad_f, chunks_f, names_f, largest_f = out[f"{make.__name__}-triton"]
        assert chunks_f < chunks_t, (make.__name__, chunks_f, chunks_t)
        # The fused path takes neither the [c, P, N] sigmoids nor FastAP's int64 keys, and on both paths no
        # chunk's buffers pass the 64 KiB budget.
        torch_only = "key64" if make is FastAPLoss else "sigma"
        assert torch_only in names_t and torch_only not in names_f, (make.__name__, names_t, names_f)
        assert largest_t <= 64 * 1024 and largest_f <= 64 * 1024, (make.__name__, largest_t, largest_f)
        assert loss_f == pytest.approx(loss_t, rel=1e-6), make.__name__
        torch.testing.assert_close(torch.tensor(grad_f), torch.tensor(grad_t), rtol=1e-4, atol=1e-7)


# Argument types as the launchers pass them (pointers to float32, 32-bit sizes and strides); the tile sizes
# are those the launchers pick for 1, 4 and 40 same-class columns.
_HISTOGRAM_SIGNATURE = {"t_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32", "row_stride": "i32"}
_RANK_SIGNATURE = {"n_cols": "i32", "n_same": "i32", "row_stride": "i32"}


def _compiled_resources(kernel: object, signature: dict, constants: dict, arch: int) -> tuple[int, int]:
    """Compile one kernel for ``sm_<arch>`` (no GPU needed) and return (registers, local bytes per thread)."""
    import triton
    from triton.backends.compiler import GPUTarget

    source = triton.compiler.ASTSource(
        fn=kernel,
        signature={**signature, **dict.fromkeys(constants, "constexpr")},
        constexprs=constants,
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    # Triton's wheel (pinned in constraints.txt) ships it with ptxas; without it the install is broken.
    assert cuobjdump.exists(), f"{cuobjdump} is missing: reinstall triton (make install)"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp_rank_kernel_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    finally:
        cubin.unlink()
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
    assert found, usage
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("arch", [70, 80, 90, 100])
def test_the_kernels_compile_for_gpus_without_spilling(arch: int) -> None:
    """The interpreter runs Python the compiler may refuse (the first histogram kernel's ``typing.Any``
    annotations passed every interpreter test and failed to compile), so build real cubins for V100, A100, H100 and B200."""
    pytest.importorskip("triton")
    from ddp_rank.losses.triton_kernels import _rank_tiles, jit_kernels

    kernels = jit_kernels()
    assert kernels is not None
    compiled = {
        f"histogram {bins} bins": _compiled_resources(
            kernels.cumulative_histogram_rows,
            _HISTOGRAM_SIGNATURE,
            {"NUM_BINS": bins, "LEVELS": levels, "BLOCK": 4096 // levels},
            arch,
        )
        for bins, levels in ((10, 16), (100, 128))
    }
    compiled["bin gradient"] = _compiled_resources(
        kernels.bin_gradient_rows,
        {"t_ptr": "*fp32", "slopes_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32", "row_stride": "i32"},
        {"NUM_BINS": 10, "BLOCK": 1024},
        arch,
    )
    for width in (1, 4, 40):
        p_tile, block = _rank_tiles(width)
        tiles = {"P_TILE": p_tile, "BLOCK": block}
        compiled[f"rank sums {width}"] = _compiled_resources(
            kernels.sigmoid_rank_sums,
            {
                "scores_ptr": "*fp32",
                "same_ptr": "*fp32",
                "ranks_ptr": "*fp32",
                "slope_sums_ptr": "*fp32",
                **_RANK_SIGNATURE,
            },
            tiles,
            arch,
        )
        compiled[f"rank gradient {width}"] = _compiled_resources(
            kernels.sigmoid_rank_gradient,
            {
                "scores_ptr": "*fp32",
                "same_ptr": "*fp32",
                "weight_ptr": "*fp32",
                "grad_ptr": "*fp32",
                **_RANK_SIGNATURE,
            },
            tiles,
            arch,
        )
    for name, (registers, local_bytes) in compiled.items():
        assert local_bytes == 0, f"{name} spills {local_bytes} bytes per thread to local memory on sm_{arch}"
        assert registers <= 255, (name, registers)


@pytest.mark.cuda
@pytest.mark.parametrize("make", LOSSES)
def test_the_fused_triton_kernels_on_cuda(make: type) -> None:
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    labels = torch.randint(0, 512, (4096,), generator=g)
    labels[:100] = 10_000  # a class past one tile of same-class columns
    results = []
    for kernel in ("torch", "triton"):
        e = x.cuda().requires_grad_()
        loss = make(kernel=kernel)(e, labels.cuda())
        loss.backward()
        results.append((loss.item(), e.grad.cpu()))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name", ["fastap", "pnp", "smoothap"])
def test_the_config_picks_the_kernel_and_the_ranks_need_not_agree_on_it(name: str) -> None:
    """``loss.kernel`` reaches every loss; it changes rounding only, so it stays out of the cross-rank
    signature (ranks of one job may run on different hardware)."""
    from ddp_rank.config import ConfigError, load_config
    from ddp_rank.train.setup import build_loss

    fused = build_loss(load_config(None, [f"loss.name={name}", "loss.kernel=triton"]).loss)
    assert fused.kernel == "triton"
    plain = build_loss(load_config(None, [f"loss.name={name}"]).loss)
    assert plain.kernel == "auto" and plain.signature() == fused.signature()
    assert build_loss(load_config(None, [f"loss.name={name}", "loss.kernel=torch"]).loss).kernel == "torch"
    with pytest.raises(ConfigError, match="kernel"):
        load_config(None, ["loss.kernel=cuda"])
