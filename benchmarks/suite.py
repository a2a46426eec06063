"""The test suite's time, as CI takes it: ``make test`` (or ``make test-fast``) from an export of a commit, with
its wall time, the CPU time of the processes it waited for, the tests it ran and its slowest tests, written to
benchmarks/results/test-suite-<YYYY-MM-DD>.md with the machine named.

    python -m benchmarks.suite                          # make test on HEAD
    python -m benchmarks.suite --target test-fast
    python -m benchmarks.suite --rev 9d1ce6f --rev HEAD  # two commits one after the other: before and after

Why an export (``git archive``, as ``.ci/run`` does): the suite of a fresh clone, without the working tree's
uncommitted files or what earlier runs left. The environment is this checkout's ``.venv`` (``make install``),
marked current so that ``make`` does not reinstall it from the export. The budget (docs/contributing.md):
``make test`` under 10 minutes on the 2-core machine. Run it on a quiet machine: the figures are a machine's
whole attention, and another job's load shows in them.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import markdown_table, write_result

REPO = Path(__file__).resolve().parent.parent
_SUMMARY = re.compile(r"^=+ (?P<counts>.+?) in (?P<seconds>[\d.]+)s")
_DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S.*)$")


@dataclass(frozen=True)
class SuiteRun:
    rev: str
    commit: str
    target: str
    exit_code: int
    wall_s: float
    cpu_s: float
    counts: str
    slowest: list[tuple[float, str, str]]


def export(rev: str, into: Path) -> str:
    """``rev``'s files in ``into`` (a git repository of their own, as in ``.ci/run``); returns the commit."""
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True, check=True
    )
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for git in (["init", "-q"], ["add", "-A"], ["-c", "user.name=suite", "-c", "user.email=suite@localhost",
                                                  "commit", "-qm", f"export of {commit}"]):  # fmt: skip
        subprocess.run(["git", *git], cwd=into, check=True)
    return commit


def run_suite(rev: str, target: str, venv: Path, make: tuple[str, ...] = ("make",)) -> SuiteRun:
    """``make TARGET`` on an export of ``rev`` (``make``: the command, the tests' stand-in)."""
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        tree = Path(tmp) / "ddp_rank"
        commit = export(rev, tree)
        (venv / ".installed-stamp").touch()  # the export's files are newer than the stamp: no reinstall
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([*make, target, f"VENV={venv}"], cwd=tree, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = proc.stdout.splitlines()
    summary = next((m for m in map(_SUMMARY.match, reversed(lines)) if m), None)
    slowest = [(float(m["seconds"]), m["phase"], m["test"]) for m in map(_DURATION.match, lines) if m]
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    counts = summary["counts"] if summary else "no pytest summary (see stderr)"
    return SuiteRun(rev, commit, target, proc.returncode, wall, cpu, counts, slowest)


def report(runs: list[SuiteRun]) -> str:
    rows = [[f"`{r.rev}` ({r.commit})", f"make {r.target}", str(r.exit_code), f"{r.wall_s / 60:.1f} min",
             f"{r.cpu_s / 60:.1f} CPU-min", r.counts] for r in runs]  # fmt: skip
    text = markdown_table(["commit", "target", "exit", "wall", "CPU (processes waited for)", "tests"], rows)
    for r in runs:
        if r.slowest:
            text += f"\n\nThe {len(r.slowest)} slowest of `{r.rev}` ({r.commit}), `make {r.target}`:\n\n"
            text += markdown_table(
                ["s", "phase", "test"], [[f"{s:.1f}", p, f"`{t}`"] for s, p, t in r.slowest]
            )
    return text


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=("test", "test-fast"), default="test")
    parser.add_argument("--rev", action="append", help="commits to run, in order (default: HEAD)")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv", help="the environment (make install)")
    args = parser.parse_args()
    if not (args.venv / "bin" / "python").exists():
        parser.error(f"{args.venv} has no bin/python: run `make install` first")
    runs = []
    for rev in args.rev or ["HEAD"]:
        runs.append(run_suite(rev, args.target, args.venv.resolve()))
        r = runs[-1]
        print(f"{r.rev} ({r.commit}): make {r.target} exit {r.exit_code}, {r.wall_s:.0f} s wall, "
              f"{r.cpu_s:.0f} s CPU, {r.counts}", flush=True)  # fmt: skip
    text = report(runs)
    path = write_result("test-suite", "The test suite's time", text)
    print(text, f"\nwritten to {path}", sep="\n")
    return max(r.exit_code for r in runs)


if __name__ == "__main__":
    raise SystemExit(main())
