"""The generated Python API page (docs/hooks/api.py): every public name on it, every ``:::`` target importable.

mkdocstrings renders a target from the source it reads; a target that names the package of a lazily loaded name,
or a module a name moved out of, builds an empty or broken entry, so each target is imported here as Python
would."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from docs.hooks import api

REPO = Path(__file__).resolve().parents[2]
# The names the tutorials and concepts pages use: each public, from its package, and documented.
USED_BY_THE_DOCS = {
    "ddp_rank.train": [
        "PlainBackend",
        "DeepSpeedBackend",
        "AccelerateBackend",
        "GhostBatchNorm",
        "convert_to_ghost",
    ],
    "ddp_rank.data": ["ScheduleConfig", "EvalShards", "GlobalPlan", "deal", "ShardStream", "StreamLoader"],
    "ddp_rank.eval": ["SearchIndex", "IndexSpec", "load_export", "save_export", "Embeddings", "Searcher"],
}


def resolve(target: str) -> Any:
    """The object a dotted ``:::`` target names: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(target)


def _section(page: str, package: str) -> str:
    start = page.index(f"## `{package}` {{")
    end = page.find("\n## ", start + 1)
    return page[start : end if end != -1 else len(page)]


@pytest.fixture(scope="module")
def page() -> str:
    return api.api_page()


@pytest.mark.parametrize("package", api.PACKAGES)
def test_every_name_of_a_package_all_is_on_the_page_as_its_object(page: str, package: str) -> None:
    module = importlib.import_module(package)
    section = _section(page, package)
    assert (module.__doc__ or "").split("\n", 1)[0].replace("``", "`") in section  # the package's docstring
    targets = set(api.targets(section))
    for name in module.__all__:
        documented = [t for t in targets if t.rsplit(".", 1)[-1] == name]
        assert documented or f"- `{name}`: see" in section, f"{package}.{name} is not on reference/api.md"
        for target in documented:
            assert resolve(target) is getattr(module, name), f"{target} is not {package}.{name}"


def test_a_lazily_loaded_name_points_at_its_defining_module(page: str) -> None:
    assert "::: ddp_rank.data.reading.loader.StreamLoader" in page
    assert "::: ddp_rank.eval.search.Searcher" in page
    assert "::: ddp_rank.data.StreamLoader" not in page


@pytest.mark.parametrize("package", sorted(USED_BY_THE_DOCS))
def test_the_names_the_docs_use_are_exported(package: str) -> None:
    module = importlib.import_module(package)
    for name in USED_BY_THE_DOCS[package]:
        assert name in module.__all__, f"{name} is used by the docs but not in {package}.__all__"


def test_every_name_the_pages_import_is_public_in_its_package() -> None:
    """``from ddp_rank.eval.search import Searcher`` in a page: ``Searcher`` must be in ``ddp_rank.eval.__all__``
    (and so on the API page), whichever module of the package the page imports it from."""
    pattern = re.compile(r"from (ddp_rank(?:\.\w+)+) import (?:\(([^)]*)\)|([^\n#]*))")
    missing = []
    for path in [REPO / "README.md", *_pages()]:
        for module, wrapped, line in pattern.findall(path.read_text(encoding="utf-8")):
            package = ".".join(module.split(".")[:2])
            if package not in api.PACKAGES:
                continue
            public = importlib.import_module(package).__all__
            for name in (n.split()[0] for n in (wrapped or line).split(",") if n.strip()):
                if name not in public:
                    missing.append(f"{path.relative_to(REPO)}: {module}.{name} is not in {package}.__all__")
    assert not missing, "\n".join(missing)


def _pages() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md"))


def test_every_target_of_every_page_imports(page: str) -> None:
    found = {"reference/api.md (generated)": list(api.targets(page))}
    for path in _pages():
        found[path.relative_to(REPO).as_posix()] = list(api.targets(path.read_text(encoding="utf-8")))
    assert len(found["reference/api.md (generated)"]) > 50
    broken = []
    for where, targets in found.items():
        for target in targets:
            try:
                resolve(target)
            except (ImportError, AttributeError) as exc:
                broken.append(f"{where}: ::: {target} ({exc})")
    assert not broken, "\n".join(broken)


def test_targets_are_read_as_mkdocstrings_reads_them() -> None:
    assert list(api.targets("text\n::: a.b.C\n    options:\n:::  d.e\n x ::: no\n")) == ["a.b.C", "d.e"]
    with pytest.raises(AttributeError):
        resolve("ddp_rank.losses.NoSuchLoss")


def test_package_docstrings_become_markdown() -> None:
    text = api.markdown_docstring("See :mod:`~ddp_rank.config.schema` and :func:`ddp_rank.x.f`, ``code``.")
    assert text == "See `schema` and `ddp_rank.x.f`, `code`."
