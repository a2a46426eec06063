"""The generated pages (docs/hooks): every CLI command and option, every config key, every result file shows.

Checked against the parsers and the config themselves, walked here independently of the hook's own walk."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ddp_rank.cli import build_parser
from ddp_rank.config import Config, to_dict
from docs.hooks import reference, results

REPO = Path(__file__).resolve().parents[2]


def _parsers(parser: argparse.ArgumentParser, line: str):
    yield line, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{line} {name}")


def _section(page: str, heading: str) -> str:
    """The text of ``page`` from ``heading`` to the next heading of a command."""
    start = page.index(heading)
    ends = [i for i in (page.find("\n## ", start + 1), page.find("\n### ", start + 1)) if i != -1]
    return page[start : min(ends, default=len(page))]


def test_every_command_and_option_is_in_the_cli_page() -> None:
    page = reference.cli_page()
    commands = list(_parsers(build_parser(), "ddp-rank"))
    assert len(commands) > 15  # shards and its sub-commands, plan, train, eval, export, index, search, ...
    for line, parser in commands:
        heading = f"`{line}` {{ #{line.replace(' ', '-')} }}"
        assert heading in page, f"{line} has no heading in reference/cli.md"
        text = _section(page, heading)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for spelling in action.option_strings:
                assert f"`{spelling}" in text, f"{line} {spelling} is missing from its section"


def test_a_default_of_the_core_count_is_not_the_build_machines_number() -> None:
    import os

    listing = _section(reference.cli_page(), "`ddp-rank shards listing` {")
    assert "`--workers WORKERS`: emoji, words: render workers (default: the number of CPU cores)" in listing
    assert f"default: `{os.cpu_count()}`" not in listing.split("--workers", 1)[1].split("\n", 1)[0]


def _all_parsers():
    yield from _parsers(build_parser(), "ddp-rank")
    for line, _, parser in reference.other_entry_points():
        yield line, parser


def test_every_argument_of_every_parser_has_help() -> None:
    """An option without help is a bare spelling on the reference page and in ``--help``."""
    missing = []
    for line, parser in _all_parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{line} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help:
                missing.append(f"{line} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "arguments without help: " + ", ".join(missing)


def test_a_default_is_shown_once_and_never_empty() -> None:
    page = reference.cli_page()
    features = _section(page, "`ddp-rank shards features` {")
    assert "`--batch-size BATCH_SIZE`: images per forward pass (default 256)\n" in features
    assert "(default: ``)" not in page
    sweep = _section(page, "`ddp-rank sweep` {")
    assert "default" not in sweep.split("`--launch", 1)[1].split("\n", 1)[0]
    for line in page.splitlines():
        if line.startswith("- `"):
            assert line.lower().count("default") <= 1, line


def test_the_python_m_entry_points_the_docs_run_are_in_the_cli_page() -> None:
    page = reference.cli_page()
    for module in reference.OTHER_ENTRY_POINTS:
        line = f"python -m {module}"
        assert f"`{line}` {{ #{reference.anchor(line)} }}" in page
    demo = _section(page, "`python -m ddp_rank.cli.demo` {")
    assert "`--shards-only`: build the listing and the shards, then stop" in demo
    docs = "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    for module in re.findall(r"python -m (ddp_rank[\w.]*)", docs):
        if module not in ("ddp_rank.cli",):  # ddp-rank itself
            assert module in reference.OTHER_ENTRY_POINTS, f"the docs run {module}; the CLI page omits it"


def test_every_config_key_is_in_the_config_page_with_its_default() -> None:
    page = reference.config_page()
    keys = 0
    for section, values in to_dict(Config()).items():
        assert f"## `{section}` {{ #{section} }}" in page
        for key, default in values.items():
            heading = f"### `{section}.{key}` {{ #{section}.{key} }}"
            assert heading in page, f"{section}.{key} is missing from reference/config.md"
            assert f"default `{default!r}`" in _section(page, heading), f"{section}.{key}'s default"
            keys += 1
    assert keys > 100


def test_config_sections_from_a_pydantic_json_schema() -> None:
    """The path the config reference takes once the schema is pydantic models (config_json_schema)."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class DataConfig(pydantic.BaseModel):
        """Where the images come from."""

        shards: str = pydantic.Field("", description="Shard directory.")
        batch: int = pydantic.Field(256, ge=2, description="Global batch.")
        sampler: Literal["hard", "pk"] = pydantic.Field("hard", description="Batch construction.")
        betas: list[pydantic.confloat(ge=0.0)] = pydantic.Field([0.9, 0.999], description="Adam betas.")
        lr: float = pydantic.Field(0.1, gt=0.0, le=1.0, description="Rate.")
        init: str | None = pydantic.Field(None, description="Weights.")

    class Config(pydantic.BaseModel):
        data: DataConfig = pydantic.Field(default_factory=DataConfig)

    (section,) = reference.sections_from_json_schema(Config.model_json_schema(mode="validation"))
    assert section.name == "data" and section.doc == "Where the images come from."
    keys = {k.key: k for k in section.keys}
    assert list(keys) == ["data.shards", "data.batch", "data.sampler", "data.betas", "data.lr", "data.init"]
    assert (keys["data.batch"].type, keys["data.batch"].default, keys["data.batch"].minimum) == (
        "int",
        256,
        2,
    )
    assert (
        keys["data.sampler"].choices == ("hard", "pk") and keys["data.sampler"].doc == "Batch construction."
    )
    assert (keys["data.betas"].type, keys["data.betas"].minimum) == ("list[float]", 0.0)
    assert (keys["data.lr"].above, keys["data.lr"].maximum) == (0.0, 1.0)
    assert keys["data.init"].type == "str | None"
    assert reference._range(keys["data.lr"]) == "> 0, <= 1"


