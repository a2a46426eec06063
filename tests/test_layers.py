"""The architecture of ARCHITECTURE.md, kept: imports go bottom-up only, no two modules import each other, no
module grows past 500 lines, and the document's package map names every package.

The layers (ARCHITECTURE.md, "Layers"): the base modules (``config``, ``atomic_io``, ...); ``losses`` ->
``distributed``; ``data``; ``model``; ``runtime`` (what training and evaluation both set up); ``train`` and
``eval`` (the trainer may call the evaluation, never the reverse); ``experiments``; the command line (``cli``) on
top. Every package is in one layer (``PACKAGE_LAYER``): a feature that spans layers has a part in each (feature
shards: ``data.features``, ``model.feature_head``, ``eval.features``). Imports inside functions and under
``TYPE_CHECKING`` count too: a late import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddp_rank"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"

BASE = {"base"}
ALLOWED: dict[str, set[str]] = {
    "base": BASE,
    "losses": BASE | {"losses"},
    "distributed": BASE | {"losses", "distributed"},
    "data": BASE | {"data"},
    "model": BASE | {"data", "model"},
    "runtime": BASE | {"losses", "distributed", "data", "model", "runtime"},
    "eval": BASE | {"losses", "distributed", "data", "model", "runtime", "eval"},
    "train": BASE | {"losses", "distributed", "data", "model", "runtime", "eval", "train"},
    "experiments": BASE | {"data", "model", "runtime", "eval", "train", "experiments"},
    "cli": set(),  # the top: anything
}
PACKAGE_LAYER: dict[str, str] = {
    "ddp_rank": "base",  # the top-level modules: atomic_io, autocast_off, file_checks, logs
    "ddp_rank.config": "base",  # the typed config: below everything, like the top-level modules
    "ddp_rank.losses": "losses",
    "ddp_rank.distributed": "distributed",
    "ddp_rank.data": "data",
    "ddp_rank.model": "model",
    "ddp_rank.runtime": "runtime",
    "ddp_rank.eval": "eval",
    "ddp_rank.train": "train",
    "ddp_rank.experiments": "experiments",
    "ddp_rank.cli": "cli",
}
"""Every package is in one layer, so a module's layer is the first name of its path under ``ddp_rank/``."""
MAX_LINES = 500
LONG_EXEMPT: set[str] = set()  # none: a module that must be longer is named here, with the reason


def _layer(module: str) -> str:
    """The layer of a module (or of a name in it): ``ddp_rank.train.trainer`` -> ``train``,
    ``ddp_rank.model.feature_head.FeatureHeadNet`` -> ``model``, ``ddp_rank.file_checks`` -> ``base``."""
    parts = module.split(".")
    return PACKAGE_LAYER.get(".".join(parts[:2]), "base")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """Every ``ddp_rank`` module ``path`` (the module ``module``) imports, with the line (relative imports
    resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    here = (module or _module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            # ``from ddp_rank import train`` / ``from .. import train``: the name may be a package of its own.
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif _is_import_module_call(node):
            found.append((node.lineno, node.args[0].value))
    return sorted(
        {(line, name) for line, name in found if name == "ddp_rank" or name.startswith("ddp_rank.")}
    )


def _is_import_module_call(node: ast.AST) -> bool:
    """``importlib.import_module("ddp_rank....")`` or ``import_module("ddp_rank....")`` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name == "import_module" and isinstance(node.args[0].value, str)


MODULES = sorted(PACKAGE.rglob("*.py"))


def _packages() -> list[str]:
    """Every package under ``ddp_rank/`` (sub-packages included), as a dotted name."""
    return sorted(_module_name(p) for p in PACKAGE.rglob("__init__.py"))


def test_every_package_has_a_layer() -> None:
    tops = {".".join(p.split(".")[:2]) for p in _packages()}
    assert tops <= set(PACKAGE_LAYER), f"give {sorted(tops - set(PACKAGE_LAYER))} a place in PACKAGE_LAYER"


