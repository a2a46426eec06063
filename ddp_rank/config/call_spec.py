"""``pml:ClassName(key=value, ...)``: a class of an outside library named in a config value, with its arguments.

Why a call written as text and not a nested section: the arguments differ for every class (a margin, a
temperature, a number of proxies), so no schema can list them; the text is parsed with :mod:`ast` into a name
and literal keyword arguments (numbers, strings, booleans, None, lists, tuples), never evaluated, so a config file
cannot run code. The class itself is looked up, and its arguments checked, where it is built.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from ddp_rank.config.checks import ConfigError

PML_PREFIX = "pml:"
"""``loss.name=pml:<loss>(...)`` and ``loss.miner=pml:<miner>(...)`` name pytorch-metric-learning classes."""


@dataclass(frozen=True)
class CallSpec:
    """A class name and the keyword arguments to build it with."""

    name: str
    kwargs: dict[str, Any]

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"


def parse_call(text: str, key: str, example: str) -> CallSpec:
    """``'Name'`` or ``'Name(a=1, b="x")'`` (after the ``pml:`` prefix) -> :class:`CallSpec`; a
    :class:`ConfigError` naming ``key`` and showing ``example`` otherwise."""
    body = text.removeprefix(PML_PREFIX).strip()
    hint = f"{key}={text!r}: write a class name with keyword arguments of plain values, e.g. {key}={example}"
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        raise ConfigError(f"{hint} (it does not parse)") from None
    if isinstance(tree, ast.Name):
        return CallSpec(tree.id, {})
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name):
        raise ConfigError(hint)
    if tree.args:
        raise ConfigError(f"{hint} (arguments by name only)")
    kwargs: dict[str, Any] = {}
    for keyword in tree.keywords:
        if keyword.arg is None:
            raise ConfigError(f"{hint} (no ** arguments)")
        try:
            kwargs[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            raise ConfigError(f"{hint} ({keyword.arg} is not a plain value)") from None
    return CallSpec(tree.func.id, kwargs)
