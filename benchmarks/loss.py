"""Forward + backward time and peak memory of the listwise losses against pytorch-metric-learning.

Every measurement runs in a fresh subprocess so that peak memory (``ru_maxrss`` above the baseline taken
once the inputs exist) belongs to that loss alone. The peer is skipped where its predicted memory exceeds
``--peer-memory-gb`` (its [L, N, N] or [N, N, N] tensors) or its predicted time ``--peer-time-s`` (from its
time at the last N it ran, by its complexity: FastAP O(L N^2), PNP and Smooth-AP O(N^3)), and reported as such
("needs ~X GB", "needs ~X s"). The peer runs after all our rows and floors, so that a run stopped at its time
limit never loses one of ours to it. The floor is the time of the three N x N x d matmuls any exact method needs
(S = E E^T, G E, G^T E), done in row chunks.

    python -m benchmarks.loss                       # N = 256 .. 16384
    python -m benchmarks.loss --sizes 256,...,65536 # the full table (long on 2 cores)
    python -m benchmarks.loss --device cuda --dim 512 --sizes 1024,...,65536 --dtype bfloat16 \
        --matmul-precision tf32                     # on a GPU: also the floor with TF32 matmuls
    python -m benchmarks.loss --device cuda --dim 512 --kernel triton
                                                    # ours with the fused Triton kernels (and, up to
                                                    # N = 16,384, their loss and gradient against torch's)

The loss against its floor on CPU, one command (``--floor-ratios``): for each N and thread count, each loss
runs in a fresh process that alternates one floor step and one loss step ``--repeats`` times, so both meet
the same load on a shared machine, and reports the median of the paired ratios; the table gives the median
over ``--rounds`` such processes, the peak memory of the loss step (taken before any floor step) and its
growth with N. ``--baseline DIR`` runs the same measurement on the ``ddp_rank`` of another checkout
(``git worktree add /tmp/before main``) interleaved with this one, for before / after figures:

    python -m benchmarks.loss --floor-ratios                  # N = 8192,16384; 1 thread and all cores
    python -m benchmarks.loss --floor-ratios --baseline /tmp/before --rounds 3
    python -m benchmarks.loss --floor-ratios --sizes 8192 --thread-counts 1 --target 1.15
                                                    # issue 48's check: a verdict per cell against 1.15x

On CUDA, times are taken between ``torch.cuda.synchronize()`` calls and memory is the peak allocated by the
caching allocator above the inputs. Note on the peer's Smooth-AP: pytorch-metric-learning's ``SmoothAPLoss``
assumes every class holds batch / classes images and computes a different function otherwise (at N = 32 with
uneven classes it gives 0.354 where ours and a brute-force definition give 0.169): its row is a speed
reference only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, markdown_table, mixed_checkout, write_json, write_result

SAMPLES_PER_CLASS = 4
LOSSES = ("fastap", "pnp_dq", "smooth_ap")
SIZES = "256,512,1024,2048,4096,8192,16384"
EXACT_MAX_N = 16_384
"""``kernel=triton`` (and ``auto``) runs also compare their loss and gradient with the torch path's up to this N (a second
forward and backward on the same inputs, after the timing)."""


def _ours(name: str, precision: str = "highest", kernel: str = "torch"):
    from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

    settings = {"matmul_precision": precision, "kernel": kernel}
    return {
        "fastap": lambda: FastAPLoss(10, **settings),
        "pnp_dq": lambda: PNPLoss("Dq", alpha=4.0, **settings),
        "smooth_ap": lambda: SmoothAPLoss(**settings),
    }[name]()


def _peer(name: str):
    from pytorch_metric_learning import losses as pml

    return {
        "fastap": lambda: pml.FastAPLoss(num_bins=10),
        "pnp_dq": lambda: pml.PNPLoss(variant="Dq", alpha=4),
        "smooth_ap": lambda: pml.SmoothAPLoss(),
    }[name]()


PEER_TIME_EXPONENT = {"fastap": 2, "pnp_dq": 3, "smooth_ap": 3}
"""The peer's time grows as N to this power: FastAP's [L, N, N] histograms, PNP's and Smooth-AP's [N, N, N]."""
PEER_START_S = 20.0
"""A peer run under ``--peer-time-s`` gets this long for its process's start (imports, CUDA context, inputs) on top
of ``--repeats`` times the cap, then is stopped."""
NOT_REACHED = {"error": "not reached (time limit)"}
"""The peer's cell until its run comes: what a run stopped at its time limit leaves in the JSON."""


