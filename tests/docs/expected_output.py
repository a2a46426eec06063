"""Expected-output blocks: a page's claim about what a command prints, checked against what it printed
(docs/code-blocks.md, "Output the suite checks").

A ```text block right after the marker ``<!-- expected-output -->`` is compared with the output (stdout and
stderr together) of the block just before it. Its lines must be found in that output in a row, anywhere in it;
inside a line ``...`` stands for any text, a line that is only ``...`` for any number of lines, and
``{{name}}`` for a value that varies from run to run but must be the same wherever the name appears again in the
block ("both ranks print the same loss"). Trailing spaces are not compared; blank lines at the block's ends are
dropped. After ``<!-- expected-output: any order -->`` each line must match a line of its own anywhere in the
output, in any order: for processes whose lines arrive in the order they happen to finish (``...`` alone on a
line means nothing there).

Why not doctest's rules: they compare a whole output, and a run's log has timestamps, paths of a temporary
folder and lines a page does not talk about; a page quotes the part it explains.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANY_TEXT = "..."
_PIECES = re.compile(r"(\.\.\.|\{\{[A-Za-z_]\w*\}\})")


@dataclass(frozen=True)
class Mismatch:
    """Why an output does not hold the expected block: the first expected line (1-based within the block) that
    no attempt got past, and the values the placeholders had there."""

    line: int
    text: str
    bound: dict[str, str]

    def describe(self) -> str:
        values = ", ".join(f"{{{{{k}}}}}={v!r}" for k, v in self.bound.items())
        return f"line {self.line} of the expected output, {self.text!r}, is not in the output" + (
            f" (with {values})" if values else ""
        )


def expected_lines(block: str) -> list[str]:
    lines = [line.rstrip() for line in block.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_pattern(line: str, bound: dict[str, str]) -> re.Pattern[str]:
    parts, seen = [], set()
    for piece in _PIECES.split(line):
        if piece == ANY_TEXT:
            parts.append(".*?")
        elif _PIECES.fullmatch(piece):
            name = piece[2:-2]
            if name in bound:
                parts.append(re.escape(bound[name]))
            elif name in seen:
                parts.append(f"(?P={name})")
            else:
                seen.add(name)
                parts.append(f"(?P<{name}>.+?)")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def match_output(expected: str, output: str, *, any_order: bool = False) -> Mismatch | None:
    """None when ``output`` holds ``expected`` (the rules above), else where it stops."""
    want = expected_lines(expected)
    have = [line.rstrip() for line in output.splitlines()]
    if not want:
        return Mismatch(1, "", {})
    if any_order:
        return _match_any_order(want, have)
    best = Mismatch(1, want[0], {})

    def search(w: int, h: int, bound: dict[str, str], anywhere: bool) -> bool:
        nonlocal best
        if w == len(want):
            return True
        if want[w] == ANY_TEXT:
            return search(w + 1, h, bound, True)
        pattern = _line_pattern(want[w], bound)
        for start in range(h, len(have)) if anywhere else range(h, min(h + 1, len(have))):
            found = pattern.fullmatch(have[start])
            if found is None:
                continue
            if search(w + 1, start + 1, {**bound, **found.groupdict()}, False):
                return True
        if w + 1 > best.line:
            best = Mismatch(w + 1, want[w], dict(bound))
        return False

    return None if search(0, 0, {}, True) else best


def _match_any_order(want: list[str], have: list[str]) -> Mismatch | None:
    """Each line of ``want`` (``...`` lines left out) matched by a distinct line of ``have``, placeholders bound
    across them; backtracks over the choices, which few lines keep cheap."""
    lines = [(n, line) for n, line in enumerate(want, start=1) if line != ANY_TEXT]
    best = Mismatch(lines[0][0], lines[0][1], {}) if lines else None

    def search(i: int, used: frozenset[int], bound: dict[str, str]) -> bool:
        nonlocal best
        if i == len(lines):
            return True
        number, line = lines[i]
        pattern = _line_pattern(line, bound)
        for h, text in enumerate(have):
            found = None if h in used else pattern.fullmatch(text)
            if found is not None and search(i + 1, used | {h}, {**bound, **found.groupdict()}):
                return True
        if best is None or number > best.line:
            best = Mismatch(number, line, dict(bound))
        return False

    return None if search(0, frozenset(), {}) else best
