"""Messages of a first run that a user can act on: no advice for URLs about a local folder, the hard sampler's
refusal naming the categories (or saying there are none), one line per cause for a truncated shard."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ddp_rank.data.format.fragmentation import Fragmentation
from ddp_rank.data.format.info import format_info
from ddp_rank.data.reading.reader import ClassReadError, group_failures
from ddp_rank.data.reading.stream import DataError, ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.plan import Catalog, GlobalPlan, PlanError
from ddp_rank.data.sampling.schedule import UNLABELLED, ScheduleConfig
from tests.helpers.training import build_tiny_shards

SMALL_SPANS = {"classes": 4, "max_spans": 1, "span_bytes": 4 * 2048, "spans_of": {c: 1 for c in range(4)}}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("first-run"))


def test_url_advice_only_for_a_url() -> None:
    frag = Fragmentation("train", spans=4, **SMALL_SPANS)  # type: ignore[arg-type]
    assert frag.request_bound
    assert frag.advice("shards") is None and frag.advice("/data/shards") is None
    assert frag.advice("file:///data/shards") is None
    remote = frag.advice("https://host/shards")
    assert remote is not None and "read from a URL" in remote and "data.cache_dir" in remote


def test_a_local_folder_of_cut_classes_gets_the_reshard_hint_alone() -> None:
    cut = Fragmentation("train", classes=4, spans=12, max_spans=3, span_bytes=12 * 2048, spans_of={})
    advice = cut.advice("shards")
    assert advice is not None and "ddp-rank shards reshard shards OUT" in advice
    assert "read from a URL" not in advice and "request-bound" not in advice


def test_shards_info_of_a_local_folder_says_nothing_about_urls(shards: Path) -> None:
    text = format_info(shards)
    assert "spans for" in text and "read from a URL" not in text and "request-bound" not in text


def _plan(groups: dict[int, int], names: list[str], strategy: str = "hard") -> GlobalPlan:
    counts = {cid: 4 for cid in groups}
    return GlobalPlan(Catalog.of(counts, groups, names), ScheduleConfig(strategy=strategy), 16)  # type: ignore[arg-type]


def test_the_hard_sampler_on_shards_without_categories_says_so() -> None:
    with pytest.raises(PlanError) as caught:
        _plan({cid: UNLABELLED for cid in range(8)}, [])
    message = str(caught.value)
    assert "the split's classes have none" in message and "data.sampler=auto" in message
    assert "[]" not in message and "only 0" not in message


def test_the_hard_sampler_names_the_categories_too_small() -> None:
    # mugs: 3 classes x 4 = 12 images >= 8 a step needs; lamps and chairs: 4 images each.
    groups = {0: 0, 1: 0, 2: 0, 3: 1, 4: 2}
    with pytest.raises(PlanError) as caught:
        _plan(groups, ["mugs", "lamps", "chairs"])
    message = str(caught.value)
    assert "only 1 of the split's 3 do" in message
    assert "lamps: a step needs 8 images, it has 4; chairs: a step needs 8 images, it has 4" in message
    assert "data.global_batch_size" in message


def test_failures_of_one_cause_are_grouped() -> None:
    cut = "x.tar is 10 bytes, the manifest says 20"
    failures = [ClassReadError(c, "train/x.tar", cut) for c in (7, 3, 9, 1, 4)]
    failures.append(ClassReadError(2, "train/y.tar", "not found"))
    assert group_failures(failures) == (
        f"train/x.tar: {cut} (5 classes: 7, 3, 9 and 2 more); train/y.tar: not found (1 class: 2)"
    )
    many = [ClassReadError(c, f"s{c}.tar", "gone") for c in range(5)]
    assert group_failures(many).endswith("; and 2 more cause(s)")


def test_a_truncated_shard_is_reported_once(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    copy = Path(shutil.copytree(shards, tmp_path / "shards"))
    tar = sorted((copy / "train").glob("*.tar"))[0]
    with tar.open("r+b") as f:
        f.truncate(tar.stat().st_size // 2)
    stream = ShardStream(
        copy, 16, schedule=ScheduleConfig(batches_per_pair=1), transform=TransformConfig(resize=8, crop=6)
    )
    caplog.set_level(logging.WARNING, logger="ddp_rank.data.reading.stream")
    with pytest.raises(DataError) as caught:
        for step in range(stream.steps_per_epoch):
            stream.batch(0, step)
    message = str(caught.value)
    assert message.count("a truncated or replaced shard") == 1 and "(3 classes: " in message, message
    assert len(message) < 500, message
    warned = [r.getMessage() for r in caplog.records if "replaced from the plan's reserve" in r.getMessage()]
    assert len(warned) == 1 and "counted" in warned[0], warned
