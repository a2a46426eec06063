"""The messages the package can print, read from its source, and the check that a page's quoted message is one of
them (docs/troubleshooting.md; tests/docs/test_troubleshooting.py).

Why templates and not only running the code: many messages need a state that is dear to reach (a run resumed
from another config, a rank out of memory, a shard cut short in the middle of training). The source holds each
message as a string literal or an f-string, whose ``{...}`` fields are the parts that vary; a quote writes those
parts as printed, or as ``...``.

Messages are built in layers: ``ddp-rank train: error: {message}``, where the message is ``{path}: unknown key
...``, and module-level constants (``FIX``, ``WHY``) end many of them. So the check works from the inside out:
the template with the most literal text that occurs in the quoted line (its fields taking at most
``VALUE_CHARS`` characters each) is replaced by one character, which a field of the template around it can take,
and again, until no template occurs. A field naming a module-level string constant of the package is that
constant's text. The share of the line the templates matched literally is what they explain; the rest is the
values the fields printed. One changed word breaks the template it belongs to, and its whole text is then left
unexplained.

Only the standard library: the page's test imports it, and so can a contributor checking a draft.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddp_rank"

FIELD = None
"""A template token: a field of an f-string (any text)."""
Tokens = tuple[str | None, ...]

MIN_EXPLAINED = 0.3
"""The share of a quote's characters (outside its ``...``) that templates must match literally: the rest are
values (paths, counts, lists of keys)."""
VALUE_CHARS = 40
VALUE_WORDS = 4
"""A value, what one field prints (a path, a count, a short list; an explained inner message counts as one
character), has at most ``VALUE_WORDS`` words of at most ``VALUE_CHARS`` characters: a quote writes a longer one
as ``...``. So does what no template takes, all of it together."""
MIN_WORDS = 2
"""Templates with fewer literal words are glue (``{a}: {b}``, ``error: {exc}``) or names (``global_batch_size``,
``manifest.json``), not messages: left out, since they would explain pieces of any quote."""
INNER = "\x01"
"""What an explained message becomes in the line, for the template around it to take as a field's text."""
ELLIPSIS = "..."
_NAME_DEPTH = 3


@dataclass(frozen=True)
class Template:
    """One message pattern of the source: literal characters and fields."""

    tokens: Tokens
    where: str  # path:line of its first occurrence

    @functools.cached_property
    def runs(self) -> tuple[str, ...]:
        """The literal runs between the fields."""
        text = "".join(t if t is not None else "\0" for t in self.tokens)
        return tuple(run for run in text.split("\0") if run)

    @functools.cached_property
    def literal_chars(self) -> int:
        return sum(len(r) for r in self.runs)

    @property
    def is_message(self) -> bool:
        """At least ``MIN_WORDS`` words (with a letter) in its literal text."""
        words = [w for run in self.runs for w in run.split() if any(c.isalpha() for c in w)]
        return len(words) >= MIN_WORDS


# ---------------------------------------------------------------------------------------------------------------
# Reading the templates


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """The ids of every statement-level string (docstrings, and strings that are statements of their own)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _is_text(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _is_text(node.left) or _is_text(node.right)
    return False


def _constants(trees: dict[str, ast.Module]) -> dict[str, ast.AST]:
    """Module-level ``NAME = <text>`` of the package whose name has one definition (or several of one text)."""
    found: dict[str, list[ast.AST]] = {}
    for tree in trees.values():
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                target, value = stmt.targets[0], stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                target, value = stmt.target, stmt.value
            else:
                continue
            if isinstance(target, ast.Name) and _is_text(value):
                found.setdefault(target.id, []).append(value)
    return {name: values[0] for name, values in found.items() if len({ast.dump(v) for v in values}) == 1}


def _tokens(node: ast.AST, names: dict[str, ast.AST], depth: int = 0) -> list[str | None]:
    """A text expression as tokens; what is not literal text is a field, except a name of ``names``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return list(node.value)
    if isinstance(node, ast.JoinedStr):
        out: list[str | None] = []
        for value in node.values:
            out.extend(_tokens(value, names, depth))
        return out
    if isinstance(node, ast.FormattedValue):
        inner = node.value
        if (
            isinstance(inner, ast.Name)
            and inner.id in names
            and node.conversion == -1
            and node.format_spec is None
            and depth < _NAME_DEPTH
        ):
            return _tokens(names[inner.id], names, depth + 1)
        return [FIELD]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _is_text(node):
        return _tokens(node.left, names, depth) + _tokens(node.right, names, depth)
    if isinstance(node, ast.Name) and node.id in names and depth < _NAME_DEPTH:
        return _tokens(names[node.id], names, depth + 1)
    return [FIELD]


def _lines(tokens: list[str | None]) -> Iterator[Tokens]:
    """A template per printed line (a quote is checked line by line), adjacent fields merged."""
    line: list[str | None] = []
    for t in [*tokens, "\n"]:
        if t == "\n":
            if line:
                yield tuple(line)
            line = []
        elif not (t is FIELD and line and line[-1] is FIELD):
            line.append(t)


def _outermost_texts(tree: ast.AST, skip: set[int]) -> Iterator[ast.AST]:
    """Every text expression that is not part of a larger one (an f-string's pieces are not messages alone)."""
    inner: set[int] = set()
    for node in ast.walk(tree):
        if id(node) in inner or id(node) in skip:
            continue
        if _is_text(node):
            for child in ast.walk(node):
                if child is not node:
                    inner.add(id(child))
            yield node


