"""benchmarks/acceptance/graphs_check.py, the ``train`` part's diagnosis of the captured chunk under CUDA graphs:
its tolerance (the spread of two correct eager runs), its verdicts on recorded records, and the check on the CPU
(aot_eager) on the real step and on a broken build that loses chunks, which it must FAIL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.acceptance import gpu_check, graphs_check
from benchmarks.acceptance import gpu_targets as targets
from ddp_rank.train.chunking.captured import CapturedChunk


def _status(verdicts: list[targets.Verdict], fragment: str) -> list[str]:
    return [v.status for v in verdicts if fragment in v.target]


def test_a_chunk_counted_twice_lies_beyond_the_spread_and_rounding_does_not() -> None:
    g = torch.Generator().manual_seed(0)
    chunks = torch.randn(4, 1000, generator=g)  # four chunks' gradients of one tensor
    reference = {"w": chunks.sum(0), "b": torch.ones(3)}
    rounding = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in reference.items()}
    tolerance = graphs_check.tolerances(reference, [rounding])
    spread = float((rounding["w"] - reference["w"]).abs().max())
    assert tolerance["w"] == pytest.approx(graphs_check.SPREAD_FACTOR * spread)  # above the floor
    assert tolerance["w"] > graphs_check.FLOOR_RTOL * float(reference["w"].abs().max())
    same = graphs_check.tolerances(reference, [reference])  # runs equal bit for bit: the floor
    assert same["b"] == graphs_check.FLOOR_RTOL * 1.0
    again = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in reference.items()}
    per = graphs_check.differences(again, reference, tolerance)
    assert all(share <= targets.GRAPHS_BEYOND_SHARE for _, _, share in per.values())
    twice = graphs_check.differences(
        {"w": reference["w"] + chunks[0], "b": reference["b"]}, reference, tolerance
    )
    assert twice["w"][2] > 0.9 and twice["b"][2] == 0.0
    # A gradient missing on one side (eager: None; CUDA graphs: zeros) counts as zeros.
    assert graphs_check.differences({}, {"b": torch.zeros(3)}, {"b": 0.0})["b"] == [0.0, 0.0, 0.0]


def _record(beyond: dict[str, float], control: float = 0.9) -> dict[str, Any]:
    """A record whose comparisons have one tensor with ``beyond[comparison]`` of its entries beyond tolerance."""
    rows = []
    for precision in targets.GRAPHS_PRECISIONS:
        for step in (1, 2):
            for comparison in (targets.GRAPHS_CONTROL, *targets.GRAPHS_COMPARISONS):
                share = control if comparison == targets.GRAPHS_CONTROL else beyond.get(comparison, 0.0)
                rows.append({"precision": precision, "step": step, "comparison": comparison,
                             "per_tensor": {"conv1.weight": [2e-4, 1e-4, share], "head.bias": [0.0, 1e-6, 0.0]}})  # fmt: skip
    return {"setup": "resnet18, 32 px", "rows": rows, "run_s": {"fp32 graphs": 30.0}}


def test_graphs_verdicts_judge_each_precision_and_comparison_against_the_spread() -> None:
    verdicts = targets.graphs_verdicts(_record({}))
    assert _status(verdicts, "within the eager spread") == [targets.PASS] * 6
    assert _status(verdicts, "the control") == [targets.INFO] * 2  # one per precision
    assert "0 of 2 tensors with more than 1% of their entries beyond" in verdicts[0].detail
    lost = targets.graphs_verdicts(_record({"graphs - compile": 0.35, "graphs - eager": 0.35}))
    assert (
        _status(lost, "graphs - compile") == [targets.FAIL] * 2
        and _status(lost, "compile - eager") == [targets.PASS] * 2
    )
    assert "most 35.0% in conv1.weight" in lost[0].detail
    # The control unseen: the spread is too wide to see a chunk counted twice, so no PASS means anything.
    blind = targets.graphs_verdicts(_record({}, control=0.0))
    assert _status(blind, "within the eager spread") == [targets.NOT_MEASURED] * 6
    assert "the spread is too wide to tell" in blind[0].detail
    crashed = _record({})
    crashed["rows"] = [r for r in crashed["rows"] if r["comparison"] != "graphs - compile"]
    crashed["rows"].append({"precision": "bf16", "step": 1, "comparison": "graphs - compile",
                            "error": "graphs failed: InductorError: boom"})  # fmt: skip
    verdicts = targets.graphs_verdicts(crashed)
    assert _status(verdicts, "graphs - compile") == [targets.NOT_MEASURED, targets.FAIL]  # fp32: no rows
    assert {v.status for v in targets.graphs_verdicts(None)} == {targets.NOT_MEASURED}
    eager_failed = {"rows": [{"precision": "fp32", "step": 1, "comparison": "spread", "error": "eager: OOM"}]}
    assert "the eager runs failed: eager: OOM" in targets.graphs_verdicts(eager_failed)[0].detail
    assert "- fp32, step 1: control - eager: worst 2.00e-04 in conv1.weight" in gpu_check._graphs_lines(
        _record({})
    )


def _cpu_check(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "graphs.json"
    small = ["--device", "cpu", "--backbone", "tiny_cnn", "--compiler", "aot_eager", "--image-size", "16"]
    assert graphs_check.main([*small, "--batch", "32", "--chunk", "8", *args, "--json", str(out)]) == 0
    return dict(json.loads(out.read_text()))


@pytest.mark.slow
def test_the_check_passes_the_captured_chunk_on_the_cpu(tmp_path: Path) -> None:
    """aot_eager (the capture without generated code): every mode equal to the eager step within the spread, and
    the control seen; each run's time recorded."""
    record = _cpu_check(tmp_path)
    assert {(r["precision"], r["step"]) for r in record["rows"]} == {
        (p, s) for p in ("fp32", "bf16") for s in (1, 2)
    }
    assert all("error" not in r for r in record["rows"])
    verdicts = targets.graphs_verdicts(record)
    assert _status(verdicts, "within the eager spread") == [targets.PASS] * 6, [v.line() for v in verdicts]
    assert set(record["run_s"]) == {f"{p} {run}" for p in ("fp32", "bf16") for run in graphs_check.RUNS}


@pytest.mark.slow
def test_the_check_fails_graphs_that_lose_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken build: under ``graphs`` each captured chunk's backward starts from no gradient (the accumulated
    gradient keeps only the last chunks, pytorch#169545's effect). The check must FAIL it against compile and
    eager, and still PASS compile."""
    real = CapturedChunk._pass_2

    def losing(self: CapturedChunk, chunk: torch.Tensor) -> torch.Tensor:
        if self.mode == "graphs":
            self.module.zero_grad(set_to_none=True)
        return real(self, chunk)

    monkeypatch.setattr(CapturedChunk, "_pass_2", losing)
    verdicts = targets.graphs_verdicts(_cpu_check(tmp_path, "--precisions", "fp32"))
    assert _status(verdicts, "fp32")[:3] == [targets.FAIL, targets.FAIL, targets.PASS]
