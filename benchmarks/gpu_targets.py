"""The targets of the GPU acceptance check (``benchmarks/gpu_check.py``): what each part must reach, judged from the
results the part recorded, and the report section it leaves.

A target is PASS or FAIL only on a measurement; a target whose measurement is missing (a part that crashed, a
test suite that collected nothing, a size that ran out of memory) is NOT MEASURED, never PASS. INFO lines carry
figures that decide nothing yet (``kernel=triton`` against ``torch`` where torch is the default). A part fails
(exit status 1) on any FAIL or NOT MEASURED.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PASS, FAIL, NOT_MEASURED, INFO = "PASS", "FAIL", "NOT MEASURED", "INFO"

FLOOR_RATIO = 2.0
"""Every loss at N = 65,536, d = 512 within this factor of the fp32 three-matmul floor."""
LINEAR_SLACK = 1.5
"""Memory linear in N: peak(N) / peak(N / 4) at most 4 x this (a quadratic tensor would give 16)."""
DIRECT_SHARE, CHUNKED_SHARE = 0.90, 0.70
"""The trainer's images/s as a share of the bare loop's, direct and chunked (64)."""
DEEPSPEED_FIRST_STEP_RTOL = 0.02
"""DeepSpeed's first loss against the DDP run's: the same weights and batch, only the precision path differs."""
DEEPSPEED_TAIL_RTOL = 0.10
"""The mean loss of the last 5 of 20 steps against the DDP run's (the trajectories drift apart in bf16/fp16)."""
TRITON_DEFAULT: dict[str, bool] = {"fastap": False, "pnp_dq": False, "smooth_ap": False}
"""Where ``kernel=triton`` is the CUDA default (none yet: a report must show it faster and exact first)."""


@dataclass(frozen=True)
class Verdict:
    target: str
    status: str
    detail: str

    def line(self) -> str:
        return f"- **{self.status}** {self.target}: {self.detail}"


def failed(verdicts: list[Verdict]) -> bool:
    return any(v.status in (FAIL, NOT_MEASURED) for v in verdicts)


