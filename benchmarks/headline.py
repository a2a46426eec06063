"""The headline table of README.md and of the site's home page: what the project achieves, each figure read from
the newest results file of its topic under ``benchmarks/results/`` and linked to it.

Why a script: figures typed into the README go stale the day a benchmark is rerun. This module finds each figure
in the file that measured it and writes the table between two markers of README.md and of docs/index.md (there
linking the Results pages); ``tests/benchmarks/test_headline.py`` fails when a table differs from what it writes, so a rerun that
changes a figure shows up as a one-command fix (``python -m benchmarks.headline``). A figure it cannot find (a
file missing, a table renamed, a check line gone) is an error naming the file and what was looked for, never a
blank cell.

    python -m benchmarks.headline           # rewrite the tables of README.md and docs/index.md
    python -m benchmarks.headline --check   # exit 1 when either is not what it would write
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO, RESULTS_DIR

README = REPO / "README.md"
SITE_HOME = REPO / "docs" / "index.md"
START = "<!-- headline: start (python -m benchmarks.headline writes this table from benchmarks/results/) -->"
END = "<!-- headline: end -->"


LOSS_NAMES = {"fastap": "FastAP", "pnp_dq": "PNP-Dq", "smooth_ap": "Smooth-AP"}


class MissingFigure(ValueError):
    """A figure the headline needs is not in its results file."""


@dataclass(frozen=True)
class Row:
    claim: str
    figure: str
    source: Path  # the results file the figure was read from


def newest(topic: str, folder: Path) -> Path:
    """The newest untagged ``<topic>-<date>.md`` of ``folder`` (``loss`` is not ``loss-floor``)."""
    dated = re.compile(rf"^{re.escape(topic)}-\d{{4}}-\d{{2}}-\d{{2}}\.md$")
    found = sorted(p for p in folder.glob(f"{topic}-*.md") if dated.match(p.name))
    if not found:
        raise MissingFigure(f"{folder}: no {topic}-<date>.md; run the benchmark that writes it first")
    return found[-1]


def tables(text: str) -> list[list[dict[str, str]]]:
    """The Markdown tables of ``text``, each a list of rows mapping its header's names to the cells."""
    out: list[list[dict[str, str]]] = []
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            out.append([dict(zip(block[0], cells, strict=False)) for cells in block[2:]])
        block = []
    return out


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x%").strip())


def _missing(path: Path, what: str) -> MissingFigure:
    return MissingFigure(
        f"{path.relative_to(path.parents[2])}: {what} not found; the headline reads it there "
        "(update benchmarks/headline.py if the file's layout changed)"
    )


def _table_with(path: Path, text: str, column: str) -> list[dict[str, str]]:
    """The last table of ``text`` that has ``column`` (a file appends its newer runs below the older)."""
    found = [t for t in tables(text) if t and column in t[0]]
    if not found:
        raise _missing(path, f"a table with a '{column}' column")
    return found[-1]


def _last_part(path: Path, text: str, part: str) -> str:
    """The last ``### Part `part``` section of a GPU acceptance report (the newest run of that part)."""
    sections = re.split(r"^### Part `", text, flags=re.MULTILINE)
    found = [s for s in sections if s.startswith(f"{part}`")]
    if not found:
        raise _missing(path, f"a section '### Part `{part}`'")
    return found[-1]


def _search(path: Path, pattern: str, text: str, what: str) -> re.Match[str]:
    match = re.search(pattern, text, flags=re.MULTILINE)
    if match is None:
        raise _missing(path, what)
    return match


def _device(path: Path, section: str) -> str:
    return _search(path, r"^Device: (?:NVIDIA )?([^(,;]+?)\s*[(,;]", section, "a 'Device:' line")[1]


def against_pml(folder: Path) -> Row:
    path = newest("loss", folder)
    text = path.read_text(encoding="utf-8")
    rows = [
        r
        for r in _table_with(path, text, "speed-up")
        if r.get("loss") == "fastap" and r["speed-up"].endswith("x")
    ]
    if not rows:
        raise _missing(path, "a FastAP row with a speed-up")
    top = max(rows, key=lambda r: _number(r["N"]))
    run = text[: text.rindex(f"| fastap | {top['N']} |")]
    dim = re.findall(r"\bd = (\d+)", run)
    if not dim:
        raise _missing(path, "the dimension ('d = ...') of the run")
    return Row(
        "FastAP against pytorch-metric-learning's (CPU)",
        f"{top['speed-up']} faster, {top['memory ratio']} less memory (N = {int(_number(top['N'])):,}, "
        f"d = {dim[-1]})",
        path,
    )


