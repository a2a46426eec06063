"""The targets of the GPU acceptance check (``benchmarks/acceptance/gpu_check.py``): what each part must reach, judged from the
results the part recorded, and the report section it leaves.

A target is PASS or FAIL only on a measurement; a target whose measurement is missing (a part that crashed, a
test suite that collected nothing, a size that ran out of memory) is NOT MEASURED, never PASS. INFO lines carry
figures that decide nothing (the losses' torch path against the floor, now that the fused kernels are the CUDA
default). A part fails (exit status 1) on any FAIL or NOT MEASURED.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PASS, FAIL, NOT_MEASURED, INFO = "PASS", "FAIL", "NOT MEASURED", "INFO"

FLOOR_RATIO = 1.3
"""The default kernel (``kernel=auto``: on CUDA float32 blocks, bf16 inputs included, the fused Triton kernels) of every
loss at N = 65,536, d = 512 within this factor of the fp32 three-matmul floor (the 2026-11-27 H100 report: 1.14-1.27x).
The torch path, the default no more on a GPU, is reported against the floor as INFO."""
TF32_FLOOR_RATIO = 2.5
"""The default kernel with ``matmul_precision=tf32`` at N = 65,536, d = 512, float32 inputs: within this factor of the
TF32 floor (the three matmuls in TF32: 0.048 s on the 2026-11-27 H100, against 0.264 s in fp32)."""
DEFAULT_KERNELS = ("auto", "triton")
"""The ``--kernel`` rows that measure what a CUDA user gets by default (``auto`` takes ``triton`` there)."""
LINEAR_SLACK = 1.5
"""Memory linear in N: peak(N) / peak(N / 4) at most 4 x this (a quadratic tensor would give 16)."""
DIRECT_SHARE = 0.90
"""The trainer's direct step as a share of the bare loop's images/s (ResNet-50, 224 px, bf16, global batch 256):
the trainer's overhead where nothing is chunked (97% on the H200, 99% on the H100, gpu-2026-11-27.md)."""
GRADIENT_CACHE_SHARE, GRADIENT_CACHE_CHUNK = 0.95, 64
"""The trainer's eager chunked step at ``GRADIENT_CACHE_CHUNK`` as a share of the bare gradient cache's images/s at
the same chunk: the trainer's own overhead, the method's extra forward set apart (issue 50, point 3; it was at 94%
on the H200, gpu-2026-11-27.md). At other chunks the comparison informs: at 32 the trainer ran at 131% of that
reference, which issue 50 asks to check before leaning on it."""
CAPTURED_SHARES = {64: 0.65, 32: 0.55}
"""Chunk -> the chunked step with the captured chunk (``distributed.capture_chunk``, each mode judged on its own)
as a share of the bare loop's images/s (issue 50, point 3; ResNet-50, 224 px, bf16, global batch 256, on an H100 or
H200). Why these: eager, the method is bound by the host at small chunks (on the H200 the bare gradient cache kept
44% of the bare loop at 64 and 22% at 32, gpu-2026-11-27.md), while two passes of 64-image chunks are about 1.33x
the direct step's GPU work, so a step bound by the GPU would keep near 70% at 64: the captured chunk, one launch
per compiled graph, exists to come near that. The eager chunked step against the bare loop informs (it was a 70%
target at 64, which no gradient cache, bare or the trainer's, can reach eagerly)."""
CAPTURE_MODES = ("compile", "graphs")
"""The captured chunk's modes the ``train`` parts time (``benchmarks/train.py --plan``'s ``compile:C``,
``graphs:C``); a mode left unmeasured is NOT MEASURED, not excused by the other."""
DEEPSPEED_FIRST_STEP_RTOL = 0.05
"""DeepSpeed's first loss against the DDP run's: the same weights and batch, only the precision path differs, and
it differs more than rounding: DeepSpeed bf16/fp16 casts every parameter (BatchNorm's too) and runs the whole
forward in half precision, where the DDP run keeps float32 weights under autocast (BatchNorm in float32). bf16
keeps 8 bits of mantissa (0.4% per rounding) over ResNet-18's ~20 layers, and the ranking loss turns a shift of
the embeddings into a larger one of the loss: 5% allows that, while a real fault (inputs cast wrong, a layer
left out, the wrong loss scale) moves step 1 by far more."""
DEEPSPEED_TAIL_RTOL = 0.10
"""The mean loss of the last 5 of 20 steps against the DDP run's (the trajectories drift apart in bf16/fp16)."""
TRITON_DEFAULT: dict[str, bool] = {"fastap": True, "pnp_dq": True, "smooth_ap": True}
"""Where ``kernel=triton`` is the CUDA default (``kernel=auto``, since the 2026-11-27 H100 report showed it faster and
exact for all three): there it must stay at least as fast as torch, and exact."""
TRITON_LOSS_RTOL, TRITON_GRAD_RTOL = 1e-5, 1e-3
"""``kernel=triton`` is exact when, on the same inputs, its loss is within ``TRITON_LOSS_RTOL`` of the torch path's
(relative) and its gradient's largest difference from torch's within ``TRITON_GRAD_RTOL`` of torch's largest entry
(``benchmarks/loss.py`` records both at every N up to 16,384; the tolerances of the CUDA test in
``tests/losses/test_kernels.py``). Both paths compute in float32, bf16 inputs too (cast first)."""
TRITON_GRAD_RTOL_BY_DTYPE = {"bfloat16": 4e-3}
"""bf16 inputs get a bf16 gradient: each entry rounded to 8 bits of mantissa (2^-8 = 3.9e-3 of itself), so two paths
a few 1e-6 apart in float32 may round to neighbouring bf16 values (1.2e-3 of the largest entry on the H100)."""


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
FAILURE_TEXT_CHARS = 2_000
"""How much of a failed test's report (its end: the assertion and what the test printed) the GPU report keeps."""


