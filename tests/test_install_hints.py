"""The install path that pages and messages name: a clone and pip with ``constraints.txt`` (docs/install.md),
never a package index the project is not on."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib

from ddp_rank.config import ConfigError
from ddp_rank.extras import install_hint

ROOT = Path(__file__).resolve().parents[1]
INDEX_INSTALL = re.compile(r"pip install\s+['\"]?ddp[_-]rank\b")
"""``pip install ddp_rank``, ``pip install 'ddp_rank[pml]'``, ...: an index that has no ddp_rank."""
WHERE_USERS_LOOK = ["ddp_rank", "docs", "examples", "launch", "configs", "README.md"]


def _text_files() -> list[Path]:
    files = []
    for name in WHERE_USERS_LOOK:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [
            p
            for p in candidates
            if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ""}
        ]
    return files


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_no_page_or_message_names_a_package_index() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _text_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if INDEX_INSTALL.search(line)
    ]
    assert not found, (
        "name the clone's install (ddp_rank.extras.install_hint, docs/install.md):\n" + "\n".join(found)
    )


def test_the_hint_names_the_documented_command() -> None:
    assert install_hint("pml", "eval") == (
        'pip install -c constraints.txt -e ".[pml,eval]" (in your clone of ddp_rank; docs/install.md)'
    )
    with pytest.raises(ValueError, match="at least one extra"):
        install_hint()


def test_every_extra_a_message_or_page_names_exists() -> None:
    named = set()
    for path in _text_files():
        text = path.read_text(errors="replace")
        named |= set(re.findall(r"install_hint\(\s*['\"](\w+)['\"]", text))
        named |= {e for group in re.findall(r'-e "\.\[([\w,]+)\]"', text) for e in group.split(",")}
    assert {"pml", "eval", "models", "demo"} <= named
    assert named <= _extras(), f"extras not in pyproject.toml: {named - _extras()}"


def test_the_install_page_is_in_the_nav_and_the_readme() -> None:
    assert "install.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(docs/install.md)" in (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "install.md").read_text()
    assert 'pip install -c constraints.txt -e ".[pml,eval]"' in page
    documented = set(re.findall(r"^\| `(\w+)`", page, re.M))
    assert documented <= _extras(), f"the page's table names extras that are gone: {documented - _extras()}"


def test_a_missing_pml_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp_rank.train.pml_loss import build_pml

    monkeypatch.setitem(sys.modules, "pytorch_metric_learning", None)  # import fails as when not installed
    with pytest.raises(ConfigError) as caught:
        build_pml("pml:ContrastiveLoss()", "", num_classes=4, embedding_size=8)
    assert install_hint("pml") in str(caught.value)


def test_a_missing_tracker_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddp_rank.train import trackers

    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as caught:
        trackers.check_trackers(["mlflow"])
    assert "pip install mlflow-skinny" in str(caught.value) and install_hint("mlflow") in str(caught.value)
