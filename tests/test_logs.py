"""The run's log: events on stdout, problems on stderr, rank 0 in full and the other ranks' problems tagged,
and everything rank 0 logs kept in the run directory's ``train.log``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from ddp_rank.logs import configure_run_logging

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


@pytest.fixture(autouse=True)
def _restore() -> object:
    yield
    configure_run_logging(0)  # leave the console-only set-up for the next test


def test_rank_zero_logs_events_and_problems_to_the_console_and_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_run_logging(0, tmp_path / "run")
    log = logging.getLogger("ddp_rank.train.trainer")
    log.info("checkpoint runs/x/step-00000004")
    log.warning("cat3: a step needs 6 images, it has 4\nsecond line")
    out, err = capsys.readouterr()
    assert re.fullmatch(rf"{STAMP} checkpoint runs/x/step-00000004\n", out)
    first, second = err.splitlines()
    assert re.fullmatch(rf"{STAMP} cat3: a step needs 6 images, it has 4", first)
    assert second.strip() == "second line" and second.startswith(" " * 20), "continuations line up"
    kept = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert re.fullmatch(rf"{STAMP} rank 0 INFO ddp_rank.train.trainer: checkpoint runs/x/step-00000004", kept[0])
    assert "rank 0 WARNING ddp_rank.train.trainer: cat3" in kept[1]


def test_other_ranks_show_only_their_problems_tagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    configure_run_logging(3, tmp_path / "run")
    log = logging.getLogger("ddp_rank.data.reading.stream")
    log.info("an event every rank meets alike")
    log.warning("class 7 of shard a.tar unreadable; replaced from the plan's reserve")
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(rf"{STAMP} \[rank 3\] class 7 of shard a.tar unreadable; replaced .*\n", err)
    assert not (tmp_path / "run" / "train.log").exists(), "rank 0 alone writes the run's log"


def test_configuring_again_replaces_the_handlers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    configure_run_logging(0, tmp_path / "a")
    configure_run_logging(0, tmp_path / "b")
    logging.getLogger("ddp_rank").info("once")
    assert capsys.readouterr().out.count("once") == 1
    assert "once" in (tmp_path / "b" / "train.log").read_text()
    assert "once" not in (tmp_path / "a" / "train.log").read_text()