def junit_results(path: Path) -> dict[str, Any] | None:
    """A pytest ``--junitxml`` file's counts (tests, failures, errors, skipped, xfailed) and the tests behind them
    (``failed``: names; ``skips``: ``name (reason)``, xfails left out; ``failure_texts``: name -> the end of its
    failure's report, what a reader of the GPU report needs to see why); None when it is missing or broken."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    results: dict[str, Any] = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "xfailed": 0}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            results[key] += int(suite.get(key, 0))
    results["failed"], results["skips"], results["failure_texts"] = [], [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name', '?')}"
        problem = case.find("failure")
        problem = case.find("error") if problem is None else problem
        if problem is not None:
            results["failed"].append(name)
            text = (problem.text or "").strip() or problem.get("message", "") or "no report"
            results["failure_texts"][name] = text[-FAILURE_TEXT_CHARS:]
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            results["xfailed"] += 1
        elif skipped is not None:
            results["skips"].append(f"{name} ({skipped.get('message', 'no reason given')})")
    return results


def tests_verdicts(results: dict[str, dict[str, Any] | None]) -> list[Verdict]:
    """``results``: suite name (``CUDA``, ``multi-process``) -> ``junit_results`` (None: the run left no report),
    with ``exit``: pytest's exit status (None: stopped at the part's time limit; 2: interrupted, by its session
    timeout too). On the GPU machine every test must run: one skipped (Triton or DeepSpeed missing, no GPU seen)
    was not measured, and neither were the tests a stopped run never reached."""
    verdicts = []
    for name, counts in results.items():
        target = f"every {name} test green"
        if counts is None:
            verdicts.append(Verdict(target, NOT_MEASURED, "pytest left no report (crashed or timed out)"))
            continue
        ran = counts["tests"] - counts["skipped"]
        bad = counts["failures"] + counts["errors"]
        unmeasured = counts["skipped"] - counts.get("xfailed", 0)
        exit_status = counts.get("exit", 0)
        summary = f"{ran} ran, {bad} failed, {counts['skipped']} skipped"
        if bad:
            verdicts.append(Verdict(target, FAIL, summary + _named(": failed ", counts.get("failed", []))))
        elif ran == 0:
            verdicts.append(Verdict(target, NOT_MEASURED, summary + ": nothing ran"))
        elif exit_status is None or exit_status == 2:
            verdicts.append(
                Verdict(target, NOT_MEASURED, summary + ": stopped at its time limit, the rest never ran")
            )
        elif unmeasured:
            verdicts.append(
                Verdict(target, NOT_MEASURED, summary + _named(": skipped ", counts.get("skips", [])))
            )
        elif exit_status != 0:
            verdicts.append(
                Verdict(target, NOT_MEASURED, summary + f": pytest exited with status {exit_status}")
            )
        else:
            verdicts.append(Verdict(target, PASS, summary))
    return verdicts


def _named(prefix: str, names: list[str], most: int = 5) -> str:
    if not names:
        return ""
    more = f"; and {len(names) - most} more" if len(names) > most else ""
    return prefix + "; ".join(names[:most]) + more


# ----------------------------------------------------------------------------------------- loss
def loss_verdicts(rows: list[dict[str, Any]], n_max: int = 65_536) -> list[Verdict]:
    """``rows``: ``benchmarks/loss.py --json`` rows (loss, n, dtype, kernel, ours / floor: {time_s, peak_mb} or
    {error})."""
    tf32_rows = [r for r in rows if r.get("matmul_precision") == "tf32"]
    rows = [r for r in rows if r.get("matmul_precision", "highest") == "highest"]
    verdicts = []
    for (loss, dtype, kernel), group in sorted(_group(rows).items()):
        by_n = {r["n"]: r for r in group}
        what = f"{loss}, {dtype} inputs, kernel={kernel}"
        top = by_n.get(n_max)
        default = kernel in DEFAULT_KERNELS
        target = f"{what}: N = {n_max:,} within {FLOOR_RATIO:g}x of the fp32 floor"
        if not default:
            target = f"{what}: N = {n_max:,} against the fp32 floor (not the CUDA default)"
        if top is None or not _ok(top.get("ours")) or not _ok(top.get("floor")):
            why = _why(top, "ours") if top else f"N = {n_max:,} was not run"
            verdicts.append(Verdict(target, NOT_MEASURED if default else INFO, why))
        else:
            ratio = top["ours"]["time_s"] / top["floor"]["time_s"]
            status = (PASS if ratio <= FLOOR_RATIO else FAIL) if default else INFO
            verdicts.append(Verdict(target, status, f"{ratio:.2f}x ({top['ours']['time_s']:.3f} s)"))
        verdicts.append(_linear_memory(what, by_n, n_max))
    verdicts += _triton_against_torch(rows, n_max)
    return verdicts + tf32_verdicts(tf32_rows, n_max)


TF32_LOSSES = ("fastap", "pnp_dq", "smooth_ap")


def tf32_verdicts(rows: list[dict[str, Any]], n_max: int = 65_536) -> list[Verdict]:
    """The default kernel's ``matmul_precision=tf32`` rows (float32 inputs) at ``n_max`` against the TF32 floor:
    one verdict per loss, NOT MEASURED where its row, or the floor, is missing.

    ``matmul_precision=tf32`` takes all three matmuls of each chunk (the similarity Q E^T and the gradients G E,
    G^T Q) to TF32, so the TF32 floor (the same three matmuls in TF32) is what no kernel can beat."""
    at_max = {
        r["loss"]: r
        for r in rows
        if r["n"] == n_max and r["kernel"] in DEFAULT_KERNELS and r.get("dtype", "float32") == "float32"
    }
    verdicts = []
    for loss in TF32_LOSSES:
        target = (
            f"{loss}, float32 inputs, default kernel, matmul_precision=tf32: N = {n_max:,} within "
            f"{TF32_FLOOR_RATIO:g}x of the TF32 floor"
        )
        row = at_max.get(loss)
        if row is None:
            verdicts.append(Verdict(target, NOT_MEASURED, f"N = {n_max:,} was not run"))
            continue
        if not _ok(row.get("ours")) or not _ok(row.get("floor_tf32")):
            missing = "ours" if not _ok(row.get("ours")) else "floor_tf32"
            what = "the TF32 floor: " if missing == "floor_tf32" else ""
            verdicts.append(Verdict(target, NOT_MEASURED, what + _why(row, missing)))
            continue
        ours_s, tf32_s = row["ours"]["time_s"], row["floor_tf32"]["time_s"]
        ratio = ours_s / tf32_s
        detail = f"{ratio:.2f}x ({ours_s:.3f} s, TF32 floor {tf32_s:.3f} s)"
        verdicts.append(Verdict(target, PASS if ratio <= TF32_FLOOR_RATIO else FAIL, detail))
    return verdicts


PRECISION_TABLE_TARGET = "the precision table (loss change, gradient cosine, time) measured on the GPU"


def precision_verdicts(rows: list[dict[str, Any]] | None) -> list[Verdict]:
    """``rows``: ``benchmarks/loss_precision.py --json`` rows (loss, precision, loss_change, grad_cosine,
    grad_change, time_highest_s, time_s); None or empty: the run left nothing. The figures inform (INFO, one line
    per faster precision: its worst loss change and gradient cosine over the losses, its time against highest);
    the table's absence is NOT MEASURED."""
    if not rows:
        return [Verdict(PRECISION_TABLE_TARGET, NOT_MEASURED, "benchmarks/loss_precision.py left no rows")]
    devices = {r.get("device") for r in rows}
    if devices != {"cuda"}:  # on CPU tf32 is float32: no change, no speed-up, nothing learnt
        return [Verdict(PRECISION_TABLE_TARGET, NOT_MEASURED, f"measured on {', '.join(map(str, devices))}")]
    verdicts = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        mine = [r for r in rows if r["precision"] == precision]
        detail = (
            f"{len(mine)} losses: |d loss| <= {max(r['loss_change'] for r in mine):.1e}, gradient cosine >= "
            f"{min(r['grad_cosine'] for r in mine):.4f}, time "
            + ", ".join(f"{r['loss']} {r['time_s'] / r['time_highest_s']:.2f}x" for r in mine)
            + " of highest's"
        )
        verdicts.append(Verdict(f"{PRECISION_TABLE_TARGET}: matmul_precision={precision}", INFO, detail))
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
        if kernel not in DEFAULT_KERNELS or torch_row is None:
            continue
        target = f"{loss}, {dtype}: kernel={kernel} at least as fast as torch"
        if not _ok(row.get("ours")) or not _ok(torch_row.get("ours")):
            status = NOT_MEASURED if TRITON_DEFAULT.get(loss) else INFO
            verdicts.append(Verdict(target, status, "one of the two did not run"))
            continue
        speed = torch_row["ours"]["time_s"] / row["ours"]["time_s"]
        exact, exactness = _triton_exact(rows, loss, dtype, kernel)
        detail = f"triton {speed:.2f}x the speed of torch; {exactness}"
        if TRITON_DEFAULT.get(loss):
            status = FAIL if speed < 1.0 or exact is False else NOT_MEASURED if exact is None else PASS
            verdicts.append(Verdict(target, status, detail))
        else:
            advice = "make it the CUDA default" if speed >= 1.0 and exact else "torch stays the default"
            verdicts.append(Verdict(target, INFO, f"{detail} (triton is opt-in: {advice})"))
    return verdicts