def test_prose_is_escaped_outside_code_spans() -> None:
    assert reference._prose("root/<class>/<img> or train-*.tar, `a*b` [x]") == (
        "root/&lt;class&gt;/&lt;img&gt; or train-\\*.tar, `a*b` \\[x\\]"
    )


def _results_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "loss-2026-01-01.md").write_text(
        "# Loss timings\n\nold table\n\n## Part\n\n```text\n# not a heading\n```\n"
    )
    (folder / "loss-2026-02-01.md").write_text("# Loss timings\n\nnew table\n\n# Loss timings\n\nappended\n")
    (folder / "loss-floor-2026-02-01.md").write_text("# Against the floor\n\nfloor table\n")
    (folder / "loss-floor-curve-2026-02-01.png").write_bytes(b"png")
    (folder / "study-2026-02-01.md").write_text("## Batch size\n\nsee `roc-2026-02-01.png`\n")
    (folder / "roc-2026-02-01.png").write_bytes(b"png")
    (folder / "lonely-2026-03-01.png").write_bytes(b"png")
    (folder / "chunk-sizes-2026-02-01-h100.md").write_text("# Chunks\n")
    (folder / "notes.md").write_text("# not dated: not a measurement\n")
    return folder


def test_results_are_grouped_by_topic_newest_first_with_their_figures(tmp_path: Path) -> None:
    found = results.collect(_results_folder(tmp_path))
    assert list(found.topics) == ["chunk-sizes", "loss", "loss-floor", "study"]
    assert [m.date for m in found.topics["loss"]] == ["2026-02-01", "2026-01-01"]
    assert found.topics["chunk-sizes"][0].tag == "h100"
    assert [f.name for f in found.topics["loss-floor"][0].figures] == ["loss-floor-curve-2026-02-01.png"]
    assert [f.name for f in found.topics["study"][0].figures] == ["roc-2026-02-01.png"]  # named in its text
    assert [f.name for f in found.loose_figures] == ["lonely-2026-03-01.png"]

    pages = results.pages(found)
    loss = pages["results/loss.md"]
    assert isinstance(loss, str)
    assert (
        loss.index("new table") < loss.index("## Earlier measurements") < loss.index("(loss-2026-01-01.md)")
    )
    assert "old table" not in loss  # an earlier measurement is linked, on its own page
    assert loss.startswith("# Loss timings\n") and "\n# Loss timings" not in loss  # one title: others demoted
    assert "\n## Loss timings\n\nappended" in loss
    old = str(pages["results/loss-2026-01-01.md"])
    assert "## Part" in old and "# not a heading" in old  # demoted, but not inside a code fence
    assert "![roc-2026-02-01](roc-2026-02-01.png)" in pages["results/study.md"]
    assert pages["results/roc-2026-02-01.png"] == b"png"
    assert "2026-02-01 (h100)" in pages["results/index.md"]
    alone = pages["results/loss-2026-01-01.md"]
    assert (
        isinstance(alone, str) and "old table" in alone and "new table" not in alone and "(loss.md)" in alone
    )
    assert "lonely-2026-03-01.png" in pages["results/index.md"]