def against_floor_cpu(folder: Path) -> Row:
    path = newest("loss-floor", folder)
    rows = _table_with(path, path.read_text(encoding="utf-8"), "ours / floor")
    top = max(_number(r["N"]) for r in rows)
    at_top = [r for r in rows if _number(r["N"]) == top]
    ratios = ", ".join(f"{LOSS_NAMES.get(r['loss'], r['loss'])} {r['ours / floor']}x" for r in at_top)
    return Row(
        "The losses against their three-matmul floor (CPU)",
        f"{ratios} the floor's time (N = {int(top):,})",
        path,
    )


def against_floor_gpu(folder: Path) -> Row:
    path = newest("gpu", folder)
    section = _last_part(path, path.read_text(encoding="utf-8"), "loss")
    found = re.findall(
        r"\*\*PASS\*\* (\w+), float32 inputs, kernel=triton: N = ([\d,]+) within [\d.]+x of the fp32 floor: "
        r"([\d.]+)x",
        section,
    )
    if not found:
        raise _missing(path, "a PASS line of the float32 Triton kernels against the fp32 floor")
    ratios = sorted(float(r) for _, _, r in found)
    return Row(
        f"The losses against their three-matmul floor ({_device(path, section)})",
        f"{ratios[0]:.2f}-{ratios[-1]:.2f}x the floor's time, {len(found)} losses (N = {found[0][1]})",
        path,
    )


def gpu_step(folder: Path) -> Row:
    path = newest("gpu", folder)
    section = _last_part(path, path.read_text(encoding="utf-8"), "train")
    direct = _search(
        path,
        r"\*\*(?:PASS|FAIL)\*\* trainer direct >= \d+% of the bare loop's images/s[^:]*: (\d+)% \((\d+) images/s",
        section,
        "the 'trainer direct' check line",
    )
    bare = _search(path, r"^- bare loop: (\d+) images/s", section, "the 'bare loop' images/s line")
    backbone = _search(path, r"--backbone (\S+)", section, "the command's --backbone")
    return Row(
        f"The trainer's step against a bare PyTorch loop ({_device(path, section)})",
        f"{direct[1]}% of its images/s ({int(direct[2]):,} against {int(bare[1]):,}, {backbone[1]})",
        path,
    )


def largest_batch_cpu(folder: Path) -> Row:
    path = newest("features", folder)
    text = path.read_text(encoding="utf-8")
    cores = _search(path, r"^Machine: .*?(\d+) logical cores", text, "the machine's cores")
    rows = _table_with(path, text, "global batch")
    top = max(rows, key=lambda r: _number(r["global batch"]))
    loss = LOSS_NAMES.get(top["loss"], top["loss"])
    step = _number(top["step s (median)"])
    return Row(
        f"The largest global batch trained on {cores[1]} CPU cores",
        f"{top['global batch']} ({loss}, {top['steps']} steps of a head on feature vectors, {step:,.0f} s each)",
        path,
    )


ROWS: tuple[Callable[[Path], Row], ...] = (
    against_pml,
    against_floor_cpu,
    against_floor_gpu,
    gpu_step,
    largest_batch_cpu,
)


def readme_link(source: Path) -> str:
    return f"benchmarks/results/{source.name}"


def site_link(source: Path) -> str:
    """The page the site renders for that one file (docs/hooks/results.py), from docs/index.md."""
    return f"results/{source.stem}.md"


def table(folder: Path = RESULTS_DIR, link: Callable[[Path], str] = readme_link) -> str:
    """The headline table, every figure read from ``folder`` and linked to its file with ``link``."""
    out = ["| what | figure | measured in |", "|---|---|---|"]
    for row in (make(folder) for make in ROWS):
        out.append(f"| {row.claim} | {row.figure} | [{row.source.name}]({link(row.source)}) |")
    return "\n".join(out)


TARGETS: tuple[tuple[Path, Callable[[Path], str]], ...] = ((README, readme_link), (SITE_HOME, site_link))


def with_table(readme: str, new_table: str) -> str:
    """``readme`` with the text between the headline markers replaced by ``new_table``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise ValueError(f"needs the markers {START!r} and {END!r}, once each, in that order")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{new_table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a table is out of date, write nothing"
    )
    parser.add_argument(
        "--readme", type=Path, default=README, help="README.md (its links: benchmarks/results/)"
    )
    parser.add_argument(
        "--site-home", type=Path, default=SITE_HOME, help="docs/index.md (its links: results/)"
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    try:
        tables = {link: table(args.results, link) for link in (readme_link, site_link)}
    except MissingFigure as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = []
    for path, link in ((args.readme, readme_link), (args.site_home, site_link)):
        try:
            current = path.read_text(encoding="utf-8")
            wanted = with_table(current, tables[link])
        except (OSError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        if wanted != current:
            stale.append(path)
            if not args.check:
                path.write_text(wanted, encoding="utf-8")
    if not stale:
        print("the headline tables are up to date")
    elif args.check:
        print(f"out of date: {', '.join(p.name for p in stale)}: run python -m benchmarks.headline")
        return 1
    else:
        print(f"headline table written: {', '.join(p.name for p in stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