@functools.cache
def package_templates(package: Path = PACKAGE) -> tuple[Template, ...]:
    """Every message pattern in the package's source: string literals and f-strings (docstrings left out)."""
    trees = {
        str(path.relative_to(package.parent)): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for path in sorted(package.rglob("*.py"))
    }
    names = _constants(trees)
    seen: dict[Tokens, Template] = {}
    for where, tree in trees.items():
        for node in _outermost_texts(tree, _docstring_nodes(tree)):
            for tokens in _lines(_tokens(node, names)):
                if any(t is not FIELD for t in tokens) and tokens not in seen:
                    seen[tokens] = Template(tokens, f"{where}:{getattr(node, 'lineno', 0)}")
    return tuple(seen.values())


# ---------------------------------------------------------------------------------------------------------------
# Matching a quote


@dataclass(frozen=True)
class Explanation:
    """How much of a quote the templates explain, and by which (innermost first)."""

    explained: int
    total: int
    templates: tuple[str, ...]
    unexplained: str  # the line's text that no template took (its ``...`` left out), "" when none

    @property
    def holds(self) -> bool:
        """Whether the line is one of the package's messages: most of it explained, and what no template took
        no longer than one value."""
        left = self.unexplained.split()
        return (
            self.share >= MIN_EXPLAINED and len(left) <= VALUE_WORDS and len(self.unexplained) <= VALUE_CHARS
        )

    @property
    def share(self) -> float:
        return self.explained / self.total if self.total else 0.0


@functools.cache
def _pattern(template: Template) -> re.Pattern[str]:
    """The template as a regular expression: its literal runs in order, each field between them a value (at most
    ``VALUE_WORDS`` words of at most ``VALUE_CHARS`` characters; an explained inner message is one character).
    Fields before the first run and after the last are left to the template around it."""
    word = f"[^ ]{{0,{VALUE_CHARS}}}?"
    field = f"(?:{word}(?: {word}){{0,{VALUE_WORDS - 1}}}?)"
    return re.compile(field.join(re.escape(run) for run in template.runs))


class Matcher:
    """Explains quoted lines with a set of templates (the package's by default)."""

    def __init__(self, templates: Iterable[Template] | None = None) -> None:
        every = package_templates() if templates is None else tuple(templates)
        self.templates = tuple(sorted((t for t in every if t.is_message), key=lambda t: -t.literal_chars))
        self._explained: dict[str, Explanation] = {}

    def explain(self, quote: str) -> Explanation:
        """Innermost first: the template with the most literal characters that occurs in the line is replaced by
        one character standing for its message, until no template occurs; what the templates matched literally
        is the part explained. A quote's ``...`` is text a field printed, never a message's own words."""
        if quote in self._explained:
            return self._explained[quote]
        text = quote.replace(INNER, "")
        total = len(text.replace(ELLIPSIS, ""))
        explained, used = 0, []
        # A replacement only takes text away, so a template whose runs the line lacks never occurs later either.
        candidates = [t for t in self.templates if all(run in text for run in t.runs)]
        while True:
            for template in candidates:
                found = _pattern(template).search(text)
                if found:
                    text = text[: found.start()] + INNER + text[found.end() :]
                    explained += template.literal_chars
                    used.append(template.where)
                    break
            else:
                left = " ".join(run.replace(ELLIPSIS, "").strip() for run in text.split(INNER)).strip()
                result = Explanation(explained, total, tuple(used), " ".join(left.split()))
                self._explained[quote] = result
                return result


def message_lines(block: str) -> list[str]:
    """The lines of a quoted message block that say something (a line of only ``...`` stands for lines left out)."""
    return [line.rstrip() for line in block.splitlines() if line.strip() and line.strip() != "..."]


_MARKER = re.compile(r"^\s*<!--\s*message(?::\s*(?P<id>[\w-]+))?\s*-->\s*$")
_FENCE = re.compile(r"^\s*```(?P<lang>\w*)\s*$")


@dataclass(frozen=True)
class Quote:
    """A message the page quotes: ``<!-- message -->`` (or ``<!-- message: ID -->``) then a ```text block."""

    line: int
    text: str
    id: str | None


def page_quotes(text: str) -> tuple[list[Quote], list[str]]:
    """The quoted messages of a page, and the problems of its markers (one line each, naming the line)."""
    lines = text.splitlines()
    quotes, problems = [], []
    for number, line in enumerate(lines, start=1):
        marker = _MARKER.match(line)
        if not marker:
            if "<!-- message" in line:
                problems.append(
                    f"line {number}: a message marker is written <!-- message --> or <!-- message: ID -->"
                )
            continue
        fence = _FENCE.match(lines[number]) if number < len(lines) else None
        if fence is None or fence.group("lang") != "text":
            problems.append(f"line {number}: <!-- message --> must stand right before a ```text block")
            continue
        end = next((k for k in range(number + 1, len(lines)) if lines[k].strip() == "```"), None)
        if end is None:
            problems.append(f"line {number}: the ```text block after <!-- message --> is not closed")
            continue
        quotes.append(Quote(number + 2, "\n".join(lines[number + 1 : end]), marker.group("id")))
    return quotes, problems
