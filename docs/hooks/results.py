"""MkDocs hook: the Results pages, rendered from the dated files of ``benchmarks/results/`` at every build.

Why: a figure typed into prose goes stale the day a benchmark is rerun, and two pages then disagree. The
measurement scripts write dated Markdown tables and plots (``loss-2026-11-23.md``, ``study-batch-2026-11-25.png``);
this hook groups them by topic (the name before the date) and gives each topic one page, ``results/<topic>.md``,
with the newest measurement first and the earlier ones below it, so a link such as ``results/loss.md`` always
shows the current figures; each dated file also has a page of its own (``results/study-2026-11-25.md``), for a
link to that one measurement. A file tagged ``findings`` (``study-2026-11-25-findings.md``) is the written
analysis of the measurement of its topic and date, not a newer measurement: it is shown under that measurement's
tables (and on a page of its own); only without such a measurement does it stand as one. A plot belongs to the measurement of its date whose topic is the longest prefix of its
name (``study-features-batch-2026-11-26.png`` -> ``study-features``) or whose text names it; the rest are shown on
``results/index.md``. Nothing is written into ``docs/``; the pages are added to the build, and the nav gets a
Results section listing every topic, under its title less any date (the date is on the page).

A topic's page shows its newest measurement in full and links the earlier ones (each on its page). The index
gives each topic one line saying what it found: the ``<!-- summary: ... -->`` comment of its newest file (or of
that file's findings), kept in the results file beside the figures it sums up, so a rerun that writes a newer
file without one is caught by ``tests/docs/test_results_pages.py`` rather than left under an old line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PAGE_DIR = "results"
NAV_TITLE = "Results"
_DATED = re.compile(r"^(?P<topic>.+?)-(?P<date>\d{4}-\d{2}-\d{2})(?:-(?P<tag>[^.]+))?$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SUMMARY = re.compile(r"<!--\s*summary:\s*(?P<line>.*?)\s*-->", re.DOTALL)
# A date in a title, with the comma or the parenthesis that carries it: "Demo, 2026-11-25", "(H100, 2026-11-27)".
_TITLE_DATE = re.compile(r"\s*\([^()]*\d{4}-\d{2}-\d{2}[^()]*\)|,?\s*\d{4}-\d{2}-\d{2}")
FINDINGS = "findings"


@dataclass
class Measurement:
    path: Path
    topic: str
    date: str
    tag: str
    figures: list[Path] = field(default_factory=list)
    findings: Measurement | None = None  # the write-up of this measurement (``<topic>-<date>-findings.md``)

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")

    @property
    def title(self) -> str:
        for line in self.text.splitlines():
            if line.startswith("# "):
                return line[2:].strip()
        if self.findings is not None:  # a table without a title: its write-up's, less "(findings, date)"
            return re.sub(r"\s*\(findings\b[^)]*\)\s*$", "", self.findings.title)
        return self.topic.replace("-", " ").capitalize()

    @property
    def summary(self) -> str | None:
        """What this measurement found, in one line: its ``<!-- summary: ... -->`` comment, else its
        findings'; None when neither has one."""
        match = _SUMMARY.search(self.text)
        if match:
            return " ".join(match["line"].split())
        return self.findings.summary if self.findings is not None else None


def nav_title(title: str) -> str:
    """``title`` as the nav lists it: without its date (the page shows it) and without code marks."""
    return _TITLE_DATE.sub("", title).replace("`", "").strip()


@dataclass
class Results:
    topics: dict[str, list[Measurement]]  # newest first within a topic
    loose_figures: list[Path]


def collect(folder: Path = RESULTS) -> Results:
    """The dated result files of ``folder`` grouped by topic, each plot attached to its measurement."""
    measurements = []
    for path in sorted(folder.glob("*.md")):
        match = _DATED.match(path.stem)
        if match:
            measurements.append(Measurement(path, match["topic"], match["date"], match["tag"] or ""))
    loose = []
    for figure in sorted(folder.glob("*.png")):
        owner = _owner(figure, measurements)
        if owner is None:
            loose.append(figure)
        else:
            owner.figures.append(figure)
    measurements = _attach_findings(measurements)
    topics: dict[str, list[Measurement]] = {}
    for m in sorted(measurements, key=lambda m: (m.date, m.tag), reverse=True):
        topics.setdefault(m.topic, []).append(m)
    return Results(dict(sorted(topics.items())), loose)


def _attach_findings(measurements: list[Measurement]) -> list[Measurement]:
    """The measurements without the findings files that belong to one (same topic and date; the untagged file
    first, else the first tagged one): each such file becomes its measurement's ``findings``."""
    kept = [m for m in measurements if m.tag != FINDINGS]
    for write_up in (m for m in measurements if m.tag == FINDINGS):
        same = sorted(
            (m for m in kept if (m.topic, m.date) == (write_up.topic, write_up.date)), key=lambda m: m.tag
        )
        if same and same[0].findings is None:
            same[0].findings = write_up
        else:
            kept.append(write_up)
    return kept


def _owner(figure: Path, measurements: list[Measurement]) -> Measurement | None:
    named = [m for m in measurements if figure.name in m.text]
    if named:
        return named[0]
    match = _DATED.match(figure.stem)
    if not match:
        return None
    same_date = [
        m for m in measurements if m.date == match["date"] and match["topic"].startswith(m.topic + "-")
    ]
    return max(same_date, key=lambda m: len(m.topic), default=None)


def _demoted(text: str, levels: int, drop_title: bool) -> str:
    """``text`` with every heading outside code fences ``levels`` deeper, between h2 and h6 (the page has its
    own title: a file that appends sections, each under a ``#`` title of its own, keeps them below it); its
    first ``# title`` dropped."""
    out, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and re.match(r"^#{1,6} ", line):
            if drop_title and line.startswith("# "):
                drop_title = False
                continue
            hashes = len(line) - len(line.lstrip("#"))
            line = "#" * min(max(hashes + levels, 2), 6) + line[hashes:]
        out.append(line)
    return "\n".join(out).strip()


