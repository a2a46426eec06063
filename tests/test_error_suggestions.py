"""Every setting the code base suggests in a message (``data.sampler=random``) is a real key with a valid value:
each ``section.key=value`` found in the sources' strings is parsed as an override against the config schema."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from ddp_rank.config import Config, ConfigError, load_config
from ddp_rank.data.sampling.schedule import ScheduleConfig

PACKAGE = Path(__file__).resolve().parents[1] / "ddp_rank"
SECTIONS = {name: f.annotation for name, f in Config.model_fields.items()}
KEYS = {section: set(type(getattr(Config(), section)).model_fields) for section in SECTIONS}
_SETTING = re.compile(
    r"(?<![\w.{])([a-z_]+)\.([a-z_0-9]+)=('[^']*'|\"[^\"]*\"|[\w:.\-]+\([^)]*\)|[^\s,;'\"`)]*)"
)
"""``section.key=value``; the value quoted, a call (``pml:MultiSimilarityMiner(epsilon=0.1)``) or a plain run."""
_BARE = re.compile(r"(?<![\w.{])([a-z_]+)=([A-Za-z0-9_.\-]+)")
"""``strategy=random``: a setting named without its section (an override the command line cannot take)."""
_PLACEHOLDER = "\x00"


def _docstring(node: ast.AST) -> ast.Constant | None:
    """The docstring node of a module, class or function, else None."""
    if (
        not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        or not node.body
    ):
        return None
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.value
    return None


def _strings(raised_only: bool = False) -> list[tuple[str, int, str]]:
    """(file, line, text) of every string literal in the package (``raised_only``: in a ``raise`` statement); a
    formatted field of an f-string becomes a placeholder, and a docstring's example lines (``>>>``, ``...``) are
    left out: an example may show a refused setting on purpose."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        roots: list[ast.AST] = (
            [n for n in ast.walk(tree) if isinstance(n, ast.Raise)] if raised_only else [tree]
        )
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        docstrings = {id(doc) for n in ast.walk(tree) if (doc := _docstring(n)) is not None}
        for root in roots:
            for node in ast.walk(root):
                if isinstance(node, ast.JoinedStr):
                    text = "".join(
                        v.value if isinstance(v, ast.Constant) else _PLACEHOLDER for v in node.values
                    )
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
                    text = node.value
                    if id(node) in docstrings:
                        text = "\n".join(
                            line for line in text.splitlines() if not line.lstrip().startswith((">>>", "..."))
                        )
                else:
                    continue
                found.append((str(path.relative_to(PACKAGE.parent)), node.lineno, text))
    return found


def _suggestions() -> list[tuple[str, str, str | None]]:
    """(where, key, literal value or None when formatted at run time) of each ``section.key=value``."""
    out = []
    for where, line, text in _strings():
        for m in _SETTING.finditer(text):
            section, key, value = m.groups()
            if section not in SECTIONS:
                continue  # ``section.key=value`` in a usage line, ``s3.bucket=...``: not a setting
            quoted = value[:1] in "'\"" and len(value) >= 2
            value = value[1:-1] if quoted else value.rstrip(":.")  # (unquoted: the sentence's own colon)
            # A setting that opens the message is the one refused ("model.bn_group_size=1 would ..."), not a
            # suggestion: only its key is checked.
            echo = m.start() == 0
            metavariable = re.fullmatch(r"[A-Z][A-Z_]*", value) is not None  # train.seed=S, data.shards=DIR
            literal = None if echo or metavariable or _PLACEHOLDER in value or "<" in value else value
            out.append((f"{where}:{line}", f"{section}.{key}", literal))
    return out


SUGGESTIONS = _suggestions()


def test_the_sources_suggest_settings() -> None:
    """The scan finds what it is for (a broken pattern would make the next test vacuous)."""
    assert len(SUGGESTIONS) > 50
    assert any(k == "data.sampler" and v == "random" for _, k, v in SUGGESTIONS)


@pytest.mark.parametrize(("where", "key", "value"), SUGGESTIONS, ids=[f"{w}:{k}" for w, k, _ in SUGGESTIONS])
def test_each_suggested_setting_parses_as_an_override(where: str, key: str, value: str | None) -> None:
    section, name = key.split(".", 1)
    assert name in KEYS[section], f"{where} suggests {key}, which is not a key of '{section}'"
    if value is None:
        return  # formatted at run time: the key is what the source fixes
    try:
        load_config(None, [f"{key}={value}"])
    except ConfigError as exc:
        # The checks of a value echo it as ``key=...`` (unknown key: ``'key'``); an error that does not is a
        # check across settings (``loss.miner`` needs a pml ``loss.name``): the suggested value itself parsed.
        if f"{key}=" in str(exc) or f"'{key}'" in str(exc):
            pytest.fail(f"{where} suggests {key}={value}: {exc}")


def test_no_message_names_a_setting_without_its_section() -> None:
    """``strategy=random`` was suggested where the override is ``data.sampler=random``: a bare ``name=value``
    in an error, whose name is a config key or a sampler setting, must carry its section. (The losses are left
    out: they are a library whose keyword arguments, ``normalize=False``, are what their errors name.)"""
    names = set().union(*KEYS.values()) | {f.name for f in dataclasses.fields(ScheduleConfig)}
    bare = [
        f"{where}:{line}: {m.group(0)}"
        for where, line, text in _strings(raised_only=True)
        if not where.startswith("ddp_rank/losses/")
        for m in _BARE.finditer(text)
        if m.group(1) in names
    ]
    assert bare == []


def test_the_bare_check_would_catch_the_old_message() -> None:
    text = "use fewer categories_per_batch, a smaller batch, or strategy=random"
    assert [m.group(0) for m in _BARE.finditer(text)] == ["strategy=random"]