def _triton_exact(
    rows: list[dict[str, Any]], loss: str, dtype: str, kernel: str = "triton"
) -> tuple[bool | None, str]:
    """Whether ``kernel=triton`` matched the torch path (None: not measured), and what was measured: the worst
    of the sizes where ``benchmarks/loss.py`` compared the two on the same inputs."""
    compared = [
        (r["n"], r["ours"]["exact"])
        for r in rows
        if (r["loss"], r["dtype"], r["kernel"]) == (loss, dtype, kernel)
        and _ok(r.get("ours"))
        and "exact" in r["ours"]
    ]
    if not compared:
        return None, "exactness against torch not measured"
    loss_rel = max(e["loss_rel"] for _, e in compared)
    grad_rel = max(e["grad_rel"] for _, e in compared)
    grad_rtol = TRITON_GRAD_RTOL_BY_DTYPE.get(dtype, TRITON_GRAD_RTOL)
    exact = loss_rel <= TRITON_LOSS_RTOL and grad_rel <= grad_rtol
    return exact, (
        f"{'exact' if exact else 'NOT exact'} against torch at N <= {max(n for n, _ in compared):,} (loss "
        f"{loss_rel:.1e} <= {TRITON_LOSS_RTOL:g}, gradient {grad_rel:.1e} <= {grad_rtol:g})"
    )


