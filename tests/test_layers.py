"""The packages import bottom-up only: a module that imports a layer above its own fails here.

The layers (DESIGN.md): the base modules (``config``, ``atomic_io``); ``losses`` -> ``distributed``; ``data``;
``model``; ``runtime`` (what training and evaluation both set up); ``train`` and ``eval`` (the trainer may call
the evaluation, never the reverse); ``experiments``; the command line (``cli``) on top. Imports inside
functions count too: a late import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ddp_rank"

BASE = {"base"}
BASE_PACKAGES = {"config"}  # the typed config: below everything, like the top-level modules
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


def _layer(module: str) -> str:
    """``ddp_rank.train.trainer`` -> ``train``; a top-level module (``ddp_rank.config``) is ``base``."""
    parts = module.split(".")
    if len(parts) < 2:
        return "base"
    return parts[1] if parts[1] in ALLOWED and parts[1] not in BASE_PACKAGES else "base"


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


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    placed = set(ALLOWED) | BASE_PACKAGES
    assert packages <= placed, f"give {sorted(packages - placed)} a place in ALLOWED"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_only(path: Path) -> None:
    layer = _layer(_module_name(path))
    allowed = ALLOWED[layer]
    if not allowed:
        return
    wrong = [f"line {line}: {name}" for line, name in _imports(path) if _layer(name) not in allowed]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) imports a layer above it: {'; '.join(wrong)}"


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
