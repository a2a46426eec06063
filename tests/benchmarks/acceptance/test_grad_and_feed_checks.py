"""The GPU acceptance's ``grads`` and ``feed`` parts can FAIL: their verdicts on known figures, their commands, and,
on CPU, the same checks run on the real code (they PASS) and on broken builds (they FAIL): a chunked step that
keeps only its last chunk's gradient, under no DDP, DDP over 2 gloo processes, and DeepSpeed ZeRO-1 and ZeRO-2; a
feed that reads the next batch only when asked, with a loader slow enough for that to show."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.acceptance import feed_check, gpu_check, grad_check
from benchmarks.acceptance import gpu_targets as targets
from tests.benchmarks.acceptance.test_gpu_check import REPO

PASS, FAIL, NOT_MEASURED, INFO = targets.PASS, targets.FAIL, targets.NOT_MEASURED, targets.INFO


def _grad_row(engine: str = "zero2", precision: str = "fp32", fault: str = "none", processes: int = 1,
              whole: float = 1e-6, worst: float = 1e-5, norm: float = 0.5) -> dict[str, Any]:  # fmt: skip
    return {"engine": engine, "precision": precision, "fault": fault, "processes": processes, "chunks": 4,
            "chunk": 32, "update_rel": whole, "worst_rel": worst, "worst_tensor": "head.bias", "direct_norm": norm}  # fmt: skip


def _status(verdicts: list[Any], fragment: str) -> str:
    (match,) = [v for v in verdicts if fragment in v.target]
    return match.status


# ----------------------------------------------------------------------------------------- grads: verdicts
def test_update_comparison_on_known_tensors() -> None:
    direct = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0]), "c": torch.tensor([1.0])}
    same = grad_check.compare_updates(dict(direct), direct)
    assert same == {"update_rel": 0.0, "worst_rel": 0.0, "worst_tensor": "w", "direct_norm": math.sqrt(26)}
    # A quarter of the update kept (3 of 4 chunks lost): off by 3/4, everywhere.
    quarter = grad_check.compare_updates({k: v / 4 for k, v in direct.items()}, direct)
    assert quarter["update_rel"] == pytest.approx(0.75) and quarter["worst_rel"] == pytest.approx(0.75)
    # A tensor the direct step left alone and the chunked one moved: infinitely off.
    moved = grad_check.compare_updates({**direct, "b": torch.tensor([1e-9])}, direct)
    assert moved["worst_rel"] == math.inf and moved["worst_tensor"] == "b"
    with pytest.raises(ValueError, match="different tensors"):
        grad_check.compare_updates({"w": direct["w"]}, direct)


def test_grads_verdicts_pass_within_tolerance_and_fail_outside() -> None:
    whole_fp32, worst_fp32 = targets.GRAD_RTOL["fp32"]
    whole_bf16, _ = targets.GRAD_RTOL["bf16"]
    rows = [
        _grad_row("plain", "fp32", whole=0.5 * whole_fp32, worst=0.5 * worst_fp32),
        _grad_row("ddp", "fp32", whole=2 * whole_fp32),  # over on the whole update
        _grad_row("zero1", "fp32", worst=2 * worst_fp32),  # over on one tensor
        _grad_row("zero1", "bf16", whole=0.5 * whole_bf16, worst=0.1),  # bf16: looser
        _grad_row("zero2", "bf16", whole=math.nan),
        _grad_row("plain", "bf16", norm=0.0, whole=math.inf, worst=0.0),  # nothing moved: nothing compared
        {"engine": "ddp", "precision": "bf16", "fault": "none", "processes": 1, "error": "RuntimeError: boom"},
    ]
    expected = [(r["engine"], r["precision"], 1, "none") for r in rows] + [("zero2", "fp32", 1, "none")]
    verdicts = targets.grads_verdicts(rows, expected, gpus=1)
    assert _status(verdicts, "plain, fp32, 1 process") == PASS
    assert _status(verdicts, "ddp, fp32, 1 process") == FAIL
    assert _status(verdicts, "zero1, fp32, 1 process") == FAIL
    assert _status(verdicts, "zero1, bf16, 1 process") == PASS
    assert _status(verdicts, "zero2, bf16, 1 process") == FAIL
    assert _status(verdicts, "plain, bf16, 1 process") == FAIL
    assert "nothing to compare" in next(v.detail for v in verdicts if "plain, bf16" in v.target)
    assert _status(verdicts, "ddp, bf16, 1 process") == FAIL  # a crash is a failure, not a missing figure
    assert _status(verdicts, "zero2, fp32, 1 process") == NOT_MEASURED  # asked for, never written
    # One GPU: DDP over NCCL with 2+ processes is said to be unmeasured, never passed.
    assert _status(verdicts, "DDP over NCCL, 2+ processes") == NOT_MEASURED
    assert not [v for v in targets.grads_verdicts([], [], gpus=2) if "NCCL" in v.target]


def test_a_noisy_comparison_widens_the_tolerance_to_its_floor_up_to_the_cap() -> None:
    """Two correct float32 steps of a fresh ResNet-50 differ by 1-2 % (kernels of another layout or shape): a
    chunked step within twice that floor passes, one beyond it fails, and no floor lets 10 % through."""
    def row(whole: float, worst: float, floor: float, floor_worst: float, fault: str = "none") -> dict[str, Any]:
        return {**_grad_row("plain", "fp32", fault, whole=whole, worst=worst), "floor_rel": floor,
                "floor_worst_rel": floor_worst}  # fmt: skip

    def status(r: dict[str, Any]) -> str:
        (verdict,) = targets.grads_verdicts([r], [(r["engine"], r["precision"], 1, r["fault"])], gpus=2)
        return str(verdict.status)

    assert targets.GRAD_FLOOR_FACTOR == 2.0 and targets.GRAD_FLOOR_CAP == 0.1
    assert status(row(1.5e-2, 2.1e-2, floor=2.1e-2, floor_worst=3.3e-2)) == PASS  # the H200's figures
    assert "two direct steps (two layouts) 2.10e-02 apart" in targets.grads_verdicts(
        [row(1.5e-2, 2.1e-2, 2.1e-2, 3.3e-2)], [("plain", "fp32", 1, "none")], gpus=2)[0].detail  # fmt: skip
    assert status(row(1.5e-2, 1e-4, floor=1e-3, floor_worst=1e-2)) == FAIL  # over twice the floor
    assert status(row(1e-5, 5e-2, floor=1e-6, floor_worst=2e-2)) == FAIL  # one tensor over twice its floor
    assert status(row(0.15, 0.15, floor=0.2, floor_worst=0.2)) == FAIL  # the cap: 10 % fails whatever the floor
    assert status(row(5e-5, 5e-4, floor=0.0, floor_worst=math.nan)) == PASS  # no floor: the fixed tolerance
    # A lost chunk stays caught under the loudest floor.
    assert status(row(0.92, 1.24, floor=0.5, floor_worst=0.5, fault="drop-chunks")) == PASS


def test_a_broken_build_is_the_checks_control() -> None:
    caught = _grad_row("zero2", "bf16", "no-coalescing", whole=1.76, worst=16.0)
    missed = _grad_row("plain", "fp32", "drop-chunks")  # the check let a broken build through
    rows = [caught, missed, {**_grad_row("zero1", "fp32", "no-coalescing"), "error": "RuntimeError: boom"}]
    expected = [(r["engine"], r["precision"], 1, r["fault"]) for r in rows]
    verdicts = targets.grads_verdicts(rows, expected, gpus=2)
    assert _status(verdicts, "(no-coalescing): zero2") == PASS
    assert _status(verdicts, "(drop-chunks): plain") == FAIL
    assert _status(verdicts, "(no-coalescing): zero1") == NOT_MEASURED


def test_run_specs_are_checked() -> None:
    assert grad_check.Run.parse("zero2:bf16:no-coalescing").name == "zero2:bf16:no-coalescing"
    for spec, message in (("zero3:fp32", "unknown engine"), ("ddp:fp16", "unknown precision"),
                          ("ddp", "ENGINE:PRECISION"), ("plain:fp32:no-coalescing", "DeepSpeed fault")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            grad_check.Run.parse(spec)


def test_the_grads_part_asks_for_every_engine_and_nccl_only_with_two_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(gpu_check.Part, "run", lambda self, cmd, share=1.0, env=None: commands.append(cmd) or 0)
    for gpus in (1, 4):
        commands.clear()
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        _, verdicts = gpu_check.part_grads(gpu_check.Part("grads", tmp_path))
        assert [c[c.index("--processes") + 1] for c in commands] == (["1"] if gpus == 1 else ["1", "4"])
        runs = {spec for c in commands for spec in c[c.index("--runs") + 1].split(",")}
        for engine in ("plain", "ddp", "zero1", "zero2"):
            assert {f"{engine}:fp32:none", f"{engine}:bf16:none"} <= runs
        assert {"plain:fp32:drop-chunks", "ddp:bf16:drop-chunks", "zero1:fp32:no-coalescing",
                "zero2:bf16:no-coalescing"} <= runs
        assert all(v.status == NOT_MEASURED for v in verdicts)  # no rows were written
        nccl = [v for v in verdicts if "NCCL" in v.target or "4 processes" in v.target]
        assert len(nccl) == (1 if gpus == 1 else 3)


def test_grads_and_feed_run_within_their_own_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "environment", lambda: "Device: a recorded H100.")
    left: dict[str, float] = {}

    def record(part: Any) -> tuple[str, list[Any]]:
        left[part.name] = part.time_left()
        return "", [targets.Verdict("recorded", PASS, "")]

    for name in ("train", "grads", "feed"):
        monkeypatch.setitem(gpu_check.PART_FUNCTIONS, name, record)
    assert gpu_check.main(["--part", "train,grads,feed", "--results", str(tmp_path)]) == 0
    for name in ("grads", "feed"):  # a later part of a list: its time counts from its own start
        assert gpu_check.PART_BUDGET_S[name] - 30 < left[name] <= gpu_check.PART_BUDGET_S[name] < gpu_check.BUDGET_S
    assert left["train"] <= gpu_check.BUDGET_S


# ----------------------------------------------------------------------------------------- feed: verdicts
def _feed_row(workers: int, device: float, loader: float, fed: float, wait: float) -> dict[str, Any]:
    return {"workers": workers, "feed": "real", "device_s": device, "loader_s": loader, "fed_s": fed, "wait_s": wait}


def test_feed_verdicts_on_known_timings() -> None:
    overlapped = _feed_row(0, 0.10, 0.08, 0.104, 0.002)  # max(step, loader), nearly nothing waited
    serial = _feed_row(0, 0.10, 0.08, 0.185, 0.083)  # step + loader: no overlap
    verdicts = targets.feed_verdicts([overlapped], [0])
    assert _status(verdicts, "reading overlaps") == PASS
    assert _status(verdicts, "data_time is the whole wait") == PASS
    assert _status(verdicts, "within") == INFO  # num_workers=0 informs
    verdicts = targets.feed_verdicts([serial], [0])
    assert _status(verdicts, "reading overlaps") == FAIL and "without overlap it would be 1.80x" in verdicts[0].detail
    assert _status(verdicts, "data_time is the whole wait") == PASS  # it waited, and said so
    # A wait the trainer's data_time missed (e.g. a blocking copy after next()) lands in the step.
    hidden = _feed_row(8, 0.10, 0.08, 0.185, 0.0)
    assert _status(targets.feed_verdicts([hidden], [8]), "data_time is the whole wait") == FAIL
    # A loader far faster than the step: overlap or none cannot be told apart.
    fast = _feed_row(8, 0.10, 0.01, 0.104, 0.0)
    verdicts = targets.feed_verdicts([fast], [8])
    assert _status(verdicts, "reading overlaps") == INFO and _status(verdicts, "within 1.1x") == PASS
    # With workers the fed step must stay near the on-device one; a slow loader is named as the cause.
    starved = _feed_row(8, 0.10, 0.13, 0.135, 0.034)
    (within,) = [v for v in targets.feed_verdicts([starved], [8]) if "within" in v.target]
    assert within.status == FAIL and "loader alone is slower than the step" in within.detail
    assert [v.status for v in targets.feed_verdicts([], [0, 8])] == [NOT_MEASURED, NOT_MEASURED]


def test_the_feed_part_runs_both_worker_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(gpu_check.Part, "run", lambda self, cmd, share=1.0, env=None: commands.append(cmd) or 0)
    _, verdicts = gpu_check.part_feed(gpu_check.Part("feed", tmp_path))
    ((cmd),) = commands
    assert cmd[cmd.index("--workers") + 1] == "0,12" and cmd[cmd.index("--device") + 1] == "cuda"
    assert [v.status for v in verdicts] == [NOT_MEASURED, NOT_MEASURED]
    assert {"grads", "feed"} <= set(gpu_check.PARTS) and gpu_check.PART_NEEDS["feed"] == ("pydantic", "webdataset")


# ----------------------------------------------------------------------------------------- on CPU, for real
def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # fmt: skip


def _grad_rows(tmp_path: Path, processes: int, runs: list[str]) -> list[dict[str, Any]]:
    out = tmp_path / f"grads-{processes}.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.acceptance.grad_check", "--device", "cpu", "--processes", str(processes),
         "--backbone", "tiny_cnn", "--image-size", "16", "--batch", "32", "--chunk", "8", "--runs", ",".join(runs),
         "--json", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(out.read_text()))


def _judged_as_real(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Every row judged as if it came from the real build: ``name -> status``."""
    real = [{**r, "fault": "none"} for r in rows]
    verdicts = []
    for row in real:  # one at a time: a broken row and the real one share their key
        verdicts += targets.grads_verdicts([row], [(row["engine"], row["precision"], row["processes"], "none")], 2)
    return {f"{r['engine']}:{r['precision']}:{r['fault']}": v.status for r, v in zip(rows, verdicts)}