# ----------------------------------------------------------------------------------------- train
def train_verdicts(rows: list[dict[str, Any]], chunk: int = 64, direct: bool = True) -> list[Verdict]:
    """``rows``: ``benchmarks/train.py --json`` rows (mode: ``bare loop``, ``direct``, ``chunked (64)``, ``chunked
    (64), captured (compile)``, ``bare gradient cache (64)``, ...; processes, deterministic, step_s: the step
    without the wait for data, total_s: with it; or ``error``: that configuration crashed; or ``not_measured``:
    why the benchmark did not start it, or stopped it, within its time budget).

    The targets of a ``train`` part whose rows are at ``chunk``: the captured chunk in each of ``CAPTURE_MODES``
    against the bare loop (``CAPTURED_SHARES``), at ``GRADIENT_CACHE_CHUNK`` the eager chunked step against the
    bare gradient cache, and with ``direct`` the direct step against the bare loop. They compare the step alone
    (the data wait is the loader's, not the step's overhead); the images/s with the wait are reported beside.
    Every other row informs: each chunked row and each bare gradient cache against the bare loop, each chunked
    row against the gradient cache of its chunk, the deterministic rows against the deterministic bare loop. A
    trainer that crashed FAILs a target; a row the budget left out, or a reference that crashed, leaves it NOT
    MEASURED with the reason."""
    plain = [r for r in rows if r.get("processes", 1) == 1 and not r.get("deterministic")]
    bare = _train_row(plain, "bare loop")
    verdicts = [_direct_verdict(_train_row(plain, "direct"), bare, "", DIRECT_SHARE)] if direct else []
    judged: set[tuple[str, str]] = set()  # (row, reference) pairs that are targets, not INFO
    if chunk == GRADIENT_CACHE_CHUNK:
        eager, cache = f"chunked ({chunk})", f"bare gradient cache ({chunk})"
        verdicts.append(_compare(
            f"trainer chunked ({chunk}) >= {100 * GRADIENT_CACHE_SHARE:.0f}% of the bare gradient cache ({chunk})'s "
            "images/s (the trainer's own overhead)",
            _train_row(plain, eager), _train_row(plain, cache), GRADIENT_CACHE_SHARE,
        ))  # fmt: skip
        judged.add((eager, cache))
    share = CAPTURED_SHARES.get(chunk)
    for mode in CAPTURE_MODES if share is not None else ():
        captured = f"chunked ({chunk}), captured ({mode})"
        target = f"trainer {captured} >= {100 * (share or 0):.0f}% of the bare loop's images/s"
        verdicts.append(_compare(target, _train_row(plain, captured), bare, share))
        judged.add((captured, "bare loop"))
    return verdicts + _train_info(rows, judged, direct)


def _train_row(rows: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["mode"] == mode), None)


def _direct_verdict(
    mine: dict[str, Any] | None, bare: dict[str, Any] | None, suffix: str, share: float | None
) -> Verdict:
    """The direct step against the bare loop, with the images/s with the data wait beside: a target at ``share``
    (``DIRECT_SHARE``), INFO without one (the deterministic rows)."""
    target = (
        f"trainer direct{suffix} >= {100 * DIRECT_SHARE:.0f}% of the bare loop's images/s "
        "(step time, the wait for data excluded)"
    )
    if mine is None or bare is None or not _measured(mine) or not _measured(bare):
        return _compare(target, mine, bare, share)
    got = bare["step_s"] / mine["step_s"]
    batch = mine["global_batch"]
    detail = f"{100 * got:.0f}% ({batch / mine['step_s']:.0f} images/s"
    if "total_s" in mine:
        detail += f"; with the data wait {batch / mine['total_s']:.0f}, {100 * bare['step_s'] / mine['total_s']:.0f}%"
    status = INFO if share is None else PASS if got >= share else FAIL
    return Verdict(target, status, detail + ")")


def _train_info(rows: list[dict[str, Any]], judged: set[tuple[str, str]], direct: bool) -> list[Verdict]:
    """INFO: every 1-process row that no target judged, against the bare loop (deterministic rows: the
    deterministic bare loop), and each chunked row against the bare gradient cache of its chunk."""
    verdicts = []
    for r in rows:
        det = bool(r.get("deterministic"))
        same = [x for x in rows if x.get("processes", 1) == 1 and bool(x.get("deterministic")) == det]
        bare, mode = _train_row(same, "bare loop"), r["mode"]
        suffix = ", deterministic" if det else ""
        if r.get("processes", 1) != 1 or mode == "bare loop" or (mode == "direct" and direct and not det):
            continue
        if mode == "direct":
            verdicts.append(_direct_verdict(r, bare, suffix, None))
            continue
        if mode.startswith("bare gradient cache"):
            verdicts.append(
                _compare(f"{mode}{suffix} against the bare loop (the method's own cost)", r, bare, None)
            )
            continue
        if (mode, "bare loop") not in judged or det:
            verdicts.append(_compare(f"trainer {mode}{suffix} against the bare loop", r, bare, None))
        c = int(mode.split("(")[1].split(")")[0])
        cache = _train_row(same, f"bare gradient cache ({c})")
        if cache is not None and ((mode, cache["mode"]) not in judged or det):
            verdicts.append(
                _compare(f"trainer {mode}{suffix} against the bare gradient cache ({c})", r, cache, None)
            )
    return verdicts


def _measured(row: dict[str, Any]) -> bool:
    return "error" not in row and "not_measured" not in row