# ----------------------------------------------------------------------------------------- tests
def junit_counts(path: Path) -> dict[str, int] | None:
    """(tests, failures, errors, skipped) of a pytest ``--junitxml`` file, None when it is missing or broken."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def tests_verdicts(results: dict[str, dict[str, int] | None]) -> list[Verdict]:
    """``results``: suite name (``cuda``, ``multi-process``) -> junit counts (None: the run left no report)."""
    verdicts = []
    for name, counts in results.items():
        target = f"every {name} test green"
        if counts is None:
            verdicts.append(Verdict(target, NOT_MEASURED, "pytest left no report (crashed or timed out)"))
            continue
        ran = counts["tests"] - counts["skipped"]
        bad = counts["failures"] + counts["errors"]
        summary = f"{ran} ran, {bad} failed, {counts['skipped']} skipped"
        if bad:
            verdicts.append(Verdict(target, FAIL, summary))
        elif ran == 0:
            verdicts.append(Verdict(target, NOT_MEASURED, summary + ": nothing ran"))
        else:
            verdicts.append(Verdict(target, PASS, summary))
    return verdicts


# ----------------------------------------------------------------------------------------- loss
def loss_verdicts(rows: list[dict[str, Any]], n_max: int = 65_536) -> list[Verdict]:
    """``rows``: ``benchmarks/loss.py --json`` rows (loss, n, dtype, kernel, ours / floor: {time_s, peak_mb} or
    {error})."""
    verdicts = []
    for (loss, dtype, kernel), group in sorted(_group(rows).items()):
        by_n = {r["n"]: r for r in group}
        what = f"{loss}, {dtype} inputs, kernel={kernel}"
        top = by_n.get(n_max)
        target = f"{what}: N = {n_max:,} within {FLOOR_RATIO:g}x of the fp32 floor"
        if top is None or not _ok(top.get("ours")) or not _ok(top.get("floor")):
            why = _why(top, "ours") if top else f"N = {n_max:,} was not run"
            verdicts.append(Verdict(target, NOT_MEASURED, why))
        else:
            ratio = top["ours"]["time_s"] / top["floor"]["time_s"]
            status = PASS if ratio <= FLOOR_RATIO else FAIL
            verdicts.append(Verdict(target, status, f"{ratio:.2f}x ({top['ours']['time_s']:.3f} s)"))
        verdicts.append(_linear_memory(what, by_n, n_max))
    verdicts += _triton_against_torch(rows, n_max)
    return verdicts


def _linear_memory(what: str, by_n: dict[int, dict[str, Any]], n_max: int) -> Verdict:
    target = f"{what}: memory linear in N"
    small, big = by_n.get(n_max // 4), by_n.get(n_max)
    if small is None or big is None or not _ok(small.get("ours")) or not _ok(big.get("ours")):
        return Verdict(target, NOT_MEASURED, f"needs N = {n_max // 4:,} and {n_max:,}")
    growth = big["ours"]["peak_mb"] / max(small["ours"]["peak_mb"], 1e-9)
    status = PASS if growth <= 4 * LINEAR_SLACK else FAIL
    return Verdict(target, status, f"peak x{growth:.1f} for 4x the rows (linear: 4, quadratic: 16)")


def _triton_against_torch(rows: list[dict[str, Any]], n_max: int) -> list[Verdict]:
    verdicts = []
    at_max = {(r["loss"], r["dtype"], r["kernel"]): r for r in rows if r["n"] == n_max}
    for (loss, dtype, kernel), row in sorted(at_max.items()):
        torch_row = at_max.get((loss, dtype, "torch"))
        if kernel != "triton" or torch_row is None:
            continue
        target = f"{loss}, {dtype}: kernel=triton at least as fast as torch"
        if not _ok(row.get("ours")) or not _ok(torch_row.get("ours")):
            status = NOT_MEASURED if TRITON_DEFAULT.get(loss) else INFO
            verdicts.append(Verdict(target, status, "one of the two did not run"))
            continue
        speed = torch_row["ours"]["time_s"] / row["ours"]["time_s"]
        detail = f"triton {speed:.2f}x the speed of torch"
        if TRITON_DEFAULT.get(loss):
            verdicts.append(Verdict(target, PASS if speed >= 1.0 else FAIL, detail))
        else:
            advice = "make it the CUDA default" if speed >= 1.0 else "torch stays the default"
            verdicts.append(Verdict(target, INFO, f"{detail} (triton is opt-in: {advice})"))
    return verdicts


# ----------------------------------------------------------------------------------------- train
def train_verdicts(rows: list[dict[str, Any]], chunk: int = 64) -> list[Verdict]:
    """``rows``: ``benchmarks/train.py --json`` rows (mode: ``bare loop`` / ``direct`` / ``chunked (64)``,
    processes, deterministic, step_s)."""
    verdicts = []
    for deterministic in (False, True):
        bare = next(
            (r for r in rows if r["mode"] == "bare loop" and r["deterministic"] == deterministic), None
        )
        suffix = ", deterministic" if deterministic else ""
        for mode, share in (("direct", DIRECT_SHARE), (f"chunked ({chunk})", CHUNKED_SHARE)):
            target = f"trainer {mode}{suffix} >= {100 * share:.0f}% of the bare loop"
            mine = next(
                (
                    r
                    for r in rows
                    if r["mode"] == mode and r["processes"] == 1 and r["deterministic"] == deterministic
                ),
                None,
            )
            if bare is None or mine is None:
                if not deterministic:  # the deterministic rows inform; the targets are the default ones
                    verdicts.append(Verdict(target, NOT_MEASURED, "no such row in the benchmark's results"))
                continue
            got = bare["step_s"] / mine["step_s"]
            status = (PASS if got >= share else FAIL) if not deterministic else INFO
            verdicts.append(Verdict(target, status, f"{100 * got:.0f}%"))
    return verdicts


# ----------------------------------------------------------------------------------------- deepspeed
def deepspeed_verdicts(losses: dict[str, list[float] | None], reference: str = "ddp bf16") -> list[Verdict]:
    """``losses``: run name (``ddp bf16``, ``zero1 bf16 direct``, ...) -> the per-step losses (None: it failed)."""
    verdicts = []
    ref = losses.get(reference)
    for name, values in losses.items():
        if name == reference:
            continue
        target = f"DeepSpeed {name}: trains, losses finite and within tolerance of the DDP run"
        if not values:
            verdicts.append(Verdict(target, FAIL if values is None else NOT_MEASURED, "the run failed"))
            continue
        if not all(math.isfinite(v) for v in values):
            verdicts.append(Verdict(target, FAIL, f"non-finite loss at step {_first_bad(values)}"))
            continue
        if not ref:
            verdicts.append(Verdict(target, NOT_MEASURED, f"the reference run ({reference}) failed"))
            continue
        first = abs(values[0] - ref[0]) / abs(ref[0])
        tail = abs(_mean(values[-5:]) - _mean(ref[-5:])) / abs(_mean(ref[-5:]))
        ok = first <= DEEPSPEED_FIRST_STEP_RTOL and tail <= DEEPSPEED_TAIL_RTOL
        detail = (
            f"{len(values)} steps; step 1 differs by {100 * first:.2f}% (<= {100 * DEEPSPEED_FIRST_STEP_RTOL:g}%), "
            f"last 5 by {100 * tail:.1f}% (<= {100 * DEEPSPEED_TAIL_RTOL:g}%)"
        )
        verdicts.append(Verdict(target, PASS if ok else FAIL, detail))
    return verdicts


# ----------------------------------------------------------------------------------------- demo
def demo_verdicts(demo_exit: int | None, identical: bool | None, detail: str = "") -> list[Verdict]:
    verdicts = []
    if demo_exit is None:
        verdicts.append(Verdict("make demo on the GPU", NOT_MEASURED, "did not run"))
    else:
        status = PASS if demo_exit == 0 else FAIL
        verdicts.append(Verdict("make demo on the GPU", status, f"exit status {demo_exit}"))
    target = "two train.deterministic=true runs bit-identical"
    if identical is None:
        verdicts.append(Verdict(target, NOT_MEASURED, detail or "a run failed"))
    else:
        verdicts.append(Verdict(target, PASS if identical else FAIL, detail))
    return verdicts


# ----------------------------------------------------------------------------------------- the report
def section(part: str, header: str, body: str, verdicts: list[Verdict]) -> str:
    """The markdown a part appends to the day's report."""
    lines = [f"### Part `{part}`", "", header, ""]
    if body:
        lines += [body, ""]
    lines += [v.line() for v in verdicts] or [f"- **{NOT_MEASURED}** {part}: the part produced no result"]
    return "\n".join(lines) + "\n"


def _group(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["loss"], row["dtype"], row["kernel"]), []).append(row)
    return groups


def _ok(result: dict[str, Any] | None) -> bool:
    return bool(result) and "error" not in result and result.get("time_s", 0) > 0  # type: ignore[union-attr]


def _why(row: dict[str, Any], key: str) -> str:
    result = row.get(key) or {}
    return str(result.get("error", "no measurement"))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _first_bad(values: list[float]) -> int:
    return next(i for i, v in enumerate(values, start=1) if not math.isfinite(v))
