"""The batch layout, decided once: every rank's share of the global batch and whether the step is chunked."""

from __future__ import annotations

import pytest

from ddp_rank.config import ConfigError, load_config
from ddp_rank.train.chunking.layout import BatchLayout
from ddp_rank.train.chunking.step import runs_chunked
from ddp_rank.train.settings import step_settings


@pytest.mark.parametrize(
    ("largest", "chunk", "chunked"),
    [(64, None, False), (64, 64, False), (64, 128, False), (65, 64, True), (2, 1, True)],
)
def test_a_step_is_chunked_only_when_some_rank_holds_more_rows_than_a_chunk(
    largest: int, chunk: int | None, chunked: bool
) -> None:
    assert runs_chunked(largest, chunk) is chunked


@pytest.mark.parametrize(
    ("chunk_setting", "world_size", "chosen", "expected_chunk"),
    [
        ("0", 2, None, None),  # 0: never chunk
        ("32", 2, None, 32),  # 64 per rank in chunks of 32
        ("64", 2, None, None),  # a chunk as large as the local batch is no chunk
        ("256", 1, None, None),  # larger than the 128 images of one process: direct
        ("auto", 4, 16, 16),  # chosen elsewhere (chunk_choice) and handed in
        ("auto", 4, 32, None),  # the chosen chunk holds the 32 images of a rank: direct
    ],
)
def test_the_layout_splits_the_batch_and_chunks_only_a_batch_that_does_not_fit(
    chunk_setting: str, world_size: int, chosen: int | None, expected_chunk: int | None
) -> None:
    cfg = load_config(None, ["data.global_batch_size=128", f"distributed.chunk_size={chunk_setting}"])
    layout = BatchLayout.from_settings(step_settings(cfg), world_size, chosen)
    assert (layout.global_batch, layout.world_size, layout.local_batch) == (128, world_size, 128 // world_size)
    assert layout.chunk_size == expected_chunk
    assert layout.chunked is (expected_chunk is not None)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_naming_the_setting() -> None:
    cfg = load_config(None, ["data.global_batch_size=100"])
    with pytest.raises(ConfigError, match=r"data.global_batch_size=100 does not split over 3"):
        BatchLayout.from_settings(step_settings(cfg), 3)


@pytest.mark.parametrize(
    ("settings", "kind", "group"),
    [
        ([], "frozen", 0),  # auto, chunk_size=auto: the step may be chunked, no group given
        (["distributed.chunk_size=16"], "frozen", 0),  # chunked by the config
        (["distributed.chunk_size=0"], "batch", 32),  # the config pins the direct step: batch statistics
        (["distributed.chunk_size=32"], "batch", 32),  # a chunk that holds the local batch: direct too
        (["model.bn_group_size=8"], "groups", 8),  # ghost batch normalisation, chunk auto
        (["model.bn_group_size=8", "distributed.chunk_size=16"], "groups", 8),
        (["model.freeze_bn=never"], "batch", 32),
        (["model.sync_bn=true"], "global", 32),
        (["model.freeze_bn=always", "model.bn_group_size=8"], "frozen", 0),
    ],
)
def test_the_batchnorm_mode_follows_from_the_config_alone(settings: list[str], kind: str, group: int) -> None:
    cfg = load_config(None, ["data.global_batch_size=64", *settings])
    mode = BatchLayout.from_settings(step_settings(cfg), 2).batchnorm  # 32 images per rank
    assert (mode.kind, mode.group) == (kind, group)
    assert mode.describe(32).startswith("frozen" if kind == "frozen" else "train mode")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["model.bn_group_size=12"], r"model.bn_group_size=12 does not divide the local batch of 32"),
        (["model.bn_group_size=64"], r"model.bn_group_size=64 does not divide"),
        (["model.bn_group_size=8", "distributed.chunk_size=12"], r"distributed.chunk_size=12 does not"),
        (["model.freeze_bn=never", "distributed.chunk_size=16"], r"whole local batch of 32 .*distributed.chunk_size=16"),
        (["model.sync_bn=true", "distributed.chunk_size=16"], r"model.sync_bn=true .* cannot compute"),
        (["model.sync_bn=true", "model.bn_group_size=8"], r"set one of them"),
    ],
)
def test_a_batchnorm_the_chunked_step_cannot_compute_is_refused_up_front(settings: list[str], message: str) -> None:
    cfg = load_config(None, ["data.global_batch_size=64", *settings])
    with pytest.raises(ConfigError, match=message):
        BatchLayout.from_settings(step_settings(cfg), 2)


def test_a_group_size_of_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.bn_group_size=1 would normalise every image by itself"):
        load_config(None, ["model.bn_group_size=1"])


@pytest.mark.parametrize(
    ("settings", "chosen", "chunk"),
    [
        (["model.bn_group_size=8"], 21, 16),  # the chunk auto chose, rounded down to whole groups
        (["model.bn_group_size=8"], 40, None),  # fits: direct
        ([], 21, 21),  # frozen: any chunk
    ],
)
def test_a_chunk_chosen_by_auto_keeps_the_groups_whole(settings: list[str], chosen: int, chunk: int | None) -> None:
    cfg = load_config(None, ["data.global_batch_size=64", *settings])
    assert BatchLayout.from_settings(step_settings(cfg), 2, chosen).chunk_size == chunk


@pytest.mark.parametrize("settings", [["model.bn_group_size=8"], ["model.freeze_bn=never"], ["model.sync_bn=true"]])
def test_auto_refuses_to_start_when_not_even_one_group_fits(settings: list[str]) -> None:
    cfg = load_config(None, ["data.global_batch_size=64", *settings])
    with pytest.raises(ConfigError, match=r"distributed.chunk_size=auto \(at most 5 images fit"):
        BatchLayout.from_settings(step_settings(cfg), 2, 5)