def test_a_findings_file_is_the_write_up_of_its_measurement_not_a_newer_one(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "study-2026-01-01.md").write_text("## Batch size\n\nold table\n")
    (folder / "study-2026-02-01.md").write_text("## Batch size\n\nthat day's table\n")
    (folder / "study-2026-02-01-findings.md").write_text(
        "# Does a bigger batch help? (findings, 2026-02-01)\n\n## Answer\n\nyes, see `plot-2026-02-01.png`\n"
    )
    (folder / "plot-2026-02-01.png").write_bytes(b"png")
    (folder / "other-2026-03-01-findings.md").write_text("# A write-up alone\n\nno table of its date\n")

    found = results.collect(folder)
    study = found.topics["study"]
    assert [(m.date, m.tag) for m in study] == [("2026-02-01", ""), ("2026-01-01", "")]
    assert study[0].findings is not None and study[0].findings.path.name == "study-2026-02-01-findings.md"
    assert study[0].title == "Does a bigger batch help?"
    assert [(m.date, m.tag) for m in found.topics["other"]] == [("2026-03-01", "findings")]  # stands alone

    pages = results.pages(found)
    page = pages["results/study.md"]
    assert isinstance(page, str)
    # that day's table, its findings under it, then the earlier measurement
    assert page.index("that day's table") < page.index("## Findings") < page.index("yes, see")
    assert (
        page.index("yes, see") < page.index("## Earlier measurements") < page.index("(study-2026-01-01.md)")
    )
    assert "### Answer" in page and "![plot-2026-02-01](plot-2026-02-01.png)" in page
    assert "2026-02-01 (findings)" not in page and "2026-02-01 (findings)" not in pages["results/index.md"]
    assert "| 2026-02-01 | 2 |" in pages["results/index.md"]
    alone = pages["results/study-2026-02-01-findings.md"]
    assert isinstance(alone, str) and "yes, see" in alone
    assert "yes, see" in str(pages["results/study-2026-02-01.md"])


def test_every_result_file_of_the_repository_is_on_a_page() -> None:
    pages = results.pages(results.collect())
    text = "\n".join(p for p in pages.values() if isinstance(p, str))
    for path in sorted((REPO / "benchmarks" / "results").glob("*")):
        if path.suffix == ".md":
            assert f"`benchmarks/results/{path.name}`" in text, f"{path.name} is on no Results page"
        elif path.suffix == ".png":
            assert f"results/{path.name}" in pages and f"]({path.name})" in text, (
                f"{path.name} is shown nowhere"
            )


def test_the_nav_gets_a_results_entry_per_topic(tmp_path: Path) -> None:
    config = {"nav": [{"Home": "index.md"}, {"Results": "results/index.md"}]}
    results.on_config(config)
    entries = config["nav"][1]["Results"]
    assert entries[0] == {"Overview": "results/index.md"}
    assert {"Loss layer: time and peak memory against pytorch-metric-learning": "results/loss.md"} in entries


def test_the_site_config_loads_every_hook() -> None:
    text = (REPO / "mkdocs.yml").read_text()
    for hook in sorted((REPO / "docs" / "hooks").glob("*.py")):
        assert f"docs/hooks/{hook.name}" in text, f"{hook.name} is not in mkdocs.yml's hooks"
