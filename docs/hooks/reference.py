"""MkDocs hook: the command-line and config reference pages, generated from the code at every build.

Why generated and not written: a page typed by hand drifts from the argument parsers and the config schema the
day an option is added; these pages are rendered from the very objects ``ddp-rank`` parses with, so they cannot.
``reference/cli.md`` walks the parser of ``ddp_rank.cli.build_parser`` (every command and sub-command, every
option with its default and choices) and those of the modules the docs run with ``python -m``; ``reference/config.md`` lists every config key with its type, default,
allowed range or choices and meaning. Neither file exists in ``docs/``: they are added to the build here. The
getting-started page's table of the first options gets its default and demo columns from the same schema and
``configs/demo.yaml`` (``options_table``).

The hook is loaded by MkDocs from its path (mkdocs.yml, ``hooks:``) and imported by ``tests/docs`` as
``docs.hooks.reference``; it imports only the standard library and ``ddp_rank`` at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLI_PAGE = "reference/cli.md"
CONFIG_PAGE = "reference/config.md"
USAGE_WIDTH = 100
# Options whose default is the building machine's core count (os.cpu_count()): the page says so, not the count.
_PER_MACHINE = frozenset({"workers"})
# A help text that already states its default ("(default 256)", "(default: train)", "%(default)s"): the page
# does not add it a second time.
_DEFAULT_IN_HELP = re.compile(r"\bdefault\b|%\(default\)", re.IGNORECASE)
# Entry points the documentation tells users to run besides ``ddp-rank``: (module, the parser's factory). Each
# module's ``build_parser()`` is the parser its ``main`` parses with.
OTHER_ENTRY_POINTS = ("ddp_rank.cli.demo", "ddp_rank.runtime.launcher_check")


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


def commands(
    parser: argparse.ArgumentParser | None = None,
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Every ``(command line, one-line help, parser)`` of ``ddp-rank``, depth first in ``--help`` order.

    The root (``ddp-rank`` itself) comes first; a group such as ``shards`` comes before its sub-commands.
    """
    if parser is None:
        from ddp_rank.cli import build_parser

        parser = build_parser()
    yield from _walk(parser, "ddp-rank", parser.description or "")


def _walk(
    parser: argparse.ArgumentParser, line: str, help_text: str
) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    yield line, help_text, parser
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) in seen:  # an alias names the same parser again
                continue
            seen.add(id(sub))
            yield from _walk(sub, f"{line} {name}", helps.get(name, ""))


def other_entry_points() -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """``(command line, first line of its description, parser)`` of each of :data:`OTHER_ENTRY_POINTS`, run as
    ``python -m MODULE``."""
    for module in OTHER_ENTRY_POINTS:
        parser = importlib.import_module(module).build_parser()
        summary = (parser.description or "").strip().split("\n\n", 1)[0]
        yield f"python -m {module}", summary, parser


def anchor(line: str) -> str:
    """The heading id of a command: ``ddp-rank shards build`` -> ``ddp-rank-shards-build``,
    ``python -m ddp_rank.cli.demo`` -> ``python-m-ddp_rank.cli.demo``."""
    return line.replace(" -m ", " m ").replace(" ", "-")


