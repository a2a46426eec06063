"""The packages whose public names load on first use (``ddp_rank.data``, ``ddp_rank.model``) list them before
they are loaded (``dir()``, tab completion) and keep each once loaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import importlib, json, sys
package = importlib.import_module(sys.argv[1])
listed = dir(package)
loaded_before = sorted(set(package.__all__) & set(vars(package)))
first = getattr(package, package.__all__[0])
print(json.dumps({
    "missing": sorted(set(package.__all__) - set(listed)),
    "private_listed": "_EXPORTS" in listed,
    "loaded_before": loaded_before,
    "kept": vars(package).get(package.__all__[0]) is first,
}))
"""


@pytest.mark.parametrize("package", ["ddp_rank.data", "ddp_rank.model"])
def test_public_names_are_listed_before_use_and_kept_once_loaded(package: str) -> None:
    """In a fresh interpreter: nothing is loaded by ``dir()``, yet every public name is in it."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, package], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    got = json.loads(out.splitlines()[-1])
    assert got == {"missing": [], "private_listed": True, "loaded_before": [], "kept": True}