def _compare(
    target: str, mine: dict[str, Any] | None, ref: dict[str, Any] | None, share: float | None
) -> Verdict:
    """``mine``'s images/s as a share of ``ref``'s: PASS / FAIL against ``share``, INFO without one; FAIL where
    ``mine`` crashed; NOT MEASURED (INFO without a share) where either has no figures."""
    unmeasured = NOT_MEASURED if share else INFO
    if mine is not None and "error" in mine:  # a crash is a fault, whatever the comparison
        who = "the trainer" if mine["mode"].startswith(("direct", "chunked")) else f"the {mine['mode']}"
        return Verdict(target, FAIL, f"{who} crashed: {mine['error']}")
    if mine is not None and "not_measured" in mine:
        return Verdict(target, unmeasured, mine["not_measured"])
    if ref is not None and not _measured(ref):
        why = f"crashed: {ref['error']}" if "error" in ref else f"was not measured: {ref['not_measured']}"
        return Verdict(target, unmeasured, f"the {ref['mode']} {why}")
    if mine is None or ref is None:
        return Verdict(target, unmeasured, "no such row in the results")
    got = ref["step_s"] / mine["step_s"]
    batch = mine["global_batch"]
    detail = f"{100 * got:.0f}% ({batch / mine['step_s']:.0f} against {ref['global_batch'] / ref['step_s']:.0f} images/s)"
    if mine.get("compile_s"):
        first = " + ".join(f"{v:.1f}" for v in mine["compile_s"].values())
        detail += f"; compile time {first} s (the first call of each compiled pass)"
    return Verdict(target, (PASS if got >= share else FAIL) if share else INFO, detail)


# ----------------------------------------------------------------------------------------- graphs
GRAPHS_BEYOND_SHARE = 0.01
"""``benchmarks/acceptance/graphs_check.py``: two runs' gradients agree "within the spread" when no tensor has more
than this share of its entries further apart than two correct eager runs are (the tensor's tolerance). A correct
variant differs by rounding of the spread's size, so few entries lie past the spread's worst; a chunk lost or
counted twice moves most of them (the check's control, the reference a quarter too large, shows how many)."""
GRAPHS_COMPARISONS = ("graphs - compile", "graphs - eager", "compile - eager")
GRAPHS_PRECISIONS = ("fp32", "bf16")
GRAPHS_CONTROL = "control - eager"


def graphs_verdicts(record: dict[str, Any] | None) -> list[Verdict]:
    """``record``: ``graphs_check.py --json``'s (None: it left none). Per precision and comparison, both steps:
    PASS when no tensor has more than ``GRAPHS_BEYOND_SHARE`` of its entries beyond its tolerance, FAIL when one
    has (or a run crashed), NOT MEASURED where the rows are missing or the control went unseen (then the spread
    is too wide to see a chunk counted twice, and a PASS would mean nothing). INFO: the control."""
    rows = (record or {}).get("rows", [])
    verdicts = []
    for precision in GRAPHS_PRECISIONS:
        mine = [r for r in rows if r["precision"] == precision]
        spread_error = next((r["error"] for r in mine if r["comparison"] == "spread"), None)
        controls = [r for r in mine if r["comparison"] == GRAPHS_CONTROL]
        unseen = [r["step"] for r in controls if not _beyond(r)]
        what = f"{precision}{', TF32 off' if precision == 'fp32' else ' autocast'}"
        for comparison in GRAPHS_COMPARISONS:
            target = f"the captured chunk's gradients, {comparison}, within the eager spread ({what})"
            these = [r for r in mine if r["comparison"] == comparison]
            crashed = [r for r in these if "error" in r]
            bad = [r for r in these if "error" not in r and _beyond(r)]
            detail = "; ".join(f"step {r['step']}: {_graphs_figures(r)}" for r in these)
            if crashed:
                verdicts.append(Verdict(target, FAIL, f"step {crashed[0]['step']}: {crashed[0]['error']}"))
            elif not these:
                why = (
                    f"the eager runs failed: {spread_error}"
                    if spread_error
                    else "no result (stopped at its time limit?)"
                )
                verdicts.append(Verdict(target, NOT_MEASURED, why))
            elif bad:
                verdicts.append(Verdict(target, FAIL, detail))
            elif unseen or not controls:
                why = f"the control was not seen at step {unseen[0]}" if unseen else "no control"
                detail = f"{why}: the spread is too wide to tell; {detail}"
                verdicts.append(Verdict(target, NOT_MEASURED, detail))
            else:
                verdicts.append(Verdict(target, PASS, detail))
        if controls:
            detail = "; ".join(f"step {r['step']}: {_graphs_figures(r)}" for r in controls)
            verdicts.append(Verdict(f"the control, the reference x1.25, is seen ({what})", INFO, detail))
    return verdicts


def _beyond(row: dict[str, Any]) -> list[str]:
    """The tensors of a comparison row with more than ``GRAPHS_BEYOND_SHARE`` of their entries beyond tolerance."""
    return [name for name, (_, _, share) in row["per_tensor"].items() if share > GRAPHS_BEYOND_SHARE]


def graphs_line(row: dict[str, Any]) -> str:
    """A ``graphs_check.py`` row in one line: its comparison, its worst tensor against its tolerance, the tensors
    beyond."""
    return f"{row['comparison']}: {_graphs_figures(row)}"


