"""The site's version (docs/hooks/version.py) and its changelog page: read from the package, never typed in."""

from __future__ import annotations

import re
from pathlib import Path

import ddp_rank
from docs.hooks import version

REPO = Path(__file__).resolve().parents[2]


def test_the_site_name_and_footer_carry_the_package_version() -> None:
    config = version.on_config({"site_name": "ddp_rank", "extra": {}, "copyright": None})
    assert config["site_name"] == f"ddp_rank {ddp_rank.__version__}"
    assert config["extra"]["version"] == ddp_rank.__version__
    assert ddp_rank.__version__ in config["copyright"]
    assert version.on_config(config)["site_name"] == f"ddp_rank {ddp_rank.__version__}"  # once, not twice


def test_the_package_version_is_the_one_pyproject_declares() -> None:
    declared = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None, "pyproject.toml: no version line"
    assert ddp_rank.__version__ == declared[1], (
        "pyproject.toml and ddp_rank/__init__.py name different versions"
    )


def test_the_changelog_page_includes_the_repository_changelog() -> None:
    assert '--8<-- "CHANGELOG.md"' in (REPO / "docs" / "changelog.md").read_text()
    assert "changelog.md" in (REPO / "mkdocs.yml").read_text()
