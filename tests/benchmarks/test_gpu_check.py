"""The GPU acceptance check on recorded results: each target's PASS / FAIL / NOT MEASURED, the report, the exit
status (1 on a failing or unmeasured target, 2 without CUDA), and the parts' command lines."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_scripts(*names: str) -> list[Any]:
    """The benchmark scripts ``names`` as modules, in order (a later one imports the earlier ones by their bare
    names, as the scripts do beside each other). ``sys.path`` and ``sys.modules`` are left as they were."""
    saved_path, saved_modules, modules = list(sys.path), set(sys.modules), []
    try:
        for name in names:
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            modules.append(module)
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if "." not in name and (BENCHMARKS / f"{name}.py").is_file():
                del sys.modules[name]
    return modules


targets, gpu_check = _load_scripts("gpu_targets", "gpu_check")


def _loss_row(loss: str, n: int, ours_s: float, peak_mb: float, floor_s: float = 1.0, kernel: str = "torch",
              dtype: str = "float32") -> dict[str, Any]:  # fmt: skip
    return {"loss": loss, "n": n, "dtype": dtype, "kernel": kernel, "ours": {"time_s": ours_s, "peak_mb": peak_mb},
            "peer": {"error": "needs ~600 GB"}, "floor": {"time_s": floor_s, "peak_mb": 1.0}, "floor_tf32": None}  # fmt: skip


def _status(verdicts: list[Any], fragment: str) -> str:
    (match,) = [v for v in verdicts if fragment in v.target]
    return match.status


def test_loss_targets_judge_the_floor_ratio_and_linear_memory() -> None:
    rows = [
        _loss_row("fastap", 16_384, 0.2, 100.0), _loss_row("fastap", 65_536, 1.5, 420.0),  # 1.5x floor, x4.2
        _loss_row("pnp_dq", 16_384, 0.5, 100.0), _loss_row("pnp_dq", 65_536, 2.6, 1600.0),  # 2.6x floor, x16
        _loss_row("smooth_ap", 16_384, 0.5, 100.0),  # its N = 65,536 never ran
    ]  # fmt: skip
    verdicts = targets.loss_verdicts(rows)
    assert _status(verdicts, "fastap, float32 inputs, kernel=torch: N = 65,536") == targets.PASS
    assert _status(verdicts, "fastap, float32 inputs, kernel=torch: memory") == targets.PASS
    assert _status(verdicts, "pnp_dq, float32 inputs, kernel=torch: N = 65,536") == targets.FAIL
    assert _status(verdicts, "pnp_dq, float32 inputs, kernel=torch: memory") == targets.FAIL
    assert _status(verdicts, "smooth_ap, float32 inputs, kernel=torch: N = 65,536") == targets.NOT_MEASURED
    assert targets.failed(verdicts)


def test_an_out_of_memory_size_is_not_measured_never_passed() -> None:
    rows = [_loss_row("fastap", 16_384, 0.2, 100.0), _loss_row("fastap", 65_536, 1.0, 1.0)]
    rows[1]["ours"] = {"error": "out of memory"}
    verdicts = targets.loss_verdicts(rows)
    assert {v.status for v in verdicts} == {targets.NOT_MEASURED}
    assert "out of memory" in verdicts[0].detail


def test_triton_against_torch_informs_until_triton_is_a_default(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [_loss_row("fastap", 65_536, 1.0, 1.0), _loss_row("fastap", 65_536, 1.25, 1.0, kernel="triton")]
    (info,) = [v for v in targets.loss_verdicts(rows) if "at least as fast" in v.target]
    assert info.status == targets.INFO and "0.80x" in info.detail and "torch stays the default" in info.detail
    monkeypatch.setitem(targets.TRITON_DEFAULT, "fastap", True)
    (judged,) = [v for v in targets.loss_verdicts(rows) if "at least as fast" in v.target]
    assert judged.status == targets.FAIL


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
    assert _status(verdicts, "trainer chunked (64) >= 70%") == targets.FAIL  # 62%
    assert _status(verdicts, "trainer direct, deterministic") == targets.INFO
    assert targets.train_verdicts([]) and all(
        v.status == targets.NOT_MEASURED for v in targets.train_verdicts([])
    )


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


def test_test_suites_are_judged_from_their_junit_reports(tmp_path: Path) -> None:
    green, red, empty = tmp_path / "g.xml", tmp_path / "r.xml", tmp_path / "e.xml"
    green.write_text('<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/></testsuites>')
    red.write_text('<testsuite tests="5" failures="1" errors="1" skipped="0"/>')
    empty.write_text('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="3"/></testsuites>')
    verdicts = targets.tests_verdicts({name: targets.junit_counts(path) for name, path in
                                       [("a", green), ("b", red), ("c", empty), ("d", tmp_path / "none.xml")]})  # fmt: skip
    assert [v.status for v in verdicts] == [
        targets.PASS,
        targets.FAIL,
        targets.NOT_MEASURED,
        targets.NOT_MEASURED,
    ]
    assert verdicts[0].detail == "4 ran, 0 failed, 1 skipped"


def test_without_cuda_it_says_so_and_exits_2_writing_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--part", "loss", "--results", str(tmp_path)],
        capture_output=True, text=True, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
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
    recorded = [_loss_row("fastap", 16_384, 0.2, 100.0), _loss_row("fastap", 65_536, 3.0, 400.0)]
    monkeypatch.setitem(
        gpu_check.PART_FUNCTIONS, "loss", lambda part: ("table", targets.loss_verdicts(recorded))
    )
    assert gpu_check.main(["--part", "loss", "--results", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        "- **FAIL** fastap, float32 inputs, kernel=torch: N = 65,536 within 2x of the fp32 floor: 3.00x"
        in out
    )
    (report,) = tmp_path.glob("gpu-*.md")
    text = report.read_text()
    assert text.startswith("# GPU acceptance") and "### Part `loss`" in text and "a recorded H100" in text
    recorded[1]["ours"]["time_s"] = 1.5
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
    runs = {(c[c.index("--dtype") + 1], c[c.index("--kernel") + 1]) for c in commands}
    assert runs == {("float32", "torch"), ("bfloat16", "torch"), ("float32", "triton")}
    assert all(c[c.index("--dim") + 1] == "512" and c[c.index("--device") + 1] == "cuda" for c in commands)
    assert all(c[c.index("--sizes") + 1].split(",")[::3] == ["1024", "65536"] for c in commands)
    commands.clear()
    gpu_check.part_train(gpu_check.Part("train", tmp_path))
    (train,) = commands
    assert " ".join(train).endswith(
        "--backbone resnet50 --image-size 224 --batch 256 --chunk 64 --precision bf16 --processes 1 "
        f"--deterministic --steps 8 --repeats 1 --json {tmp_path / 'train.json'}"
    )
    commands.clear()
    gpu_check.part_tests(gpu_check.Part("tests", tmp_path))
    assert [c[c.index("-m", 3) + 1] for c in commands] == ["cuda", "distributed and not cuda"]


def test_missing_packages_without_wheels_name_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "NEEDED", {"surely_not_installed_module": "surely-not-installed"})
    with pytest.raises(
        SystemExit, match=r"surely-not-installed missing and no .*: run `make gpu-wheels` first"
    ):
        gpu_check.install_missing(tmp_path / "wheels")
