"""The ``chunk`` part of the GPU acceptance check: its verdicts on known records, the bisection for the largest
chunk that fits, and the whole measurement on CPU against a simulated memory limit, where a probe that over-counts
and one that under-counts (its trial step blinded too) make the verdicts FAIL while the right probe passes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.acceptance import chunk_check, gpu_check
from benchmarks.acceptance import gpu_targets as targets
from ddp_rank.model import freeze_batchnorm
from ddp_rank.train.chunking import choice as chunk_choice
from ddp_rank.train.chunking.choice import ActivationProbe, count_saved
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


def _status(verdicts: list[Any], fragment: str) -> str:
    (match,) = [v for v in verdicts if fragment in v.target]
    return str(match.status)


def _record(chosen: int, largest: int, oom: bool = False, local: int = 2048) -> dict[str, Any]:
    return {"setup": "resnet50, 224 px, bf16, local batch 2048", "local_batch": local, "chosen": chosen,
            "backed_off": False, "oom_at_chosen": oom, "largest_fitting": largest, "peak_reserved_mb": 61_000.0,
            "peak_allocated_mb": 58_000.0, "device_mb": 81_559.0}  # fmt: skip


CLEAN = {"sanitizer_enabled": True, "control": False, "steps": 3, "reports": 0}
CONTROL = {
    "sanitizer_enabled": True,
    "control": True,
    "reports": 2,
    "error": "CUDASanitizerErrors: detected 2",
}


def test_a_chunk_near_the_largest_that_fits_passes_with_its_peak_memory() -> None:
    verdicts = targets.chunk_verdicts(_record(700, 1000), CLEAN, CONTROL)
    assert _status(verdicts, "without out-of-memory") == targets.PASS
    assert _status(verdicts, ">= 0.5 of the largest") == targets.PASS
    assert _status(verdicts, "peak reserved") == targets.INFO
    assert _status(verdicts, "TORCH_CUDA_SANITIZER") == targets.PASS and not targets.failed(verdicts)


def test_a_probe_that_under_counts_or_over_counts_fails() -> None:
    under = targets.chunk_verdicts(_record(1200, 1000, oom=True), CLEAN, CONTROL)
    assert _status(under, "without out-of-memory") == targets.FAIL
    (share,) = [v for v in under if ">= 0.5" in v.target]
    assert share.status == targets.FAIL and "under-counts" in share.detail
    over = targets.chunk_verdicts(_record(400, 1000), CLEAN, CONTROL)
    (share,) = [v for v in over if ">= 0.5" in v.target]
    assert share.status == targets.FAIL and "over-counts" in share.detail and "0.40" in share.detail


def test_what_was_not_measured_is_never_passed() -> None:
    missing = targets.chunk_verdicts(None, None, None)
    assert {v.status for v in missing} == {targets.NOT_MEASURED}
    crashed = targets.chunk_verdicts({"error": "TrainError: no chunk fits"}, CLEAN, CONTROL)
    assert _status(crashed, "without out-of-memory") == targets.FAIL
    fits_whole = targets.chunk_verdicts(_record(2048, 2048), CLEAN, CONTROL)
    assert _status(fits_whole, ">= 0.5") == targets.NOT_MEASURED, "a batch that fits forces no chunk"
    unfinished = {k: v for k, v in _record(700, 1000).items() if k != "largest_fitting"}
    assert _status(targets.chunk_verdicts(unfinished, CLEAN, CONTROL), ">= 0.5") == targets.NOT_MEASURED


def test_the_sanitizer_verdict_fails_on_a_report_and_needs_a_reported_control() -> None:
    def status(clean: dict[str, Any] | None, control: dict[str, Any] | None) -> str:
        return _status(targets.chunk_verdicts(_record(700, 1000), clean, control), "TORCH_CUDA_SANITIZER")

    reported = {**CLEAN, "reports": 1, "first_report": "CSAN detected a possible data race on tensor ..."}
    assert status(reported, CONTROL) == targets.FAIL
    assert status(reported, None) == targets.FAIL, "a report fails whatever the control did"
    assert status({**CLEAN, "error": "RuntimeError: boom"}, CONTROL) == targets.FAIL
    assert status(CLEAN, {**CONTROL, "reports": 0}) == targets.NOT_MEASURED, "blind sanitizer: proves nothing"
    assert status({"sanitizer_enabled": False, "error": "TORCH_CUDA_SANITIZER is not set"}, CONTROL) == (
        targets.NOT_MEASURED
    )
    assert status(None, CONTROL) == targets.NOT_MEASURED


@given(threshold=st.integers(0, 300), high=st.integers(1, 300), data=st.data())
def test_the_bisection_finds_the_largest_chunk_that_fits(
    threshold: int, high: int, data: st.DataObject
) -> None:
    known = data.draw(st.integers(0, min(threshold, high)))
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= threshold

    assert chunk_check.largest_fitting(fits, high, known_fit=known) == min(threshold, high)
    assert len(tried) <= high.bit_length() + 2


# ----------------------------------------------------------------------------------------- on CPU, end to end
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


def _device_limit() -> int:
    """The simulated device: a forward of up to 8 images of 64 px through tiny_cnn fits, 9 do not."""
    from ddp_rank.config import ModelConfig
    from ddp_rank.model import build_model

    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=16), 64)
    model.train()
    freeze_batchnorm(model)
    with count_saved() as saved:
        model(torch.randint(0, 256, (8, 3, 64, 64), dtype=torch.uint8))
    return saved[0]


@pytest.mark.slow
@pytest.mark.parametrize(("miscount", "verdict"), [(1.0, "PASS"), (4.0, "FAIL"), (0.25, "FAIL")])
def test_on_cpu_a_miscounting_probe_makes_the_verdict_fail(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, miscount: float, verdict: str
) -> None:
    """The trainer's budget of 2 MiB picks about 5 of the 16 images of 64 px; the simulated device holds 8. A
    probe 4x too high picks 1 (below half of 8: over-counts); one 4x too low picks the whole batch, and with its
    trial step blinded too (else it backs off, as it should) the step runs out of memory: under-counts."""
    measure = chunk_choice.measure_activation_bytes

    def probe(*args: Any, **kwargs: Any) -> ActivationProbe:
        right = measure(*args, **kwargs)
        return dataclasses.replace(right, per_image=int(right.per_image * miscount))

    monkeypatch.setattr(chunk_choice, "measure_activation_bytes", probe)
    if miscount < 1:
        from ddp_rank.train.chunking import auto as auto_chunk

        monkeypatch.setattr(auto_chunk, "trial_step", lambda *args, **kwargs: lambda rows: None)
    overrides = [o for o in TINY_OVERRIDES if not o.startswith(("data.image_size", "data.resize_size"))]
    record = chunk_check.measure(
        [*overrides, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", "data.image_size=64",
         "data.resize_size=64", "data.test_split=", "distributed.memory_budget_mb=2"],
        steps=2,
        cpu_limit=_device_limit(),
    )  # fmt: skip
    assert record["largest_fitting"] == 8, record
    verdicts = targets.chunk_verdicts(record, CLEAN, CONTROL)
    assert _status(verdicts, ">= 0.5 of the largest") == verdict, verdicts
    assert _status(verdicts, "without out-of-memory") == ("FAIL" if miscount < 1 else "PASS")
    assert record["log"] and "chunk_size=auto" in record["log"][0]


def test_the_part_runs_the_check_and_both_sanitizer_runs_and_judges_their_records(tmp_path: Path) -> None:
    """``gpu_check.py --part chunk`` with its commands faked: the measurement, then the clean and the control run
    under ``TORCH_CUDA_SANITIZER=1``, each record read back from where the command was told to write it."""
    assert "chunk" in gpu_check.PARTS and gpu_check.PART_FUNCTIONS["chunk"] is gpu_check.part_chunk
    records = {
        "--sanitizer clean": CLEAN,
        "--sanitizer control": CONTROL,
        "": {**_record(700, 1000), "log": ["x"]},
    }
    commands: list[tuple[list[str], dict[str, str] | None]] = []

    class FakePart(gpu_check.Part):  # type: ignore[name-defined, misc]
        def run(self, cmd: list[str], share: float = 1.0, env: dict[str, str] | None = None) -> int | None:
            commands.append((cmd, env))
            line = " ".join(cmd)
            mode = next(key for key in records if key and key in line) if "--sanitizer" in line else ""
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(records[mode]))
            return 0

    body, verdicts = gpu_check.part_chunk(FakePart("chunk", tmp_path))
    assert [v.status for v in verdicts if v.status != targets.INFO] == [targets.PASS] * 3, verdicts
    assert [env for _, env in commands] == [
        None,
        {"TORCH_CUDA_SANITIZER": "1"},
        {"TORCH_CUDA_SANITIZER": "1"},
    ]
    assert body.startswith("- x")
