"""The losses' block passes compiled for the CPU that runs them (``cpu_kernels.c``), and where they may run.

On one CPU thread at N = 8,192 the torch path's passes after the similarity matmul took a quarter of the loss's
time: FastAP's cumulative histograms make three passes over a ``[rows, num_bins, N]`` buffer and its bin
gradient eight over ``[rows, N]``; PNP's and Smooth-AP's sigmoid ranks build ``[rows, P, N]`` and make six
passes over it, one sigmoid per (query, positive, column). Each C function here makes one pass over a row: the
histograms skip the bins a tile of columns does not reach, and the ranks take one exponential per column for
all of a row's positives (``rank_tile`` in the C file says how, and within what bound of the sigmoid). They
take the same inputs and give the same values as the torch path: the bin gradient bit for bit, the sums
rounded in another order.

They are built on first use with the C compiler found (``$CC``, else ``cc``, ``gcc`` or ``clang``), for this
CPU (``-march=native``), into a cache shared by the processes of a machine: ``$DDP_RANK_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/ddp_rank/kernels`` or ``~/.cache/ddp_rank/kernels``. A build takes under a second; the file is
named by a digest of the source, the compiler, the flags and the CPU's features, so a change of any of them
builds anew, and it is written under a temporary name and renamed, so that ranks building at once never load
half a file. Without a compiler, or where the build fails, the torch path runs (``kernel="auto"`` says so once
in the log). Calls release the GIL (ctypes), so FastAP's passes split a block's rows over
``torch.get_num_threads()`` Python threads; the rank passes run in the calling thread, and the rank losses take
them on one thread only (``sigmoid_ranks.SigmoidRankLoss.takes_native_passes``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "c_compiler",
    "kernel_cache_dir",
    "native_bin_gradient",
    "native_cumulative_histograms",
    "native_kernels_run",
    "native_sigmoid_rank_gradient",
    "native_sigmoid_rank_sums",
]

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -march=native first; a compiler that does not know it (some clang targets) builds for the baseline instead.
# -ffp-contract=fast lets a multiply and an add become one FMA (ISO C mode would keep them apart): the
# exponential's polynomial and the gradient's sums are the passes' arithmetic.
FLAG_SETS = (
    ("-O3", "-march=native", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC"),
    ("-O3", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC"),
)
BUILD_TIMEOUT_S = 120
# Below this many elements a block is not split over threads: a thread's start costs more than its share.
MIN_ELEMENTS_PER_THREAD = 1 << 16

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
_SIGNATURES = {
    "cumulative_histograms_f32": (_ptr, _i64, _i64, _i64, _i32, _ptr),
    "bin_gradient_f32": (_ptr, _i64, _i64, _i64, _ptr, _i32, _ptr, _i64),
    "sigmoid_rank_sums_f32": (_ptr, _i64, _i64, _i64, _ptr, _i32, _ptr, _ptr, _ptr),
    "sigmoid_rank_gradient_f32": (_ptr, _ptr, _i64, _i64, _i32, _ptr, _i64),
}


def native_kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled passes run for blocks of ``dtype`` on ``device``: float32 on CPU, where they
    build. Asked once per loss call, so that every chunk takes the same path."""
    return device.type == "cpu" and dtype == torch.float32 and library() is not None


def native_cumulative_histograms(t: Tensor, num_bins: int) -> Tensor:
    """``[c, num_bins + 1]``: ``H[r, l] = sum_j clamp(l + 1 - t[r, j], 0, 1)`` (``histogram.cumulative_histograms``)."""
    _check_rows(t)
    out = torch.empty(t.shape[0], num_bins + 1, dtype=torch.float32)
    lib = _required()

    def run(rows: slice) -> None:
        block = t[rows]
        lib.cumulative_histograms_f32(
            block.data_ptr(), block.shape[0], block.shape[1], block.stride(0), num_bins, out[rows].data_ptr()
        )

    _over_threads(run, t.shape[0], _thread_count(*t.shape))
    return out


def native_bin_gradient(t: Tensor, slopes: Tensor, out: Tensor) -> Tensor:
    """``out[r, j] = slopes[r, min(floor(t[r, j]), num_bins - 1)]`` where ``0 <= t[r, j] <= num_bins``, else 0
    (``histogram.bin_gradient``); ``out`` may be ``t`` itself. Returns ``out``."""
    _check_rows(t, out)
    _check_shape("out", out, tuple(t.shape))
    slopes = slopes.to(torch.float32).contiguous()
    _check_shape("slopes", slopes, (t.shape[0], slopes.shape[-1]))
    num_bins = slopes.shape[1]
    lib = _required()

    def run(rows: slice) -> None:
        block, into = t[rows], out[rows]
        lib.bin_gradient_f32(
            block.data_ptr(),
            block.shape[0],
            block.shape[1],
            block.stride(0),
            slopes[rows].data_ptr(),
            num_bins,
            into.data_ptr(),
            into.stride(0),
        )

    _over_threads(run, t.shape[0], _thread_count(*t.shape))
    return out