def predicted_peer_s(name: str, n: int, last: tuple[int, float] | None) -> float | None:
    """The peer's forward + backward at ``n`` from ``last`` = (N, seconds) it took at a smaller N; None without."""
    if last is None:
        return None
    last_n, last_s = last
    return last_s * (n / last_n) ** PEER_TIME_EXPONENT[name]


def peer_bytes(name: str, n: int) -> float:
    """Rough peak of pytorch-metric-learning's implementation (float32): its dense intermediate tensors."""
    if name == "fastap":
        return 4.0 * n * n * (3 * 11 + 6)
    return 4.0 * n**3 * 5


def _inputs(n: int, dim: int, device: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) // SAMPLES_PER_CLASS
    x = torch.randn(n // SAMPLES_PER_CLASS + 1, dim, generator=g)[labels] + torch.randn(n, dim, generator=g)
    return x.to(device=device, dtype=getattr(torch, dtype)), labels.to(device)


def _floor_step(x: torch.Tensor, chunk: int = 2048) -> None:
    x = x.float()
    for start in range(0, x.shape[0], chunk):
        q = x[start : start + chunk]
        s = q @ x.T
        s @ x
        s.T @ q


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def worker(kind: str, name: str, n: int, args: argparse.Namespace) -> dict:
    """One measurement in this process: kind is ours, peer, floor (fp32 matmuls) or floor-tf32."""
    device = args.device
    x, labels = _inputs(n, args.dim, device, args.dtype)
    if not kind.startswith("floor"):
        loss_fn = _ours(name, args.matmul_precision, args.kernel) if kind == "ours" else _peer(name)
    torch.backends.cuda.matmul.allow_tf32 = kind == "floor-tf32"
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        baseline_cuda = torch.cuda.memory_allocated()

    def step() -> None:
        if kind.startswith("floor"):
            _floor_step(x)
            return
        e = x.clone().requires_grad_(True)
        loss_fn(e, labels).backward()

    def timed() -> float:
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        return time.perf_counter() - start

    first = timed()
    if device == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated() - baseline_cuda) / 2**20
    else:
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    times = [first]
    for _ in range(args.repeats - 1 if first < 5 else 0):
        times.append(timed())
    # The first call pays one-off allocations; report the best of the others when there are some.
    result: dict = {"time_s": min(times[1:] or times), "peak_mb": peak_mb}
    if kind == "ours" and args.kernel != "torch" and n <= EXACT_MAX_N:
        result["exact"] = exactness(name, x, labels, args.matmul_precision, args.kernel)
    return result


def paired_worker(name: str, n: int, args: argparse.Namespace) -> dict:
    """``--floor-ratios``: the loss step's peak memory, then floor and loss steps alternated ``args.repeats``
    times in this process; the median of the paired time ratios and each step's median time."""
    x, labels = _inputs(n, args.dim, "cpu", args.dtype)
    loss_fn = _ours(name, kernel=args.kernel)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def loss_step() -> None:
        e = x.clone().requires_grad_(True)
        loss_fn(e, labels).backward()

    loss_step()  # first, so that the peak is the loss's and not the floor's 2048-row blocks
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    _floor_step(x)
    floors, losses = [], []
    for _ in range(args.repeats):
        for step, times in ((_floor_step, floors), (loss_step, losses)):
            start = time.perf_counter()
            step(x) if step is _floor_step else step()
            times.append(time.perf_counter() - start)
    return {
        "ratio": statistics.median(o / f for o, f in zip(losses, floors)),
        "loss_s": statistics.median(losses),
        "floor_s": statistics.median(floors),
        "peak_mb": peak_mb,
    }