def _graphs_figures(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    per = row["per_tensor"]
    worst = max(per, key=lambda n: per[n][0] / per[n][1] if per[n][1] > 0 else math.inf)
    beyond = _beyond(row)
    most = max(beyond, key=lambda n: per[n][2]) if beyond else None
    return (
        f"worst {per[worst][0]:.2e} in {worst} (tolerance {per[worst][1]:.2e}); {len(beyond)} of {len(per)} "
        f"tensors with more than {GRAPHS_BEYOND_SHARE:.0%} of their entries beyond"
        + (f", most {per[most][2]:.1%} in {most}" if most else "")
    )


# ----------------------------------------------------------------------------------------- deepspeed
def deepspeed_verdicts(losses: dict[str, list[float] | None], reference: str = "ddp bf16") -> list[Verdict]:
    """``losses``: run name (``ddp bf16``, ``zero1 bf16 direct``, ...) -> the per-step losses (None: it failed;
    empty: none logged, the run stopped at its time limit)."""
    verdicts = []
    ref = losses.get(reference)
    for name, values in losses.items():
        if name == reference:
            continue
        target = f"DeepSpeed {name}: trains, losses finite and within tolerance of the DDP run"
        if not values:
            why = "the run failed" if values is None else "no loss logged (stopped at its time limit?)"
            verdicts.append(Verdict(target, FAIL if values is None else NOT_MEASURED, why))
            continue
        if not all(math.isfinite(v) for v in values):
            verdicts.append(Verdict(target, FAIL, f"non-finite loss at step {_first_bad(values)}"))
            continue
        if not ref:
            verdicts.append(Verdict(target, NOT_MEASURED, f"the reference run ({reference}) has no losses"))
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


# ----------------------------------------------------------------------------------------- grads
GRAD_RTOL: dict[str, tuple[float, float]] = {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 0.3)}
"""precision -> (whole update, worst tensor): the most the chunked step's weight change may differ from the direct
step's, relative (``benchmarks/acceptance/grad_check.py``: one SGD step, lr 1, from the same weights and batch, so the change
is the applied gradient). fp32 (TF32 off): the two steps add the same per-row terms in another order (four
backwards accumulated against one) and the convolutions may pick other kernels for a chunk's shape: float32
rounding, 1.8e-6 of the whole and 5.8e-6 of the worst tensor measured on CPU (tiny_cnn, 4 chunks; ResNet-18 at 32
px: 2.5e-6 and 4.5e-6); 1e-4 and 1e-3 leave room for ResNet-50's depth and for a tensor whose update is small
against the rounding of the others (the head's bias, whose gradient nearly cancels under L2-normalised
embeddings). bf16: the forwards round to 8 bits (0.4 %) and a chunk's shape changes the kernels' accumulation
order, so the two steps' embeddings differ by bf16 rounding, which FastAP's soft histograms and the backward carry
into the gradient: 0.5 % of the whole and 5.7 % of the worst tensor measured on CPU under autocast (ResNet-18:
0.44 % and 6.4 %), 0.7 % and 6.7 % under DeepSpeed ZeRO-1/2 bf16 (buffers in bf16: on CPU, frozen BatchNorm with
DeepSpeed's float32 buffers and bf16 weights does not run); 5 % and 30 %. A step that keeps only the last of 4
chunks is off by the order of the update itself (1.76 of the whole measured, 16 on the head's bias): far outside
both.

A row that measured its noise floor (``floor_rel``, ``floor_worst_rel``: two correct direct steps, the convolutions
in two memory layouts) may be off by up to ``GRAD_FLOOR_FACTOR`` times it, never more than ``GRAD_FLOOR_CAP``:
ResNet-50 freshly initialised amplifies float32 rounding into a 1-2 % difference between two correct steps (2.1 %
between layouts on CPU, 1.5 % for the chunked step on an H200, 2026-11-26), which no fixed 1e-4 can tell from a
fault. A lost chunk (75 % of a 4-chunk update) stays far outside the cap."""
GRAD_FLOOR_FACTOR = 2.0
"""How many times its own noise floor a chunked step may be off."""
GRAD_FLOOR_CAP = 0.1
"""The most the noise floor may widen a tolerance to: a step 10 % off fails whatever the floor."""


def grads_verdicts(
    rows: list[dict[str, Any]], expected: list[tuple[str, str, int, str]], gpus: int
) -> list[Verdict]:
    """``rows``: ``benchmarks/acceptance/grad_check.py --json`` rows; ``expected``: the runs asked for, (engine, precision,
    processes, fault). A real run (fault ``none``) PASSes within ``GRAD_RTOL``; a broken build (a fault) is the
    check's own control: it PASSes when the check FAILs that build. DDP over NCCL with 2+ processes needs 2+ GPUs:
    with fewer it is NOT MEASURED, never passed."""
    by_key = {(r["engine"], r["precision"], r["processes"], r.get("fault", "none")): r for r in rows}
    verdicts = []
    for key in expected:
        engine, precision, processes, fault = key
        row = by_key.get(key)
        where = f"{engine}, {precision}, {processes} process{'es' if processes > 1 else ''}"
        if fault == "none":
            target = f"chunked step's update == direct step's: {where}"
            if row is None:
                verdicts.append(Verdict(target, NOT_MEASURED, "no result (stopped at its time limit?)"))
            elif "error" in row:
                verdicts.append(Verdict(target, FAIL, f"crashed: {row['error']}"))
            else:
                within, detail = _update_within(row)
                verdicts.append(Verdict(target, PASS if within else FAIL, detail))
            continue
        target = f"the check FAILs a broken build ({fault}): {where}"
        if row is None or "error" in row:
            why = (
                "no result (stopped at its time limit?)"
                if row is None
                else f"the broken build crashed: {row['error']}"
            )
            verdicts.append(Verdict(target, NOT_MEASURED, why))
            continue
        within, detail = _update_within(row)
        if within:
            verdicts.append(
                Verdict(target, FAIL, "the check PASSED it, so it cannot catch lost chunks: " + detail)
            )
        else:
            verdicts.append(Verdict(target, PASS, "caught: " + detail))
    if gpus < 2:
        verdicts.append(Verdict("chunked step's update == direct step's: DDP over NCCL, 2+ processes", NOT_MEASURED,
                                f"{gpus} GPU visible: it needs one per process, 2 or more"))  # fmt: skip
    return verdicts


