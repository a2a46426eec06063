"""The versions pyproject.toml declares are the versions CI tests (issue: floors that were never run).

``constraints.txt`` pins what ``make`` installs and CI tests; for every package it pins that pyproject.toml
declares, the declared floor must be that pin. An older floor would promise a torch, accelerate or DeepSpeed
that no test has run; a floor above the pin could not be installed with the constraints at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not a name==version pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts += [t for t in extra if not t.startswith("ddp_rank")]
    return [Requirement(t) for t in texts]


def _floor(req: Requirement) -> Version | None:
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return max(floors) if floors else None


def test_every_pinned_package_is_declared_with_its_pin_as_floor() -> None:
    pins = _pins()
    checked = []
    for req in _declared():
        name = canonicalize_name(req.name)
        if name not in pins:
            continue
        checked.append(name)
        floor = _floor(req)
        assert floor == pins[name], (
            f"pyproject.toml declares {req} but CI tests {req.name}=={pins[name]} (constraints.txt): make the floor "
            f"the tested version, or add a CI leg that installs and tests the older one"
        )
        assert req.specifier.contains(str(pins[name])), f"{req} excludes the tested {req.name}=={pins[name]}"
    for core in ("torch", "torchvision", "accelerate", "deepspeed", "webdataset"):
        assert core in checked, f"{core} is pinned in constraints.txt and declared in pyproject.toml"
