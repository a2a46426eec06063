"""MkDocs hook: the Python API reference, a page per public package, generated from their ``__all__`` at every build.

Why generated: a list of names typed into a page misses the name exported tomorrow and keeps the one removed
today. ``reference/api/index.md`` lists the public packages; ``reference/api/<package>.md`` holds one package: its
docstring, then each name of its ``__all__`` rendered by mkdocstrings from its docstring and signature, its main
names (:data:`LEADS`) first. Why a page per package: the whole API on one page was hundreds of kilobytes.

Each entry is headed by the path a user imports (``ddp_rank.losses.FastAPLoss``), not the module that defines it
(``ddp_rank.losses.fastap``, the package's inside, which may move). mkdocstrings reads the source statically, so
it must still be given the defining module: ``ddp_rank.data``, ``ddp_rank.model`` and ``ddp_rank.eval`` load
their names lazily through a module ``__getattr__``, which a static reader cannot follow. Each name is therefore
imported here and pointed at ``obj.__module__`` (or the package's own lazy table, for a value without one), and
the entry's ``heading`` option shows the import path. Nothing is written into ``docs/``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

API_DIR = "reference/api"
INDEX_PAGE = f"{API_DIR}/index.md"
NAV_TITLE = "Python API"
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
# The names a package's page opens with, in this order (the rest follow in ``__all__``'s order): what a user's
# own loop calls first. The first of each carries a runnable example, which tests/docs/test_api_examples.py runs
# with every other example of the API's docstrings.
LEADS = {
    "ddp_rank.losses": ("FastAPLoss", "PNPLoss", "SmoothAPLoss"),
    "ddp_rank.distributed": ("GlobalBatchLoss",),
    "ddp_rank.train": ("forward_backward", "PlainBackend"),
    "ddp_rank.data": ("Manifest", "ShardStream", "StreamLoader"),
    "ddp_rank.model": ("build_model", "EmbeddingNet"),
    "ddp_rank.eval": ("SearchIndex", "Embeddings", "build_index", "Searcher"),
    "ddp_rank.config": ("load_config", "Config"),
}
INTRO = (
    "The names a training loop, an evaluation or a deployment of your own imports, a page per package, "
    "generated at each build of this site from each package's `__all__` and rendered from the docstrings. "
    "Import a name from its package, as each entry's heading spells it (`from ddp_rank.losses import "
    "FastAPLoss`, `from ddp_rank.eval import Searcher`); the modules inside a package may move."
)


@dataclass(frozen=True)
class Entry:
    """One public name: ``name`` as imported from ``package``, documented at ``target`` (its defining module)."""

    package: str
    name: str
    target: str

    @property
    def import_path(self) -> str:
        """The dotted name a user writes: ``ddp_rank.losses.FastAPLoss``."""
        return f"{self.package}.{self.name}"


def page_of(package: str) -> str:
    """The generated page of a package: ``ddp_rank.losses`` -> ``reference/api/losses.md``."""
    return f"{API_DIR}/{package.removeprefix('ddp_rank.').replace('.', '-')}.md"


def entries(package: str) -> list[Entry]:
    """The names of ``package.__all__`` with the dotted path mkdocstrings documents each at: the package's
    :data:`LEADS` first, then the others in ``__all__``'s order."""
    module = importlib.import_module(package)
    lead = [name for name in LEADS.get(package, ()) if name in module.__all__]
    names = lead + [name for name in module.__all__ if name not in lead]
    return [Entry(package, name, _target(module, name)) for name in names]


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


def _summary(package: str) -> str:
    """The first sentence of a package's docstring, for the index."""
    doc = markdown_docstring(inspect.getdoc(importlib.import_module(package)) or "")
    first = " ".join(doc.split("\n\n", 1)[0].split())
    return first.split(". ", 1)[0].rstrip(".") + "."


def index_page() -> str:
    """The Markdown of ``reference/api/index.md``: each package, its page and what it holds."""
    out = ["# Python API", "", INTRO, ""]
    for package in PACKAGES:
        out.append(f"- [`{package}`]({page_of(package).rsplit('/', 1)[-1]}): {_summary(package)}")
    return "\n".join(out) + "\n"


def package_page(package: str, documented: dict[str, Entry]) -> str:
    """The Markdown of one package's page. ``documented`` maps each target already rendered (by a package
    earlier in :data:`PACKAGES`) to its entry: an object exported by two packages is documented once, and the
    second links to the first."""
    module = importlib.import_module(package)
    out = [f"# `{package}`", "", markdown_docstring(inspect.getdoc(module) or ""), ""]
    for entry in entries(package):
        first = documented.get(entry.target)
        if first is not None:
            link = f"{page_of(first.package).rsplit('/', 1)[-1]}#{entry.target}"
            out += [f"- `{entry.import_path}`: the same object as [`{first.import_path}`]({link}).", ""]
            continue
        documented[entry.target] = entry
        out += [
            f"::: {entry.target}",
            "    options:",
            f'      heading: "{entry.import_path}"',
            f'      toc_label: "{entry.name}"',
            "      heading_level: 2",
            "",
        ]
    return "\n".join(out)


def api_pages() -> dict[str, str]:
    """Every generated page, ``{path under docs/: Markdown}``: the index, then a page per package."""
    pages = {INDEX_PAGE: index_page()}
    documented: dict[str, Entry] = {}
    for package in PACKAGES:
        pages[page_of(package)] = package_page(package, documented)
    return pages


def nav_entries() -> list[Any]:
    """The nav's Python API section: the index, then ``{package: page}`` for each package."""
    return [INDEX_PAGE] + [{package: page_of(package)} for package in PACKAGES]


def targets(markdown: str) -> Iterator[str]:
    """The ``::: identifier`` lines of a page, as mkdocstrings reads them."""
    for line in markdown.splitlines():
        match = re.match(r"^:::\s+(\S+)", line)
        if match:
            yield match[1]


def _fill_nav(items: list[Any]) -> bool:
    """Replace the entry ``Python API: reference/api/index.md`` of a nav (at any depth) with the section."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        for title, value in item.items():
            if title == NAV_TITLE and value == INDEX_PAGE:
                items[i] = {NAV_TITLE: nav_entries()}
                return True
            if isinstance(value, list) and _fill_nav(value):
                return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    """Give the nav's ``Python API: reference/api/index.md`` entry a page per package."""
    _fill_nav(config["nav"] or [])
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the build."""
    from mkdocs.structure.files import File

    for path, content in api_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