def _label(m: Measurement) -> str:
    return f"{m.date} ({m.tag})" if m.tag else m.date


def topic_page(measurements: list[Measurement]) -> str:
    """One topic's page: the newest measurement in full (its findings after its tables), then a link to each
    earlier one's page: the current figures are read without scrolling past superseded ones."""
    newest = measurements[0]
    out = [f"# {newest.title}", "", f"{_label(newest)}, from `benchmarks/results/{newest.path.name}`.", ""]
    out += _body(newest, level=1)
    if len(measurements) > 1:
        out += ["## Earlier measurements", ""]
    for m in measurements[1:]:
        title = "" if m.title == newest.title else f": {m.title}"
        out.append(f"- [{_label(m)}]({m.path.stem}.md){title}")
    return "\n".join(out) + "\n"


def _body(m: Measurement, level: int) -> list[str]:
    """A measurement's text (under a heading of ``level``), its plots, then its findings a level below."""
    out = [_demoted(m.text, level - 1, drop_title=True), "", *_figures(m)]
    if m.findings is not None:
        f = m.findings
        heading = "#" * min(level + 1, 6)
        out += [f"{heading} Findings", "", f"*{f.title}*, from `benchmarks/results/{f.path.name}`.", ""]
        out += [_demoted(f.text, level, drop_title=True), "", *_figures(f)]
    return out


def _figures(m: Measurement) -> list[str]:
    return [f"![{f.stem}]({f.name})\n" for f in m.figures]


def index_page(results: Results) -> str:
    out = [
        "# Results",
        "",
        "Every measurement of this project, rendered from the dated files of `benchmarks/results/` when the site "
        "is built: a page per topic, its newest measurement first. The scripts under `benchmarks/` write these "
        "files; rerunning one adds a dated file and this site shows it.",
        "",
        "| topic | what it found | newest | measurements |",
        "|---|---|---|---|",
    ]
    for topic, measurements in results.topics.items():
        newest = measurements[0]
        found = (newest.summary or "-").replace("|", "\\|")
        out.append(
            f"| [{nav_title(newest.title)}]({topic}.md) | {found} | {_label(newest)} | {len(measurements)} |"
        )
    out.append("")
    if results.loose_figures:
        out += ["## Other figures", ""]
        out += [f"![{f.stem}]({f.name})\n" for f in results.loose_figures]
    return "\n".join(out)


def measurement_page(m: Measurement, topic: str) -> str:
    """One dated file alone, at ``results/<its name>.md``: for a link to that measurement (a study of a date)."""
    out = [
        f"# {m.title}",
        "",
        f"{_label(m)}, from `benchmarks/results/{m.path.name}`. The newest of its topic: "
        f"[{topic}]({topic}.md).",
        "",
    ]
    return "\n".join([*out, *_body(m, level=1)])


def pages(results: Results) -> dict[str, str | bytes]:
    """Every generated file under ``results/``: the index, a page per topic, a page per dated file (not in the
    nav), the plots."""
    out: dict[str, str | bytes] = {f"{PAGE_DIR}/index.md": index_page(results)}
    for topic, measurements in results.topics.items():
        out[f"{PAGE_DIR}/{topic}.md"] = topic_page(measurements)
        for m in measurements:
            out[f"{PAGE_DIR}/{m.path.stem}.md"] = measurement_page(m, topic)
            if m.findings is not None:  # for a link to the write-up alone
                out[f"{PAGE_DIR}/{m.findings.path.stem}.md"] = measurement_page(m.findings, topic)
    for figure in [
        *results.loose_figures,
        *(f for m in _all(results) for f in m.figures),
    ]:
        out[f"{PAGE_DIR}/{figure.name}"] = figure.read_bytes()
    return out


def _all(results: Results) -> list[Measurement]:
    """Every measurement and findings file of ``results``."""
    out = [m for ms in results.topics.values() for m in ms]
    return out + [m.findings for m in out if m.findings is not None]


def rendered_files(folder: Path = RESULTS) -> list[Path]:
    """The files of ``folder`` that the site shows, sorted: the documentation's tests check and run their code
    blocks like any page's (tests/docs/code_blocks.py ``doc_pages``), so the two lists cannot drift apart."""
    return sorted(m.path for m in _all(collect(folder)))


def nav_pages(results: Results) -> list[tuple[str, str]]:
    """The Results section of the nav: ``(title, page)`` for the index and each topic."""
    return [("Overview", f"{PAGE_DIR}/index.md")] + [
        (nav_title(ms[0].title), f"{PAGE_DIR}/{topic}.md") for topic, ms in results.topics.items()
    ]


# ---------------------------------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    """Fill the nav's Results section (an entry ``Results: results/index.md``) with a page per topic."""
    entries = [{title: page} for title, page in nav_pages(collect())]
    for i, item in enumerate(config["nav"] or []):
        if isinstance(item, dict) and item.get(NAV_TITLE) == f"{PAGE_DIR}/index.md":
            config["nav"][i] = {NAV_TITLE: entries}
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages and plots; a dated file's own page is linked to, not listed in the nav."""
    from mkdocs.structure.files import File, InclusionLevel

    results = collect()
    in_nav = {page for _, page in nav_pages(results)}
    for path, content in pages(results).items():
        hidden = path.endswith(".md") and path not in in_nav
        inclusion = InclusionLevel.NOT_IN_NAV if hidden else InclusionLevel.UNDEFINED
        files.append(File.generated(config, path, content=content, inclusion=inclusion))
    return files
