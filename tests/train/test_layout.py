"""The batch layout, decided once: every rank's share of the global batch and whether the step is chunked."""

from __future__ import annotations

import pytest

from ddp_rank.config import ConfigError, load_config
from ddp_rank.train.chunked import runs_chunked
from ddp_rank.train.layout import BatchLayout


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
    layout = BatchLayout.from_config(cfg, world_size, chosen)
    assert (layout.global_batch, layout.world_size, layout.local_batch) == (128, world_size, 128 // world_size)
    assert layout.chunk_size == expected_chunk
    assert layout.chunked is (expected_chunk is not None)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_naming_the_setting() -> None:
    cfg = load_config(None, ["data.global_batch_size=100"])
    with pytest.raises(ConfigError, match=r"data.global_batch_size=100 does not split over 3"):
        BatchLayout.from_config(cfg, 3)