def _package_graph() -> dict[str, set[str]]:
    """Package -> the packages its files import, at any depth and anywhere in a file (the top-level modules of
    ``ddp_rank/`` are one package, ``ddp_rank``)."""
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        here = ".".join(_module_name(path).split(".")[:2]) if path.parent != PACKAGE else "ddp_rank"
        for _, name in _imports(path):
            top = ".".join(name.split(".")[:2])
            there = top if top in PACKAGE_LAYER else "ddp_rank"
            if there != here:
                graph.setdefault(here, set()).add(there)
    return graph


def test_no_package_imports_one_that_imports_it_back() -> None:
    """Packages as rooms: no arrow runs back up, so no two packages reach each other through their files'
    imports (a knot of packages is one package in many folders, whatever the modules' own order)."""
    graph = _package_graph()
    knots = _cycles(graph)
    assert not knots, "packages that import each other, directly or round about: " + "; ".join(
        " <-> ".join(k) for k in knots
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_only(path: Path) -> None:
    layer = _layer(_module_name(path))
    allowed = ALLOWED[layer]
    if not allowed:
        return
    wrong = [f"line {line}: {name}" for line, name in _imports(path) if _layer(name) not in allowed]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) imports a layer above it: {'; '.join(wrong)}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "data" / "format").rglob("*.py")), ids=lambda p: p.name)
def test_the_shard_format_is_the_bottom_of_the_data_layer(path: Path) -> None:
    """``data.format`` is what building, sampling and reading shards share: it imports none of them (an error
    message it needs from above is moved down, as ``no_manifest`` was out of ``building.shard_sources``)."""
    above = ("ddp_rank.data.building", "ddp_rank.data.sampling", "ddp_rank.data.reading")
    bad = [f"{path.name}:{line}: {name}" for line, name in _imports(path) if name.startswith(above)]
    assert bad == [], f"the shard format imports from above it: {bad}"


def test_the_checker_sees_a_late_upward_import(tmp_path: Path) -> None:
    """The test itself: late, relative, package-name and ``import_module`` imports of the trainer from the
    evaluation are all found, and the check fails on them."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib\n"
        "def f():\n"
        "    from ddp_rank.train.trainer import Trainer\n"
        "    from ..train import chunked\n"
        "    from ddp_rank import train\n"
        "    from .. import train as t\n"
        "    importlib.import_module('ddp_rank.train.setup')\n"
    )
    imports = _imports(probe, "ddp_rank.eval.probe")
    upward_lines = {line for line, name in imports if _layer(name) not in ALLOWED["eval"]}
    assert upward_lines == {3, 4, 5, 6, 7}


def _dependencies(path: Path, names: set[str], module: str | None = None, run_time: bool = False) -> set[str]:
    """The ``ddp_rank`` modules ``path`` imports, anywhere in it (``TYPE_CHECKING`` blocks, functions): a name
    counts as the module that defines it, and ``from package import submodule`` as the submodule alone.

    ``run_time``: what importing it runs instead: no ``TYPE_CHECKING`` block, and the ``__init__`` of every
    package above an imported module that is not already one of this module's own packages."""
    here = (module or _module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    tree = ast.parse(path.read_text(), str(path))
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if run_time and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }

    def owner(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str | None] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found |= {owner(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in names]
            found |= set(subs)
            if len(subs) < len(node.names):
                found.add(owner(base))
        elif _is_import_module_call(node):
            found.add(owner(node.args[0].value))
    modules = {n for n in found if n is not None and n.startswith("ddp_rank")}
    if run_time:
        own = {".".join(here[:i]) for i in range(1, len(here) + 1)}
        modules |= {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)} - own
    return modules - {".".join(here)}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (its strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, set()) & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _mutual_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, set()))