def floor_ratios(args: argparse.Namespace) -> None:
    """The ``--floor-ratios`` table: ours / floor per loss, N and thread count (and the baseline's)."""
    codes = {"ours": str(REPO)} | ({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})
    sizes = [int(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.thread_counts.split(",")]
    names = args.losses.split(",")
    load_before = os.getloadavg()
    runs: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="loss-floor-") as scratch:
        # The folder each checkout's workers run from: this one, or the baseline's ddp_rank beside these scripts.
        folders = {code: REPO if code == "ours" else mixed_checkout(root, Path(scratch) / code)
                   for code, root in codes.items()}  # fmt: skip
        for _ in range(args.rounds):  # rounds outermost: each cell's processes spread over the whole run
            for t in threads:
                for n in sizes:
                    for name in names:
                        for code, root in codes.items():
                            runs.setdefault((name, n, t, code), []).append(
                                _paired(root, folders[code], name, n, t, args)
                            )
    load_after = os.getloadavg()

    def med(cell: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in cell)

    header = ["loss", "N", "threads", "ours / floor", "ours s", "floor s", "ours peak MB", "MB per 1k rows"]
    if args.baseline:
        header[4:4] = ["baseline / floor"]
    if args.target is not None:
        header.append(f"within {args.target:g}x")
    rows = []
    for t in threads:
        for name in names:
            for n in sizes:
                cell = runs[(name, n, t, "ours")]
                row = [name, str(n), str(t), f"{med(cell, 'ratio'):.2f}", f"{med(cell, 'loss_s'):.3f}",
                       f"{med(cell, 'floor_s'):.3f}", f"{med(cell, 'peak_mb'):.0f}",
                       f"{med(cell, 'peak_mb') / n * 1000:.1f}"]  # fmt: skip
                if args.baseline:
                    row[4:4] = [f"{med(runs[(name, n, t, 'baseline')], 'ratio'):.2f}"]
                if args.target is not None:
                    row.append("yes" if med(cell, "ratio") <= args.target else "no")
                rows.append(row)
    table = markdown_table(header, rows)
    load = (
        ", ".join(f"{a:.1f}" for a in load_before) + " before; " + ", ".join(f"{a:.1f}" for a in load_after)
    )
    body = (
        f"Forward + backward of one batch on CPU against the floor (the three N x N x d matmuls in 2048-row "
        f"chunks), d = {args.dim}, {args.dtype}, {SAMPLES_PER_CLASS} images per class, ours with "
        f"kernel={args.kernel}. Each cell: the median over {args.rounds} processes of the median of "
        f"{args.repeats} paired (floor step, loss step) time ratios in one process; times are the medians of "
        f"the steps. Peak = resident memory of the loss step above the inputs (ru_maxrss). "
        + (
            f"Baseline = ddp_rank from {codes['baseline']}, run interleaved with ours. "
            if args.baseline
            else ""
        )
        + f"Load average (1, 5, 15 min): {load} after.\n\n"
        + table
    )
    print(table)
    print(f"written to {write_result('loss-floor', 'The losses against the matmul floor on CPU', body)}")


def _paired(root: str, folder: Path, name: str, n: int, threads: int, args: argparse.Namespace) -> dict:
    """One paired worker process of the checkout ``root``, run from ``folder``, whose ``ddp_rank`` is the one
    measured (``python -m`` imports from the folder it runs in first)."""
    cmd = [sys.executable, "-m", "benchmarks.loss", "--paired-worker", name, str(n), "--dim", str(args.dim),
           "--threads", str(threads), "--repeats", str(args.repeats), "--dtype", args.dtype,
           "--kernel", args.kernel]  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=folder, timeout=args.time_limit_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} at N = {n} ({root}): {_failure(done.returncode, done.stderr)}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{Path(root).name} {name} N={n} threads={threads}: {result}", flush=True)
    return result


def exactness(
    name: str, x: torch.Tensor, labels: torch.Tensor, precision: str, kernel: str = "triton"
) -> dict[str, float]:
    """``kernel=triton`` (or ``auto``) against the torch path on the same inputs: the losses' relative difference
    (``loss_rel``) and the gradients' largest difference over the largest entry of torch's (``grad_rel``)."""
    results = []
    for path in (kernel, "torch"):
        e = x.clone().requires_grad_(True)
        loss = _ours(name, precision, path)(e, labels)
        loss.backward()
        assert e.grad is not None
        results.append((loss.item(), e.grad.float()))
    (loss_t, grad_t), (loss_r, grad_r) = results
    return {
        "loss_rel": abs(loss_t - loss_r) / max(abs(loss_r), 1e-30),
        "grad_rel": float((grad_t - grad_r).abs().max() / grad_r.abs().max().clamp_min(1e-30)),
    }


