"""benchmarks/suite.py: the suite's time taken from an export of a commit, its figures read from pytest's
output (the summary line and the slowest tests), the CPU of the processes it waited for."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from benchmarks import suite

# What `make test` prints at its end (pytest -q --durations=15), shortened.
PYTEST_TAIL = """\
============================= slowest 15 durations =============================
42.72s call     tests/train/test_multinode.py::test_two_machines_train_resume_and_evaluate_like_one
13.69s setup    tests/train/test_preemption.py::test_a_signal_stops_every_rank
=========================== short test summary info ============================
SKIPPED [1] tests/train/test_device_feed.py:165: needs a CUDA GPU
================= 2417 passed, 28 skipped in 449.22s (0:07:29) =================
"""


def test_the_suite_runs_on_an_export_and_its_figures_are_read_back(tmp_path: Path) -> None:
    make = tmp_path / "make.py"
    make.write_text(
        textwrap.dedent(f"""
        import pathlib, sys, time
        assert pathlib.Path("pyproject.toml").is_file() and pathlib.Path(".git").is_dir()  # an export, a repo
        assert sys.argv[1:3] == ["test", "VENV={tmp_path}"], sys.argv
        end = time.process_time() + 0.3
        while time.process_time() < end:  # CPU that the run must count
            pass
        print({PYTEST_TAIL!r})
    """)
    )
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    run = suite.run_suite("HEAD", "test", tmp_path, make=(sys.executable, str(make)))
    assert run.exit_code == 0 and run.counts == "2417 passed, 28 skipped"
    assert run.cpu_s >= 0.3 and run.wall_s >= run.cpu_s / 2
    assert run.slowest[0] == (
        42.72,
        "call",
        "tests/train/test_multinode.py::test_two_machines_train_resume_and_evaluate_like_one",
    )
    assert [s[1] for s in run.slowest] == ["call", "setup"]
    assert (tmp_path / ".installed-stamp").is_file()  # marked current: make does not reinstall
    text = suite.report([run])
    assert f"`HEAD` ({run.commit})" in text and "| 0 |" in text and "2417 passed, 28 skipped" in text
    assert "The 2 slowest of `HEAD`" in text and "| 42.7 | call |" in text
