"""``data.sampler=auto`` (the default): the category-aware sampler when the training split spans enough
categories, classes drawn at random otherwise (shards made by other tools often carry none); ``plan`` and the
run's log say which and why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.data.format.manifest import ClassInfo, ClassSpan, Manifest, ShardInfo, SplitInfo
from ddp_rank.runtime.data_setup import resolve_sampler, schedule_config
from ddp_rank.train.chunking.plan_report import describe_plan

SAMPLE = 3 * 1024  # an image, a .cls and a .json member of one block each


def _manifest(category_of: list[int | None], categories: list[str], per_class: int = 4) -> Manifest:
    """A manifest (no tars: planning reads the manifest alone) with ``per_class`` images per class, one shard
    per category."""
    classes = tuple(ClassInfo(i, f"class-{i}", c) for i, c in enumerate(category_of))
    shards = []
    for c in sorted({c for c in category_of}, key=lambda c: -1 if c is None else c):
        members = [i for i, k in enumerate(category_of) if k == c]
        spans = tuple(
            ClassSpan(cid, per_class, j * per_class * SAMPLE, per_class * SAMPLE, "0" * 32)
            for j, cid in enumerate(members)
        )
        label = "none" if c is None else f"c{c}"
        shards.append(
            ShardInfo(
                f"train/{label}.tar",
                c,
                spans,
                per_class * len(members),
                len(members) * per_class * SAMPLE,
                "0" * 64,
            )
        )
    counts = dict.fromkeys(range(len(classes)), per_class)
    return Manifest(tuple(categories), classes, {"train": SplitInfo("train", counts, tuple(shards))})


@pytest.mark.parametrize(
    ("category_of", "categories", "expected"),
    [
        ([None] * 12, [], "random"),
        ([0] * 12, ["one"], "random"),
        ([0] * 6 + [1] * 6, ["a", "b"], "hard"),
        ([0] * 6 + [None] * 6, ["a"], "random"),
    ],
)
def test_auto_takes_the_categories_only_when_there_are_two(
    category_of: list[int | None], categories: list[str], expected: str
) -> None:
    cfg = load_config(None, ["data.global_batch_size=8"])
    assert cfg.data.sampler == "auto"
    strategy, why = resolve_sampler(cfg.data, _manifest(category_of, categories))
    assert strategy == expected
    assert why.startswith("data.sampler=auto: split 'train' has")
    assert schedule_config(cfg.data, _manifest(category_of, categories), cfg.data_seed).strategy == expected


def test_auto_needs_as_many_categories_as_a_batch_takes() -> None:
    manifest = _manifest([0] * 4 + [1] * 4 + [2] * 4, ["a", "b", "c"])
    three = load_config(None, ["data.categories_per_batch=3", "data.global_batch_size=12"])
    four = load_config(None, ["data.categories_per_batch=4", "data.global_batch_size=12"])
    assert resolve_sampler(three.data, manifest)[0] == "hard"
    assert resolve_sampler(four.data, manifest) == (
        "random",
        "data.sampler=auto: split 'train' has 3 categories (the category-aware sampler needs 4), so classes "
        "are drawn at random from the whole split",
    )


def test_a_sampler_that_is_set_is_kept() -> None:
    cfg = load_config(None, ["data.sampler=hard"])
    assert resolve_sampler(cfg.data, _manifest([None] * 4, [])) == ("hard", "set by data.sampler")


def test_plan_starts_on_shards_without_categories_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before ``auto``, the default (hard) sampler refused such shards; now the run can start."""
    _manifest([None] * 12, []).save(tmp_path)
    code = main(["plan", f"data.shards={tmp_path}", "model.backbone=tiny_cnn", "data.global_batch_size=8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "random (data.sampler=auto: split 'train' has 0 categories" in out
    assert "ok: the run can start" in out


def test_hard_when_set_on_such_shards_names_the_working_setting(tmp_path: Path) -> None:
    _manifest([None] * 12, []).save(tmp_path)
    cfg = load_config(None, [f"data.shards={tmp_path}", "data.sampler=hard", "data.global_batch_size=8"])
    _, problems = describe_plan(cfg, 1)
    assert any("data.sampler=auto" in p for p in problems), problems  # auto takes random on such shards


def test_the_run_logs_the_choice(tmp_path: Path, ddp_rank_log: pytest.LogCaptureFixture) -> None:
    from ddp_rank.train.setup import build_stream

    manifest = _manifest([0] * 6 + [1] * 6, ["a", "b"])
    manifest.save(tmp_path)
    cfg = load_config(None, [f"data.shards={tmp_path}", "data.global_batch_size=8", "data.num_workers=0"])
    with ddp_rank_log.at_level(logging.INFO):
        stream = build_stream(cfg.data, cfg.data_seed, Manifest.load(tmp_path), rank=0, world_size=1)
    assert stream.schedule_config.strategy == "hard"
    assert "sampler hard: data.sampler=auto: split 'train' has 2 categories" in ddp_rank_log.text