def test_no_two_modules_import_each_other() -> None:
    """A pair that imports each other is one module in two files: neither can be read, tested or moved alone.
    Deferred and type-only imports count: they hide the tie from the interpreter, not from the reader. Break a
    tie by moving the shared piece down or passing a callable or a Protocol (ARCHITECTURE.md, "Rules")."""
    names = {_module_name(p) for p in MODULES}
    graph = {_module_name(p): _dependencies(p, names) for p in MODULES}
    pairs = _mutual_pairs(graph)
    assert not pairs, "modules that import each other: " + "; ".join(f"{a} <-> {b}" for a, b in pairs)


def test_importing_any_module_runs_no_import_cycle() -> None:
    """What the interpreter runs: importing a module runs the ``__init__`` of each package above it, so a cycle
    may pass through a package that re-exports its modules (``feature_head`` -> ``model`` -> ``model.net`` ->
    ``feature_head`` failed with a half-defined module whenever the head was imported first)."""
    names = {_module_name(p) for p in MODULES}
    graph = {_module_name(p): _dependencies(p, names, run_time=True) for p in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_tie_checker_sees_type_only_and_late_imports(tmp_path: Path) -> None:
    """The test itself: a ``TYPE_CHECKING`` import one way and a deferred one back make a pair; ``from package
    import submodule`` ties to the submodule, not to the package."""
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddp_rank.p.b import B\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from ddp_rank.p import a\n")
    (tmp_path / "c.py").write_text("from ddp_rank.p import b\n")
    names = {"ddp_rank.p", "ddp_rank.p.a", "ddp_rank.p.b", "ddp_rank.p.c"}
    graph = {f"ddp_rank.p.{m}": _dependencies(tmp_path / f"{m}.py", names, f"ddp_rank.p.{m}") for m in "abc"}
    graph["ddp_rank.p"] = {"ddp_rank.p.c"}  # the package's __init__ imports c, which imports b from it
    assert graph["ddp_rank.p.c"] == {"ddp_rank.p.b"}
    assert _mutual_pairs(graph) == [("ddp_rank.p.a", "ddp_rank.p.b")]
    # at run time the type-only import is gone, and c's import of b runs the package, which imports c
    run = {
        f"ddp_rank.p.{m}": _dependencies(tmp_path / f"{m}.py", names, f"ddp_rank.p.{m}", True) for m in "abc"
    }
    assert run["ddp_rank.p.a"] == set() and run["ddp_rank.p.c"] == {"ddp_rank.p.b"}
    (tmp_path / "d.py").write_text("from ddp_rank.p.c import C\n")
    d = _dependencies(tmp_path / "d.py", names, "ddp_rank.q.d", True)
    assert d == {"ddp_rank.p.c", "ddp_rank.p"}  # the package above c, not ddp_rank (d's own)
    assert _cycles({**run, "ddp_rank.p": {"ddp_rank.p.c"}, "ddp_rank.p.c": {"ddp_rank.p"}}) == [
        ["ddp_rank.p", "ddp_rank.p.c"]
    ]


def test_no_module_is_over_500_lines() -> None:
    """A module a reader can hold in mind; a longer one has two subjects (split along them, ARCHITECTURE.md)."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > MAX_LINES
        and str(p.relative_to(PACKAGE)) not in LONG_EXEMPT
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _package_map() -> dict[str, str]:
    """ARCHITECTURE.md's package map: ``- `ddp_rank.x.y` (layer): what it owns`` lines of its "Package map"
    section, as {package: layer}."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Package map", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^- `(ddp_rank(?:\.\w+)*)` \(([\w, ]+)\):", section, re.M))


def test_architecture_names_every_package_with_its_layer() -> None:
    mapped = _package_map()
    packages = set(_packages())
    assert packages <= set(mapped), f"add {sorted(packages - set(mapped))} to ARCHITECTURE.md's package map"
    assert set(mapped) <= packages, f"ARCHITECTURE.md maps packages that are gone: {set(mapped) - packages}"
    for package, layer in mapped.items():
        if package == "ddp_rank":
            continue
        assert layer == _layer(package), f"{package}: the map says {layer}, the layer table {_layer(package)}"