def _update_within(row: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``row``'s chunked update is within ``GRAD_RTOL`` of its direct one, or within the row's noise floor
    (``GRAD_FLOOR_FACTOR``, ``GRAD_FLOOR_CAP``), and the figures."""
    whole_tol, worst_tol = GRAD_RTOL[row["precision"]]
    floor = ""
    if "floor_rel" in row:
        floor_whole, floor_worst = row["floor_rel"], row["floor_worst_rel"]
        whole_tol = _widened(whole_tol, floor_whole)
        worst_tol = _widened(worst_tol, floor_worst)
        floor = f"; two direct steps (two layouts) {floor_whole:.2e} apart, worst tensor {floor_worst:.2e}"
    norm, whole, worst = row["direct_norm"], row["update_rel"], row["worst_rel"]
    if not (math.isfinite(norm) and norm > 0):
        return False, f"the direct step's update has norm {norm}: nothing to compare"
    detail = (
        f"update off by {whole:.2e} (<= {whole_tol:.3g}), worst tensor {row['worst_tensor']} by {worst:.2e} "
        f"(<= {worst_tol:.3g}){floor}; {row['chunks']} chunks of {row['chunk']}"
    )
    if "peak_mb_direct" in row:
        detail += f"; peak {row['peak_mb_direct']:.0f} MB direct, {row['peak_mb_chunked']:.0f} MB chunked"
    return whole <= whole_tol and worst <= worst_tol, detail


def _widened(tolerance: float, floor: float) -> float:
    """``tolerance``, or ``GRAD_FLOOR_FACTOR`` times the noise ``floor`` where that is larger, up to the cap (a
    floor that is not a finite number widens nothing)."""
    if not math.isfinite(floor):
        return tolerance
    return max(tolerance, min(GRAD_FLOOR_FACTOR * floor, GRAD_FLOOR_CAP))


# ----------------------------------------------------------------------------------------- feed
FEED_OVERLAP_FACTOR = 1.25
"""The fed step (``benchmarks/acceptance/feed_check.py``: ``next(feed)`` and the step) at most this many times the longer of
the on-device step and the loader alone: the feed hides the shorter behind the longer. A feed without overlap
takes their sum, so it fails wherever the shorter is at least a quarter of the longer; where it is less, no
feed could be told from another (INFO). The same bound holds the step without ``data_time`` to the on-device
step: ``data_time`` must hold the whole wait for data, or the ``train`` part would blame the step for it."""
FEED_STEP_FACTOR = 1.10
"""With workers the fed step at most this many times the on-device step: the data path costs the GPU at most a
tenth of its time (with ``num_workers=0`` the reader thread decodes alone, which a GPU step outruns: INFO)."""


def feed_verdicts(rows: list[dict[str, Any]], workers: list[int]) -> list[Verdict]:
    """``rows``: ``benchmarks/acceptance/feed_check.py --json`` rows (workers, feed, device_s, loader_s, fed_s, wait_s);
    ``workers``: the ``num_workers`` values asked for (a missing one is NOT MEASURED)."""
    verdicts = []
    by_workers = {r["workers"]: r for r in rows}
    for w in workers:
        row = by_workers.get(w)
        what = f"feed, num_workers={w}"
        if row is None:
            verdicts.append(
                Verdict(f"{what}: measured", NOT_MEASURED, "no result (stopped at its time limit?)")
            )
            continue
        device, loader, fed, wait = row["device_s"], row["loader_s"], row["fed_s"], row["wait_s"]
        figures = (
            f"fed step {1000 * fed:.1f} ms = {fed / device:.2f}x the on-device step ({1000 * device:.1f} ms); "
            f"loader alone {1000 * loader:.1f} ms ({loader / device:.2f}x)"
        )
        longer, shorter = max(device, loader), min(device, loader)
        target = f"{what}: reading overlaps the step (fed <= {FEED_OVERLAP_FACTOR:g}x the longer of the two)"
        if fed > FEED_OVERLAP_FACTOR * longer:
            why = f"; without overlap it would be {(device + loader) / longer:.2f}x the longer"
            verdicts.append(Verdict(target, FAIL, figures + why))
        elif shorter < (FEED_OVERLAP_FACTOR - 1) * longer:
            verdicts.append(
                Verdict(target, INFO, figures + ": the shorter is too short to tell overlap from none")
            )
        else:
            verdicts.append(Verdict(target, PASS, figures))
        step_alone = fed - wait
        target = f"{what}: data_time is the whole wait (fed step - data_time <= {FEED_OVERLAP_FACTOR:g}x on-device)"
        status = PASS if step_alone <= FEED_OVERLAP_FACTOR * device else FAIL
        detail = f"data_time {1000 * wait:.1f} ms; the step without it {step_alone / device:.2f}x the on-device step"
        verdicts.append(Verdict(target, status, detail))
        target = f"{what}: fed step within {FEED_STEP_FACTOR:g}x of the on-device step"
        within = fed <= FEED_STEP_FACTOR * device
        advice = (
            "" if within or loader <= device else ": the loader alone is slower than the step (more workers)"
        )
        status = INFO if w == 0 else PASS if within else FAIL
        verdicts.append(Verdict(target, status, figures + advice))
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


# ----------------------------------------------------------------------------------------- chunk
CHUNK_SHARE = 0.5
"""``distributed.chunk_size=auto``'s chunk at least this share of the largest chunk that fits (found by bisection):
the memory budget keeps ``memory_fraction`` (0.8) of the free memory and counts the fixed costs from above, so a
chunk near the largest is not expected; below half of it the probe over-counts."""


def chunk_verdicts(
    record: dict[str, Any] | None, clean: dict[str, Any] | None, control: dict[str, Any] | None
) -> list[Verdict]:
    """``record``: ``benchmarks/acceptance/chunk_check.py``'s (None: it left none); ``clean`` / ``control``: its sanitizer
    runs (``--sanitizer clean`` / ``control``)."""
    return [*_chunk_fits(record), *_sanitizer(clean, control)]


def _chunk_fits(record: dict[str, Any] | None) -> list[Verdict]:
    setup = (record or {}).get("setup", "the real setup")
    starts = f"chunk_size=auto on {setup}: starts and trains without out-of-memory"
    share = f"chunk_size=auto's chunk >= {CHUNK_SHARE:g} of the largest chunk that fits (bisection), never above it"
    if not record:
        return [Verdict(starts, NOT_MEASURED, "the check left no record"), Verdict(share, NOT_MEASURED, "")]
    if "error" in record:
        return [
            Verdict(starts, FAIL, f"the trainer did not start: {record['error']}"),
            Verdict(share, NOT_MEASURED, ""),
        ]
    chosen, local = record.get("chosen"), record.get("local_batch")
    how = "backed off in the trial step" if record.get("backed_off") else "confirmed by the trial step"
    if record.get("oom_at_chosen") is None:
        verdicts = [Verdict(starts, NOT_MEASURED, "no step ran at the chosen chunk")]
    elif record["oom_at_chosen"]:
        verdicts = [
            Verdict(starts, FAIL, f"out of memory in a training step at the chosen chunk of {chosen} ({how})")
        ]
    else:
        verdicts = [
            Verdict(starts, PASS, f"chunk {chosen} of the local batch of {local}, {how}; training steps ran")
        ]
    largest = record.get("largest_fitting")
    if largest is None or chosen is None:
        verdicts.append(Verdict(share, NOT_MEASURED, "the bisection did not finish"))
    elif largest >= local and chosen >= local:
        verdicts.append(
            Verdict(share, NOT_MEASURED, f"the local batch of {local} fits whole: no chunk to judge")
        )
    elif chosen > largest:
        verdicts.append(
            Verdict(share, FAIL, f"chosen {chosen} > largest that fits {largest}: the probe under-counts")
        )
    else:
        ratio = chosen / max(largest, 1)
        status = PASS if ratio >= CHUNK_SHARE else FAIL
        why = "" if status == PASS else ": the probe over-counts"
        verdicts.append(Verdict(share, status, f"{chosen} of {largest}, {ratio:.2f}{why}"))
    if record.get("peak_reserved_mb") is not None:
        verdicts.append(Verdict("peak reserved memory at the chosen chunk", INFO,
                                f"{record['peak_reserved_mb'] / 1024:.1f} GiB reserved, "
                                f"{record.get('peak_allocated_mb', 0) / 1024:.1f} GiB allocated, of "
                                f"{record.get('device_mb', 0) / 1024:.1f} GiB"))  # fmt: skip
    return verdicts


def _sanitizer(clean: dict[str, Any] | None, control: dict[str, Any] | None) -> list[Verdict]:
    target = "the device feed's side-stream copies under TORCH_CUDA_SANITIZER=1: no report"
    if not clean or not clean.get("sanitizer_enabled"):
        why = (clean or {}).get("error", "the sanitizer run left no record")
        return [Verdict(target, NOT_MEASURED, why)]
    if clean.get("reports"):
        return [Verdict(target, FAIL, f"{clean['reports']} report(s): {clean.get('first_report', '')[:300]}")]
    if "error" in clean:
        return [Verdict(target, FAIL, f"the run failed under the sanitizer: {clean['error']}")]
    if not control or not control.get("reports"):
        return [Verdict(target, NOT_MEASURED, "the control run (the feed's wait_stream removed) was not reported: "
                        "the sanitizer did not see the copies, so the clean run proves nothing")]  # fmt: skip
    return [Verdict(target, PASS, f"{clean.get('steps', 0)} steps, no report; the control run without the feed's "
                    f"wait_stream was reported ({control['reports']} report(s))")]  # fmt: skip


# ----------------------------------------------------------------------------------------- syncs
def syncs_verdicts(record: dict[str, Any] | None) -> list[Verdict]:
    """``record``: ``benchmarks/acceptance/sync_check.py``'s (None: it left none). The target is no synchronisation inside
    the chunk loop (each would make the host wait for the GPU once per chunk); those outside it, once a step, and
    the trace are reported."""
    setup = (record or {}).get("setup", "ResNet-50, 224 px, batch 256, chunk 64, bf16")
    loop = f"one chunked step ({setup}): no synchronisation inside the chunk loop"
    outside = "synchronisations of the step outside the chunk loop (once a step)"
    trace = "a torch.profiler trace of two steps, kept beside the report"
    if not record or "error" in record:
        why = "the check left no record" if not record else f"the step failed: {record['error']}"
        return [Verdict(loop, NOT_MEASURED, why), Verdict(trace, NOT_MEASURED, "")]
    events = record.get("syncs", [])
    in_loop = [e for e in events if e["in_loop"]]
    places = sorted({e["place"] for e in in_loop})
    verdicts = [
        Verdict(loop, FAIL, f"{len(in_loop)} in the loop of {record.get('chunks')} chunks, at {_named('', places)}")
        if in_loop
        else Verdict(loop, PASS, f"none in the loop of {record.get('chunks')} chunks"),
        Verdict(outside, INFO, f"{len(events) - len(in_loop)} (listed above)"),
    ]
    if record.get("trace"):
        calls = record.get("trace_sync_calls") or {}
        counted = ", ".join(f"{name} x {n}" for name, n in sorted(calls.items())) or "no synchronising runtime call"
        verdicts.append(Verdict(trace, INFO, f"{Path(record['trace']).name}; in it: {counted}"))
    else:
        verdicts.append(Verdict(trace, NOT_MEASURED, "no trace was written"))
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