def run_one(kind: str, name: str, n: int, args: argparse.Namespace, timeout_s: float | None = None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.loss",
        "--worker",
        kind,
        name,
        str(n),
        "--dim",
        str(args.dim),
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--matmul-precision",
        args.matmul_precision,
        "--kernel",
        args.kernel,
    ]
    timeout_s = args.time_limit_s if timeout_s is None else min(timeout_s, args.time_limit_s)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"> {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"error": _failure(done.returncode, done.stderr)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_peer(
    name: str, n: int, args: argparse.Namespace, history: dict[str, tuple[int, float] | str]
) -> dict:
    """The peer's measurement at ``n``, or why it was not run: its predicted memory over ``--peer-memory-gb``,
    its predicted time over ``--peer-time-s`` (``history``: per loss, the (N, seconds) of its last run, or
    ``"timed out"``), which also stops a run that overruns it."""
    if peer_bytes(name, n) > args.peer_memory_gb * 2**30:
        return {"error": f"needs ~{peer_bytes(name, n) / 2**30:.0f} GB"}
    cap = args.peer_time_s
    if cap is None:
        return run_one("peer", name, n, args)
    last = history.get(name)
    if last == "timed out":
        return {"error": f"needs > {cap:g} s"}
    predicted = predicted_peer_s(name, n, last if isinstance(last, tuple) else None)
    if predicted is not None and predicted > cap:
        return {"error": f"needs ~{predicted:.{0 if predicted >= 10 else 1}f} s"}
    result = run_one("peer", name, n, args, PEER_START_S + args.repeats * cap)
    if str(result.get("error", "")).startswith("> "):  # run_one's time-out
        history[name] = "timed out"
    elif "error" not in result:
        history[name] = (n, result["time_s"])
    return result


def _failure(code: int, stderr: str) -> str:
    """Why a worker failed, in a table cell: killed (SIGKILL: the kernel's out-of-memory killer), or the last line
    of its stderr (a Python error), or its exit status when it said nothing."""
    if code in (-9, 137):
        return "out of memory"
    lines = stderr.strip().splitlines()
    if lines:
        return lines[-1][:80]
    if code < 0:
        return f"worker killed by {signal.Signals(-code).name}, no message"
    return f"worker exit {code}, no message"


def _fmt_time(r: dict) -> str:
    return r["error"] if "error" in r else f"{r['time_s']:.3f}"


