"""The getting-started page's table of the first options: its defaults are the schema's and its demo values
configs/demo.yaml's, in the page as written and as built (docs/hooks/reference.py ``options_table``)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

from ddp_rank.config import config_json_schema, load_config, to_dict
from docs.hooks import reference

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / reference.OPTIONS_PAGE


def _rows(markdown: str) -> list[list[str]]:
    lines = markdown.split("\n")
    start = lines.index(reference.OPTIONS_MARKER) + 3
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _schema_defaults() -> dict[str, object]:
    """``{section.key: default}`` read from the JSON schema here, apart from the hook's own reading."""
    schema = config_json_schema()
    out = {}
    for section, ref in schema["properties"].items():
        definition = schema["$defs"][ref["$ref"].rsplit("/", 1)[-1]]
        out.update(
            {f"{section}.{key}": prop.get("default") for key, prop in definition["properties"].items()}
        )
    return out


def _cell(values: list[object]) -> str:
    shown = []
    for value in values:
        if value == "":
            shown.append("—")
        else:
            shown.append(f"`{value:g}`" if isinstance(value, float) else f"`{value}`")
    return ", ".join(shown)


def test_the_page_as_written_shows_the_schemas_defaults_and_the_demos_values() -> None:
    """What a reader of the file (on GitHub, in an editor) sees is what the site shows."""
    markdown = PAGE.read_text(encoding="utf-8")
    defaults = _schema_defaults()
    demo = to_dict(load_config(REPO / "configs" / "demo.yaml"))
    rows = _rows(markdown)
    assert len(rows) >= 8
    for cells in rows:
        keys = re.findall(r"`([a-z_]+\.[a-z_]+)`", cells[0])
        assert cells[2] == _cell([defaults[key] for key in keys]), f"{cells[0]}: default column"
        section_key = [key.split(".") for key in keys]
        assert cells[3] == _cell([demo[s][k] for s, k in section_key]), f"{cells[0]}: demo column"
    assert reference.options_table(markdown) == markdown


def test_the_table_names_the_defaults_the_issue_found_wrong() -> None:
    """model.weights defaults to none (the page suggested default); the demo's sampler is hard (it said auto)."""
    rows = {cells[0]: cells for cells in _rows(PAGE.read_text(encoding="utf-8"))}
    assert rows["`model.backbone`, `model.weights`"][2:] == [
        "`resnet50`, `none`",
        "`efficientnet_lite0`, `default`",
    ]
    assert rows["`data.sampler`"][2:] == ["`auto`", "`hard`"]


def test_the_build_replaces_a_stale_default() -> None:
    markdown = "\n".join(
        [
            reference.OPTIONS_MARKER,
            "| key | what it decides | default | in `configs/demo.yaml` |",
            "|---|---|---|---|",
            "| `model.weights` | the weights | `default` | `none` |",
            "| `optim.lr` | the rate | 0.1 | x |",
            "",
            "after",
        ]
    )
    page = SimpleNamespace(file=SimpleNamespace(src_uri=reference.OPTIONS_PAGE))
    built = reference.on_page_markdown(markdown, page, {}, None)
    assert "| `model.weights` | the weights | `none` | `default` |" in built
    assert "| `optim.lr` | the rate | `1e-05` | `0.0001` |" in built
    assert built.endswith("\n\nafter")
    other = SimpleNamespace(file=SimpleNamespace(src_uri="index.md"))
    assert reference.on_page_markdown("no table", other, {}, None) == "no table"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("| `model.weigths` | typo | x | y |", "names unknown keys ['model.weigths']"),
        ("| `model.weights` | three cells | x |", "needs 4 cells"),
    ],
)
def test_a_bad_row_fails_the_build_in_one_line(row: str, problem: str) -> None:
    markdown = "\n".join([reference.OPTIONS_MARKER, "| a | b | c | d |", "|---|---|---|---|", row])
    page = SimpleNamespace(file=SimpleNamespace(src_uri=reference.OPTIONS_PAGE))
    with pytest.raises(PluginError, match=re.escape(problem)):
        reference.on_page_markdown(markdown, page, {}, None)
    with pytest.raises(PluginError, match="lacks the options table's marker"):
        reference.on_page_markdown("# Getting started\n", page, {}, None)
