"""MkDocs hook: the Python API reference page, generated from the public packages' ``__all__`` at every build.

Why generated: a list of names typed into a page misses the name exported tomorrow and keeps the one removed
today. ``reference/api.md`` has a section per public package (its docstring, then each name of its ``__all__``
rendered by mkdocstrings from its docstring and signature). mkdocstrings reads the source statically, so it must
be given the module that *defines* a name: ``ddp_rank.data``, ``ddp_rank.model`` and ``ddp_rank.eval`` load
their names lazily through a module ``__getattr__``, which a static reader cannot follow. Each name is therefore
imported here and pointed at ``obj.__module__`` (or the package's own lazy table, for a value without one).
Nothing is written into ``docs/``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

API_PAGE = "reference/api.md"
# The packages a user imports from, in the order a reader meets them (bottom layer first, then the step, the
# data, the model, evaluation, the config).
PACKAGES = (
    "ddp_rank.losses",
    "ddp_rank.distributed",
    "ddp_rank.train",
    "ddp_rank.data",
    "ddp_rank.model",
    "ddp_rank.eval",
    "ddp_rank.config",
)
INTRO = (
    "The names a training loop, an evaluation or a deployment of your own imports, generated at each build of "
    "this site from each package's `__all__` and rendered from the docstrings. Import a name from its package "
    "(`from ddp_rank.losses import FastAPLoss`, `from ddp_rank.eval import Searcher`): the heading of each entry "
    "shows the module that defines it, which is the package's inside and may move."
)


@dataclass(frozen=True)
class Entry:
    """One public name: ``name`` as imported from ``package``, documented at ``target`` (its defining module)."""

    package: str
    name: str
    target: str


def entries(package: str) -> list[Entry]:
    """The names of ``package.__all__`` with the dotted path mkdocstrings documents each at, in ``__all__``'s
    order."""
    module = importlib.import_module(package)
    return [Entry(package, name, _target(module, name)) for name in module.__all__]


def _target(package: Any, name: str) -> str:
    obj = getattr(package, name)
    defined_in = getattr(obj, "__module__", None) if inspect.isclass(obj) or callable(obj) else None
    if isinstance(defined_in, str) and defined_in.startswith("ddp_rank"):
        home = sys.modules.get(defined_in)
        if home is not None and getattr(home, name, None) is obj:
            return f"{defined_in}.{name}"
    lazy = getattr(package, "_EXPORTS", {})
    if name in lazy:  # a value (a constant) of a lazily loading package
        return f"{lazy[name]}.{name}"
    # A value the package imports eagerly: mkdocstrings follows the package's own import to it.
    return f"{package.__name__}.{name}"


def markdown_docstring(text: str) -> str:
    """A package docstring as Markdown: reST's ````code```` and ``:role:`~a.b.c``` as code spans, paragraphs and
    ``-`` lists kept."""
    text = re.sub(
        r":\w+:`~?([^`]+)`", lambda m: f"`{m[1].rsplit('.', 1)[-1] if '~' in m[0] else m[1]}`", text
    )
    text = text.replace("``", "`")
    return text.strip()


def api_page() -> str:
    """The Markdown of ``reference/api.md``."""
    out = ["# Python API", "", INTRO, ""]
    seen: dict[str, str] = {}  # target -> the package whose section documents it
    for package in PACKAGES:
        module = importlib.import_module(package)
        out += [f"## `{package}` {{ #{package} }}", "", markdown_docstring(inspect.getdoc(module) or ""), ""]
        for entry in entries(package):
            if entry.target in seen:  # one object exported by two packages: documented once
                out += [f"- `{entry.name}`: see [`{seen[entry.target]}`](#{entry.target}).", ""]
                continue
            seen[entry.target] = package
            out += [f"::: {entry.target}", ""]
    return "\n".join(out)


def targets(markdown: str) -> Iterator[str]:
    """The ``::: identifier`` lines of a page, as mkdocstrings reads them."""
    for line in markdown.splitlines():
        match = re.match(r"^:::\s+(\S+)", line)
        if match:
            yield match[1]


# ---------------------------------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add the generated page to the build."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, API_PAGE, content=api_page()))
    return files