@pytest.mark.distributed
@pytest.mark.slow
def test_grads_check_passes_the_real_step_and_fails_lost_chunks_on_one_process(tmp_path: Path) -> None:
    """Needs DeepSpeed's CPU comm op (built by ``make install``)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional [deepspeed] extra")
    runs = ["plain:fp32", "zero1:fp32", "zero2:fp32", "plain:fp32:drop-chunks", "zero1:fp32:no-coalescing",
            "zero2:fp32:no-coalescing", "zero2:fp32:drop-chunks"]  # fmt: skip
    rows = _grad_rows(tmp_path, 1, runs)
    assert all(0 <= r["floor_rel"] < 1e-3 and math.isfinite(r["floor_worst_rel"]) for r in rows)  # tiny_cnn: rounding
    assert _judged_as_real(rows) == {
        "plain:fp32:none": PASS, "zero1:fp32:none": PASS, "zero2:fp32:none": PASS,
        "plain:fp32:drop-chunks": FAIL, "zero1:fp32:no-coalescing": FAIL, "zero2:fp32:no-coalescing": FAIL,
        "zero2:fp32:drop-chunks": FAIL,
    }  # fmt: skip
    expected = [(r["engine"], r["precision"], 1, r["fault"]) for r in rows]
    assert {v.status for v in targets.grads_verdicts(rows, expected, gpus=2)} == {PASS}


@pytest.mark.distributed
@pytest.mark.slow
def test_grads_check_under_ddp_on_two_gloo_processes(tmp_path: Path) -> None:
    rows = _grad_rows(tmp_path, 2, ["ddp:fp32", "ddp:fp32:drop-chunks"])
    assert [r["processes"] for r in rows] == [2, 2]
    assert _judged_as_real(rows) == {"ddp:fp32:none": PASS, "ddp:fp32:drop-chunks": FAIL}


def _feed_rows(tmp_path: Path, feed: str) -> list[dict[str, Any]]:
    """The check's command line, run in this process: it starts no process of its own (its reader is a thread), so
    a child would only import torch again. Medians of 5 steps after 1 of warm-up (its first read opens the shards)."""
    out = tmp_path / f"feed-{feed}.json"
    code = feed_check.main(
        ["--device", "cpu", "--image-size", "16", "--batch", "16", "--workers", "0", "--steps", "5", "--warmup", "1",
         "--device-step-s", "0.2", "--slow-loader", "0.6", "--feed", feed, "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    return list(json.loads(out.read_text()))


@pytest.mark.slow
def test_feed_check_passes_the_device_feed_and_fails_a_synchronous_one(tmp_path: Path) -> None:
    """A loader slowed to 0.6 of the step: the real feed hides it (the fed step stays near the on-device one),
    a feed that reads only when asked takes the sum, and the overlap target FAILs it. The step is a simulated
    device (0.2 s in which the host only waits, as it does for a GPU): a model stepping on this shared CPU would
    time the machine's load instead."""
    overlap = "reading overlaps"
    (real,) = _feed_rows(tmp_path, "real")
    assert real["device_s"] == pytest.approx(0.2, rel=0.25)
    assert _status(targets.feed_verdicts([real], [0]), overlap) == PASS, real
    (synchronous,) = _feed_rows(tmp_path, "synchronous")
    verdicts = targets.feed_verdicts([synchronous], [0])
    assert _status(verdicts, overlap) == FAIL, synchronous
    assert _status(verdicts, "data_time is the whole wait") == PASS  # its wait is in data_time, as it should be
