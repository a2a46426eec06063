"""The generated Python API pages (docs/hooks/api.py): every public name on its package's page, headed by its
import path, every ``:::`` target importable.

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


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return api.api_pages()


@pytest.fixture(scope="module")
def page(pages: dict[str, str]) -> str:
    """Every generated page, one after the other."""
    return "\n".join(pages.values())


@pytest.mark.parametrize("package", api.PACKAGES)
def test_every_name_of_a_package_all_is_on_the_page_as_its_object(
    pages: dict[str, str], package: str
) -> None:
    module = importlib.import_module(package)
    section = pages[api.page_of(package)]
    assert (module.__doc__ or "").split("\n", 1)[0].replace("``", "`") in section  # the package's docstring
    targets = set(api.targets(section))
    for name in module.__all__:
        documented = [t for t in targets if t.rsplit(".", 1)[-1] == name]
        assert documented or f"- `{package}.{name}`: the same object as" in section, (
            f"{package}.{name} is not on {api.page_of(package)}"
        )
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
    # An import in a code block runs to the line's end; one in a code span (`from x import Y` in a table) to
    # the span's closing backtick.
    pattern = re.compile(r"from (ddp_rank(?:\.\w+)+) import (?:\(([^)]*)\)|([^\n#`]*))")
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
    found = {"reference/api/ (generated)": list(api.targets(page))}
    for path in _pages():
        found[path.relative_to(REPO).as_posix()] = list(api.targets(path.read_text(encoding="utf-8")))
    assert len(found["reference/api/ (generated)"]) > 50
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


def test_each_entry_is_headed_by_its_import_path_not_its_defining_module(pages: dict[str, str]) -> None:
    losses = pages["reference/api/losses.md"]
    assert (
        '::: ddp_rank.losses.fastap.FastAPLoss\n    options:\n      heading: "ddp_rank.losses.FastAPLoss"'
        in losses
    )
    data = pages["reference/api/data.md"]
    assert 'heading: "ddp_rank.data.StreamLoader"' in data
    assert "ddp_rank.data.reading" not in "".join(re.findall(r'heading: "([^"]+)"', data))


def test_a_page_per_package_each_in_the_index_and_the_nav(pages: dict[str, str]) -> None:
    assert set(pages) == {api.INDEX_PAGE} | {api.page_of(p) for p in api.PACKAGES}
    for package in api.PACKAGES:
        assert f"[`{package}`]({api.page_of(package).rsplit('/', 1)[-1]})" in pages[api.INDEX_PAGE]
    nav = [{"Home": "index.md"}, {"Reference": ["reference/index.md", {"Python API": api.INDEX_PAGE}]}]
    config = api.on_config({"nav": nav})
    section = config["nav"][1]["Reference"][1]["Python API"]
    assert section == [api.INDEX_PAGE] + [{p: api.page_of(p)} for p in api.PACKAGES]


def test_a_package_page_opens_with_its_main_names() -> None:
    names = [entry.name for entry in api.entries("ddp_rank.data")]
    assert names[:3] == ["Manifest", "ShardStream", "StreamLoader"]
    assert sorted(names) == sorted(importlib.import_module("ddp_rank.data").__all__)
    for package, lead in api.LEADS.items():
        missing = set(lead) - set(importlib.import_module(package).__all__)
        assert not missing, f"api.LEADS names {missing}, not in {package}.__all__"


def test_an_object_exported_twice_links_to_its_first_page() -> None:
    """A target already rendered by an earlier package's page is not rendered again: the entry links there."""
    step = "ddp_rank.train.chunking.step.forward_backward"
    earlier = api.Entry("ddp_rank.distributed", "forward_backward", step)  # as if distributed exported it too
    page = api.package_page("ddp_rank.train", {step: earlier})
    link = f"[`ddp_rank.distributed.forward_backward`](distributed.md#{step})"
    assert f"- `ddp_rank.train.forward_backward`: the same object as {link}." in page
    assert f"::: {step}" not in page
