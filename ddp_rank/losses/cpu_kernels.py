"""FastAP's block passes compiled for the CPU that runs them (``cpu_kernels.c``), and where they may run.

The torch path's cumulative histograms make three passes over a ``[rows, num_bins, N]`` buffer and its bin
gradient eight over ``[rows, N]``: each a few instructions per element, so on one CPU thread at N = 8,192 they
took a third of the loss's time beside its three matmuls. The C functions make one pass each, skip the bins
a tile of columns does not reach, and take the same inputs and give the same values (the histograms' sums in
another order, the gradient bit for bit).

They are built on first use with the C compiler found (``$CC``, else ``cc``, ``gcc`` or ``clang``), for this
CPU (``-march=native``), into a cache shared by the processes of a machine: ``$DDP_RANK_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/ddp_rank/kernels`` or ``~/.cache/ddp_rank/kernels``. A build takes about a quarter of a
second; the file is named by a digest of the source, the compiler, the flags and the CPU's features, so a
change of any of them builds anew, and it is written under a temporary name and renamed, so that ranks
building at once never load half a file. Without a compiler, or where the build fails, the torch path runs
(``kernel="auto"`` says so once in the log). Calls release the GIL (ctypes), so the rows of a block are
split over ``torch.get_num_threads()`` Python threads.
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

__all__ = ["kernel_cache_dir", "native_bin_gradient", "native_cumulative_histograms", "native_kernels_run"]

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -march=native first; a compiler that does not know it (some clang targets) builds for the baseline instead.
FLAG_SETS = (
    ("-O3", "-march=native", "-std=c11", "-shared", "-fPIC"),
    ("-O3", "-std=c11", "-shared", "-fPIC"),
)
BUILD_TIMEOUT_S = 120
# Below this many elements a block is not split over threads: a thread's start costs more than its share.
MIN_ELEMENTS_PER_THREAD = 1 << 16

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
_SIGNATURES = {
    "cumulative_histograms_f32": (_ptr, _i64, _i64, _i64, _i32, _ptr),
    "bin_gradient_f32": (_ptr, _i64, _i64, _i64, _ptr, _i32, _ptr, _i64),
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

    _over_threads(run, t.shape[0], t.shape[1])
    return out


def native_bin_gradient(t: Tensor, slopes: Tensor, out: Tensor) -> Tensor:
    """``out[r, j] = slopes[r, min(floor(t[r, j]), num_bins - 1)]`` where ``0 <= t[r, j] <= num_bins``, else 0
    (``histogram.bin_gradient``); ``out`` may be ``t`` itself. Returns ``out``."""
    _check_rows(t, out)
    slopes = slopes.to(torch.float32).contiguous()
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

    _over_threads(run, t.shape[0], t.shape[1])
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
        _log.info("loss: FastAP's compiled CPU passes are not available (%s); the torch path runs", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, None
    return lib


def _built_library() -> Path:
    compiler = _compiler()
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
            errors.append(f"{' '.join(flags)}: {done.stderr.strip().splitlines()[-1:]}")
        finally:
            Path(partial).unlink(missing_ok=True)
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {'; '.join(errors)}")


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")


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
            "FastAP's compiled CPU passes are not available: take the torch path (kernel='torch')"
        )
    return lib


def _check_rows(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(
                "the compiled CPU passes take float32 [rows, columns] CPU tensors with contiguous rows, got "
                f"{t.dtype} on {t.device} of shape {tuple(t.shape)} and strides {t.stride()}"
            )


def _over_threads(run: Callable[[slice], None], n_rows: int, n_cols: int) -> None:
    """``run`` over ``n_rows`` rows, split into one range per thread (``torch.get_num_threads()``)."""
    threads = max(1, min(torch.get_num_threads(), n_rows, (n_rows * n_cols) // MIN_ELEMENTS_PER_THREAD))
    if threads == 1:
        run(slice(0, n_rows))
        return
    step = -(-n_rows // threads)
    ranges = [slice(start, min(n_rows, start + step)) for start in range(0, n_rows, step)]
    for future in [_pool(threads, os.getpid()).submit(run, rows) for rows in ranges]:
        future.result()


@functools.cache
def _pool(threads: int, pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool per thread count and process (a forked child never uses its parent's threads)."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ddp_rank-cpu-pass")