def _fmt_mem(r: dict) -> str:
    return "-" if "error" in r else f"{r['peak_mb']:.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-memory-gb", type=float, default=12.0)
    parser.add_argument("--peer-time-s", type=float, default=None,
                        help="skip the peer where its predicted forward + backward takes longer (from its time at "
                        "the last N it ran), and stop a peer run past --repeats times this (default: no cap)")  # fmt: skip
    parser.add_argument("--time-limit-s", type=float, default=900.0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="inputs"
    )
    parser.add_argument(
        "--matmul-precision",
        default="highest",
        choices=("highest", "tf32", "bf16"),
        help="ours' similarity matmuls",
    )
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=("auto", "torch", "triton"),
        help="ours' per-block passes: the losses' default (auto: Triton on CUDA float32, the compiled CPU "
        "passes on CPU float32, torch elsewhere), plain torch ops, or the fused Triton kernels",
    )
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the matmul floors (gpu_check measures them in its first run only)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH",
                        help="also write the measurements as JSON, after each row (gpu_check reads it)")  # fmt: skip
    parser.add_argument("--floor-ratios", action="store_true",
                        help="the ours / floor table on CPU (sizes default to 8192,16384)")  # fmt: skip
    parser.add_argument("--thread-counts", default=f"1,{os.cpu_count()}",
                        help="--floor-ratios: the thread counts (default: 1 and all cores)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="--floor-ratios: processes per cell")
    parser.add_argument("--target", type=float, metavar="RATIO",
                        help="--floor-ratios: say for each cell whether ours / floor is within RATIO")  # fmt: skip
    parser.add_argument("--baseline", metavar="DIR",
                        help="--floor-ratios: also measure the ddp_rank of this checkout, interleaved")  # fmt: skip
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "LOSS", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--paired-worker", nargs=2, metavar=("LOSS", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.paired_worker:
        name, n = args.paired_worker
        print(json.dumps(paired_worker(name, int(n), args)))
        return
    if args.floor_ratios:
        if args.sizes == SIZES:
            args.sizes = "8192,16384"
        floor_ratios(args)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")

    if args.worker:
        kind, name, n = args.worker
        print(json.dumps(worker(kind, name, int(n), args)))
        return

    header = [
        "loss",
        "N",
        "ours s",
        "ours MB",
        "PML s",
        "PML MB",
        "speed-up",
        "memory ratio",
        "floor s",
        "ours / floor",
    ]
    cuda = args.device == "cuda"
    if cuda:
        header += ["TF32 floor s", "ours / TF32 floor"]
    rows = []
    records = []
    sizes = [int(s) for s in args.sizes.split(",")]
    floor_kinds = [] if args.no_floor else ["floor", "floor-tf32"] if cuda else ["floor"]
    measured = {kind: {n: run_one(kind, "fastap", n, args) for n in sizes} for kind in floor_kinds}
    skipped = {n: {"error": "not run (--no-floor)"} for n in sizes}
    floors = measured.get("floor", skipped)
    tf32_floors = measured.get("floor-tf32", skipped if cuda else {})

    def save() -> None:
        if args.json:  # after each measurement: a run stopped at its time limit keeps what it measured
            write_json(args.json, records)

    for name in args.losses.split(","):  # ours first, every row; the peer after them all
        for n in sizes:
            ours = run_one("ours", name, n, args)
            records.append({"loss": name, "n": n, "dim": args.dim, "dtype": args.dtype, "kernel": args.kernel,
                            "matmul_precision": args.matmul_precision, "ours": ours, "peer": dict(NOT_REACHED),
                            "floor": floors[n], "floor_tf32": tf32_floors.get(n)})  # fmt: skip
            save()
            print(f"{name} | {n} | ours {_fmt_time(ours)} s", flush=True)
    peer_history: dict[str, tuple[int, float] | str] = {}
    for record in records:
        record["peer"] = measure_peer(record["loss"], record["n"], args, peer_history)
        save()
        print(f"{record['loss']} | {record['n']} | peer {_fmt_time(record['peer'])}", flush=True)
    for record in records:
        ours, peer, floor = record["ours"], record["peer"], record["floor"]
        ok = "error" not in ours and "error" not in peer
        row = [
            record["loss"],
            str(record["n"]),
            _fmt_time(ours),
            _fmt_mem(ours),
            _fmt_time(peer),
            _fmt_mem(peer),
            f"{peer['time_s'] / ours['time_s']:.1f}x" if ok else "-",
            f"{peer['peak_mb'] / max(ours['peak_mb'], 1):.1f}x" if ok else "-",
            _fmt_time(floor),
            f"{ours['time_s'] / floor['time_s']:.2f}"
            if "error" not in ours and "error" not in floor
            else "-",
        ]
        if cuda:
            tf32 = record["floor_tf32"]
            row += [
                _fmt_time(tf32),
                f"{ours['time_s'] / tf32['time_s']:.2f}"
                if "error" not in ours and "error" not in tf32
                else "-",
            ]
        rows.append(row)

    table = markdown_table(header, rows)
    body = (
        f"Forward + backward of one batch on {args.device}, d = {args.dim}, {args.dtype} inputs, ours with "
        f"matmul_precision={args.matmul_precision} and kernel={args.kernel}, "
        f"{SAMPLES_PER_CLASS} images per class, "
        f"{args.threads} threads; best of {args.repeats} runs after the first; peak = "
        + (
            "CUDA memory allocated above the inputs (MB). "
            if cuda
            else "resident memory above the inputs (MB, ru_maxrss), so a few MB is noise. "
        )
        + "PML = pytorch-metric-learning 2.9.0 (its Smooth-AP is a different function on uneven classes). "
        f"The peer is not run where its dense tensors need more than {args.peer_memory_gb:.0f} GB"
        + (f" or its predicted time exceeds {args.peer_time_s:g} s" if args.peer_time_s is not None else "")
        + "; it runs after all our rows. "
        "Floor = the three N x N x d matmuls done in 2048-row chunks.\n\n" + table
    )
    print(table)
    print(
        f"written to {write_result('loss', 'Loss layer: time and peak memory against pytorch-metric-learning', body)}"
    )


if __name__ == "__main__":
    main()