def _usage(parser: argparse.ArgumentParser, line: str) -> str:
    formatter = argparse.HelpFormatter(prog=line, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _argument(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One option or positional as a list item: its spelling, then its help, default and choices."""
    formatter = argparse.HelpFormatter(prog=parser.prog)
    if action.option_strings:
        metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
        spelling = ", ".join(f"`{s}{metavar}`" for s in action.option_strings)
    else:
        spelling = f"`{formatter._format_args(action, action.dest)}`"
    help_text = formatter._expand_help(action) if action.help else ""
    facts = []
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        facts.append("choices: " + ", ".join(f"`{c}`" for c in action.choices))
    default = action.default
    if (
        action.option_strings
        and default is not None
        and default is not False
        and default != argparse.SUPPRESS
        and default != []
        and action.nargs != 0
        and default != ""
        and not _DEFAULT_IN_HELP.search(action.help or "")
    ):
        machine = action.dest in _PER_MACHINE and default == (os.cpu_count() or 1)
        facts.append("default: the number of CPU cores" if machine else f"default: `{default}`")
    text = " ".join(part for part in (_prose(help_text), f"({'; '.join(facts)})" if facts else "") if part)
    return f"- {spelling}" + (f": {text}" if text else "")


def _one_paragraph(text: str) -> str:
    return " ".join(text.split())


def _prose(text: str) -> str:
    """Help or doc text as Markdown prose on one line: ``<class>``, ``*`` and brackets shown as typed (they would
    be read as HTML, emphasis or links), code spans in backticks left alone."""
    parts = _one_paragraph(text).split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        part = parts[i].replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        for char in "*[]":
            part = part.replace(char, "\\" + char)
        parts[i] = part
    return "`".join(parts)


def _sentence(text: str) -> str:
    text = _prose(text)
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", ":")) else ".")


def cli_page() -> str:
    """The Markdown of ``reference/cli.md``."""
    out = [
        "# Command line",
        "",
        "Every `ddp-rank` command with its options, generated from the argument parsers at each build of this "
        "site (`ddp-rank COMMAND --help` prints the same). Commands that take `--config FILE` also take "
        "`section.key=value` overrides, before or after the flags; the keys are listed in the "
        "[config reference](config.md).",
        "",
    ]
    for line, help_text, parser in commands():
        heading = "##" if line.count(" ") <= 1 else "###"
        description = parser.description if parser.description != help_text else None
        out += _command(line, heading, help_text, description, parser)
    out += [
        "## Other entry points { #other-entry-points }",
        "",
        "Modules run with `python -m`, which the tutorials and the Makefile use.",
        "",
    ]
    for line, summary, parser in other_entry_points():
        out += _command(line, "###", summary, None, parser)
    return "\n".join(out)


def _command(
    line: str, heading: str, help_text: str, description: str | None, parser: argparse.ArgumentParser
) -> list[str]:
    out = [f"{heading} `{line}` {{ #{anchor(line)} }}", ""]
    if help_text:
        out += [_sentence(help_text), ""]
    if description:
        out += [_sentence(description), ""]
    out += ["```text", _usage(parser, line), "```", ""]
    arguments = [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and a.help != argparse.SUPPRESS
    ]
    out += [_argument(parser, a) for a in arguments]
    if arguments:
        out.append("")
    return out


# ---------------------------------------------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One config key as the reference shows it, whatever the schema is written with."""

    key: str  # section.name
    type: str
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive lower bound


@dataclasses.dataclass(frozen=True)
class ConfigSection:
    name: str
    doc: str
    keys: tuple[ConfigKey, ...]


def config_sections() -> list[ConfigSection]:
    """The config schema's sections and keys, from the JSON schema of the pydantic models
    (``ddp_rank.config.config_json_schema()``)."""
    from ddp_rank.config import config_json_schema

    return sections_from_json_schema(config_json_schema())


def sections_from_json_schema(schema: dict[str, Any]) -> list[ConfigSection]:
    """Sections and keys from a JSON schema as pydantic writes it: each top-level property a ``$ref`` to a
    section's definition, whose properties carry ``type`` (or ``anyOf``), ``default``, ``description``,
    ``enum`` and the bounds ``minimum``, ``maximum``, ``exclusiveMinimum``; the properties' order is the keys'.
    Written against ``config_json_schema()`` of the pydantic schema (tests/docs/test_reference.py)."""
    definitions = schema.get("$defs", {})
    sections = []
    for name, ref in schema["properties"].items():
        definition = definitions[ref["$ref"].rsplit("/", 1)[-1]] if "$ref" in ref else ref
        keys = tuple(
            ConfigKey(
                key=f"{name}.{key}",
                type=_json_type(prop),
                default=prop.get("default"),
                doc=prop.get("description", ""),
                choices=tuple(prop["enum"]) if "enum" in prop else None,
                minimum=bounds.get("minimum"),
                maximum=bounds.get("maximum"),
                above=bounds.get("exclusiveMinimum"),
            )
            for key, prop in definition.get("properties", {}).items()
            # A list's bounds are its items' (shown as the key's, as the dataclass schema writes them).
            for bounds in [prop.get("items", prop) if prop.get("type") == "array" else prop]
        )
        sections.append(ConfigSection(name, definition.get("description", ref.get("description", "")), keys))
    return sections


_JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


def _json_type(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        return " | ".join(_json_type(p) for p in prop["anyOf"])
    kind = prop.get("type", "")
    if kind == "array":
        return f"list[{_json_type(prop.get('items', {}))}]" if prop.get("items") else "list"
    if kind == "object":
        return "dict"
    return _JSON_TYPES.get(kind, kind or "any")


def _range(key: ConfigKey) -> str:
    low = (
        f"> {key.above:g}"
        if key.above is not None
        else f">= {key.minimum:g}"
        if key.minimum is not None
        else ""
    )
    high = f"<= {key.maximum:g}" if key.maximum is not None else ""
    return ", ".join(part for part in (low, high) if part)


def config_page() -> str:
    """The Markdown of ``reference/config.md``."""
    sections = config_sections()
    out = [
        "# Config keys",
        "",
        "Every key of the experiment config, generated from the schema at each build of this site "
        "(`ddp-rank train --help-config` prints the same). A config is a YAML file of sections "
        f"({', '.join(f'[`{s.name}`](#{s.name})' for s in sections)}); any key can be overridden on the command "
        "line as `section.key=value`. An unknown key or a value out of range stops the run at start-up with the "
        "valid keys or values.",
        "",
    ]
    for section in sections:
        out += [f"## `{section.name}` {{ #{section.name} }}", "", _sentence(section.doc), ""]
        for key in section.keys:
            facts = [f"`{key.type}`", f"default `{key.default!r}`"]
            if key.choices:
                facts.append("one of " + ", ".join(f"`{c}`" for c in key.choices))
            if _range(key):
                facts.append(_range(key))
            out += [
                f"### `{key.key}` {{ #{key.key} }}",
                "",
                "; ".join(facts) + ".",
                "",
                _sentence(key.doc),
                "",
            ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# The getting-started page's table of the first options
# ---------------------------------------------------------------------------------------------------------------

# The table follows this marker; its first column names keys (`section.key`, several separated by commas), and the
# build fills its last two columns: each key's default from the schema, its value in configs/demo.yaml.
OPTIONS_MARKER = (
    "<!-- options-table: defaults and demo values filled from the schema by docs/hooks/reference.py -->"
)
OPTIONS_PAGE = "getting-started.md"
DEMO_CONFIG = "configs/demo.yaml"


class OptionsTableError(Exception):
    """The options table is missing, malformed, or names a key the schema does not have."""


def option_value(value: Any) -> str:
    """A config value as a table cell shows it: ```hard```, ```256```, ```1e-05```; an empty string as a dash."""
    if value == "" or value is None:
        return "—"
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _demo_values() -> dict[str, Any]:
    from ddp_rank.config import load_config, to_dict

    loaded = to_dict(load_config(Path(__file__).resolve().parents[2] / DEMO_CONFIG))
    return {f"{section}.{key}": value for section, keys in loaded.items() for key, value in keys.items()}


def options_table(markdown: str) -> str:
    """``markdown`` with the options table's default and demo columns rendered from the config schema and
    ``configs/demo.yaml``, so the page cannot drift from either; :class:`OptionsTableError` on a bad table."""
    lines = markdown.split("\n")
    if OPTIONS_MARKER not in lines:
        raise OptionsTableError(f"{OPTIONS_PAGE} lacks the options table's marker line {OPTIONS_MARKER}")
    defaults = {key.key: key.default for section in config_sections() for key in section.keys}
    demo = _demo_values()
    row = lines.index(OPTIONS_MARKER) + 3  # the marker, the header, the separator
    while row < len(lines) and lines[row].startswith("|"):
        cells = lines[row].strip().strip("|").split("|")
        keys = re.findall(r"`([a-z_]+\.[a-z_]+)`", cells[0])
        unknown = [key for key in keys if key not in defaults]
        if len(cells) != 4 or not keys or unknown:
            problem = f"names unknown keys {unknown}" if unknown else "needs 4 cells, the first naming keys"
            raise OptionsTableError(f"{OPTIONS_PAGE}: the options table's row {lines[row]!r} {problem}")
        cells[2] = ", ".join(option_value(defaults[key]) for key in keys)
        cells[3] = ", ".join(option_value(demo[key]) for key in keys)
        lines[row] = "| " + " | ".join(cell.strip() for cell in cells) + " |"
        row += 1
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the getting-started page's options table from the schema and the demo config."""
    if page.file.src_uri != OPTIONS_PAGE:
        return markdown
    from mkdocs.exceptions import PluginError

    try:
        return options_table(markdown)
    except OptionsTableError as exc:
        raise PluginError(str(exc)) from None


def on_files(files: Any, config: Any) -> Any:
    """Add the two generated pages to the build."""
    from mkdocs.structure.files import File

    for path, render in ((CLI_PAGE, cli_page), (CONFIG_PAGE, config_page)):
        files.append(File.generated(config, path, content=render()))
    return files
