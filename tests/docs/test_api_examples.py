"""The examples of the API reference's docstrings run, and print what they say (doctest).

Every public name of the packages the API pages document (docs/hooks/api.py ``PACKAGES``) whose docstring, or a
member's, holds a ``>>>`` example is run here; the first name each page leads with (``api.LEADS``) must have one.
The examples that write files make a folder with ``tempfile``, which the test points at ``tmp_path``."""

from __future__ import annotations

import doctest
import importlib
import inspect
import logging
import tempfile
from pathlib import Path

import pytest

from docs.hooks import api

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples() -> list[tuple[str, doctest.DocTest]]:
    """``(import path, test)`` of each docstring with examples, once per object (a name exported twice)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found, seen = [], set()
    for package in api.PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            home = importlib.import_module(obj.__module__)
            for test in finder.find(obj, f"{package}.{name}", module=home, globs={}):
                if test.examples:
                    found.append((test.name, test))
    return found


EXAMPLES = _examples()


def test_every_page_leads_with_an_example() -> None:
    names = {name for name, _ in EXAMPLES}
    missing = [
        f"{package}.{lead[0]}" for package, lead in api.LEADS.items() if f"{package}.{lead[0]}" not in names
    ]
    assert not missing, f"the first name of these API pages has no Examples: section: {missing}"


@pytest.mark.parametrize("test", [test for _, test in EXAMPLES], ids=[name for name, _ in EXAMPLES])
def test_the_example_runs_and_prints_what_it_says(
    test: doctest.DocTest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    # A run made earlier in this process (a CLI test) left the ``ddp_rank`` logger writing INFO to stdout, where a
    # first use's log line (a loss's kernel) would join what the example prints; a user's script has no such handler.
    monkeypatch.setattr(logging.getLogger("ddp_rank"), "handlers", [])
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)