def native_sigmoid_rank_sums(
    scores: Tensor, same_scores: Tensor, dsigma: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(R, slope_sums)``, both ``[c, P]``: ``R[r, i] = sum_j sigmoid(scores[r, j] - same_scores[r, i])`` and
    the sums of ``s (1 - s)``, for ``scores [c, N]`` whose same-class columns hold -inf
    (``sigmoid_ranks.NegativeRanks``); with ``dsigma`` (``[c, P, N]``, contiguous), each ``s (1 - s)`` too.
    In the calling thread."""
    _check_rows(scores)
    n_rows, n_cols = scores.shape
    same = same_scores.to(torch.float32).contiguous()
    _check_shape("same_scores", same, (n_rows, same.shape[-1]))
    p = same.shape[1]
    if dsigma is not None and (
        dsigma.shape != (n_rows, p, n_cols)
        or not dsigma.is_contiguous()
        or dsigma.dtype != torch.float32
        or dsigma.device.type != "cpu"
    ):
        raise ValueError(f"dsigma must be a contiguous float32 [{n_rows}, {p}, {n_cols}] tensor")
    ranks, slope_sums = (
        torch.empty(n_rows, p, dtype=torch.float32),
        torch.empty(n_rows, p, dtype=torch.float32),
    )
    lib = _required()

    lib.sigmoid_rank_sums_f32(
        scores.data_ptr(),
        n_rows,
        n_cols,
        scores.stride(0),
        same.data_ptr(),
        p,
        ranks.data_ptr(),
        slope_sums.data_ptr(),
        None if dsigma is None else dsigma.data_ptr(),
    )
    return ranks, slope_sums


def native_sigmoid_rank_gradient(dsigma: Tensor, weights: Tensor, out: Tensor) -> Tensor:
    """``out[r, j] = sum_i weights[r, i] dsigma[r, i, j]`` (``dsigma [c, P, N]`` contiguous, ``weights [c, P]``);
    ``out`` may be the scores the ranks were taken from. In the calling thread. Returns ``out``."""
    _check_rows(out)
    n_rows, p, n_cols = dsigma.shape
    if dsigma.device.type != "cpu" or not dsigma.is_contiguous() or dsigma.dtype != torch.float32:
        raise ValueError("dsigma must be a contiguous float32 [c, P, N] CPU tensor")
    _check_shape("out", out, (n_rows, n_cols))
    w = weights.to(torch.float32).contiguous()
    _check_shape("weights", w, (n_rows, p))
    lib = _required()

    lib.sigmoid_rank_gradient_f32(
        dsigma.data_ptr(), w.data_ptr(), n_rows, n_cols, p, out.data_ptr(), out.stride(0)
    )
    return out


def kernel_cache_dir() -> Path:
    """Where built kernels are kept: ``$DDP_RANK_KERNEL_CACHE``, else the user's cache folder."""
    explicit = os.environ.get("DDP_RANK_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddp_rank" / "kernels"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled passes, built or found in the cache once per process; None where they cannot be built
    (the reason is logged once)."""
    try:
        path = _built_library()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _log.info("loss: the passes compiled for the CPU are not available (%s); the torch path runs", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    return lib


def _built_library() -> Path:
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[:1]
    source = SOURCE.read_bytes()
    cache = kernel_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in FLAG_SETS:
        identity = repr((compiler, version, flags, platform.machine(), _cpu_features())).encode()
        digest = hashlib.sha256(source + identity).hexdigest()[:24]
        path = cache / f"cpu_kernels-{digest}.so"
        if path.exists():
            return path
        fd, partial = tempfile.mkstemp(prefix=path.stem + ".", suffix=".partial", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *flags, "-o", partial, str(SOURCE)],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            if done.returncode == 0:
                os.replace(partial, path)
                return path
            last_line = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            errors.append(f"{' '.join(flags)}: {last_line}")
        finally:
            Path(partial).unlink(missing_ok=True)
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {'; '.join(errors)}")


def c_compiler() -> str | None:
    """The C compiler the passes are built with: ``$CC``, else the first of ``cc``, ``gcc`` and ``clang`` on the
    PATH; None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_features() -> str:
    """What ``-march=native`` builds for: the CPU's model and feature flags (Linux), else the processor."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(
            "the passes compiled for the CPU are not available: take the torch path (kernel='torch')"
        )
    return lib


def _check_rows(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(
                "the compiled CPU passes take float32 [rows, columns] CPU tensors with contiguous rows, got "
                f"{t.dtype} on {t.device} of shape {tuple(t.shape)} and strides {t.stride()}"
            )


def _check_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    """The C passes trust their row and column counts: a tensor of another shape, or not on the CPU, is refused
    here."""
    if tuple(t.shape) != shape or t.device.type != "cpu":
        raise ValueError(
            f"{name} must be a CPU tensor of shape {shape} for these rows, got {tuple(t.shape)} on {t.device}"
        )


def _thread_count(n_rows: int, row_elements: int) -> int:
    """Threads a pass over ``n_rows`` rows of ``row_elements`` each takes: ``torch.get_num_threads()``, fewer
    where a thread's share would be under ``MIN_ELEMENTS_PER_THREAD``."""
    return max(1, min(torch.get_num_threads(), n_rows, (n_rows * row_elements) // MIN_ELEMENTS_PER_THREAD))


def _over_threads(run: Callable[[slice], None], n_rows: int, threads: int) -> None:
    """``run(rows)`` over ``n_rows`` rows split into ``threads`` ranges, the last in the calling thread (the
    compiled passes release the GIL); the first error raised is raised here, after every range ended."""
    step = -(-n_rows // max(1, threads))
    ranges = [slice(start, min(n_rows, start + step)) for start in range(0, n_rows, step)]
    if len(ranges) <= 1:
        run(slice(0, n_rows))
        return
    pool = _pool(len(ranges) - 1, os.getpid())
    futures = [pool.submit(run, rows) for rows in ranges[:-1]]
    try:
        run(ranges[-1])
    finally:
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()


@functools.cache
def _pool(threads: int, pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool per thread count and process (a forked child never uses its parent's threads)."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ddp_rank-cpu-pass")
