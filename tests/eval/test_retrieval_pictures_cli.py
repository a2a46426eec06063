"""`ddp-rank compare --grid` (two runs' pictures side by side, same queries) and `ddp-rank search --grid` (ad-hoc
queries framed by the class of their top-1), read back from the PNG."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.eval.retrieval_captions import RECORD_LEGEND
from ddp_rank.eval.retrieval_grid import GREEN, GREY, QUERY_BLUE, RED, GridLayout, legend_rows
from ddp_rank.eval.retrieval_record import RECORD_FILE, last_record, read_records
from ddp_rank.train.trainer import run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

LAYOUT = GridLayout()
K = 5

pytestmark = pytest.mark.slow


def frame_pixel(picture: Image.Image, row: int, block: int, column: int, k: int) -> tuple[int, int, int]:
    x, y = LAYOUT.cell_origin(row, block, column, k)
    return picture.getpixel((x + LAYOUT.frame // 2, y + LAYOUT.cell // 2))


def thumbnail_of(picture: Image.Image, row: int, column: int, k: int) -> Image.Image:
    """The thumbnail inside a cell's frame (result block 0)."""
    x, y = LAYOUT.cell_origin(row, 0, column, k)
    return picture.crop((x + LAYOUT.frame, y + LAYOUT.frame, x + LAYOUT.cell - LAYOUT.frame,
                         y + LAYOUT.cell - LAYOUT.frame))  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pictures")
    shards = build_tiny_shards(root)
    out = {"root": root, "shards": shards, "images": root / "images"}
    for name, seed in (("a", 0), ("b", 1)):
        out[name] = root / name
        run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out[name]}",
                                        "train.steps=2", f"train.seed={seed}", "eval.grid_queries=4",
                                        f"eval.grid_k={K}"]))  # fmt: skip
    return out


def test_each_evaluation_of_a_run_adds_its_record(runs: dict[str, Path]) -> None:
    saved = read_records(runs["a"] / RECORD_FILE)
    assert list(saved) == ["step 2"] and len(saved["step 2"].queries) == 4
    # The training run's record names each sample by its class folder and the file it was built from.
    for q in saved["step 2"].queries:
        assert all(Path(row.source).parent.name == row.name for row in (q, *q.neighbours))
    assert (runs["a"] / "retrieval.png").is_file()


def test_compare_sets_two_runs_side_by_side_for_the_same_queries(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lone = tmp_path / "no-picture"
    lone.mkdir()
    shutil.copy(runs["a"] / "config.yaml", lone / "config.yaml")  # a run directory without a record
    out = tmp_path / "side.png"
    assert main(["compare", str(runs["a"]), str(runs["b"]), str(lone), "--grid", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{lone}: left out of --grid: no retrieval.json" in err
    assert f"retrieval grid: {out} (4 queries; left to right: {runs['a']}, {runs['b']})" in err
    records = [last_record(read_records(runs[r] / RECORD_FILE)) for r in ("a", "b")]
    # The same queries: drawn with eval.grid_seed, not train.seed.
    assert [q.key for q in records[0].queries] == [q.key for q in records[1].queries]
    picture = Image.open(out).convert("RGB")
    legend = legend_rows(RECORD_LEGEND, picture.width, LAYOUT)
    assert picture.size == LAYOUT.size(rows=4, blocks=2, k=K, legend_rows=len(legend))
    for block, record in enumerate(records):
        for row, q in enumerate(record.queries):
            assert frame_pixel(picture, row, 0, 0, K) == QUERY_BLUE
            for column, n in enumerate(q.neighbours, start=1):
                assert frame_pixel(picture, row, block, column, K) == (GREEN if n.label == q.label else RED)


def test_compare_without_any_record_is_an_error(tmp_path: Path, runs: dict[str, Path], capsys) -> None:
    lone = tmp_path / "no-picture"
    lone.mkdir()
    shutil.copy(runs["a"] / "config.yaml", lone / "config.yaml")
    assert main(["compare", str(lone), "--grid", str(tmp_path / "x.png")]) == 2
    assert "error: no run has a retrieval picture to draw" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_search_grid_frames_each_hit_by_the_class_of_the_top_1(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("faiss")
    export, index = tmp_path / "export", tmp_path / "index"
    assert main(["export", "--checkpoint", str(runs["a"]), "--output", str(export)]) == 0
    assert main(["index", str(export), "--output", str(index)]) == 0
    queries = sorted(runs["images"].rglob("*.png"))[:3]
    capsys.readouterr()
    grid = tmp_path / "grid.png"
    assert main(["search", str(index), *map(str, queries), "-k", str(K), "--grid", str(grid)]) == 0
    printed = capsys.readouterr().out
    labels = [[int(x) for x in re.findall(r"label (\d+)", block)] for block in printed.split("\n/")]
    assert [len(row) for row in labels] == [K] * 3 and f"grid: {grid}" in printed
    # Each hit by its class folder's name, then the file it was built from.
    names = re.findall(r"  (cls\d+_\d+) \(label \d+\)  \S+  (\S+)\n", printed)
    assert len(names) == 3 * K and all(Path(source).parent.name == name for name, source in names)
    picture = Image.open(grid).convert("RGB")
    both = set()
    for row, hits in enumerate(labels):
        assert frame_pixel(picture, row, 0, 0, K) == QUERY_BLUE
        assert frame_pixel(picture, row, 0, 1, K) == GREY  # the top-1: the reference
        for column, label in enumerate(hits[1:], start=2):
            assert frame_pixel(picture, row, 0, column, K) == (GREEN if label == hits[0] else RED)
            both.add(label == hits[0])
        # The hits' images were read back from the shards: no one-colour placeholder.
        for column in range(1, K + 1):
            assert thumbnail_of(picture, row, column, K).getcolors(1) is None
    assert both == {True, False}


def test_search_grid_of_an_image_folder_export_frames_every_hit_grey(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An image folder has no classes: nothing to compare, every hit grey, the images read from the folder."""
    pytest.importorskip("faiss")
    export, index = tmp_path / "export", tmp_path / "index"
    assert main(["export", "--checkpoint", str(runs["a"]), "--images", str(runs["images"]), "--output", str(export)]) == 0  # fmt: skip
    assert main(["index", str(export), "--output", str(index)]) == 0
    query = sorted(runs["images"].rglob("*.png"))[0]
    grid = tmp_path / "grid.png"
    capsys.readouterr()
    assert main(["search", str(index), str(query), "-k", "3", "--grid", str(grid)]) == 0
    for line in capsys.readouterr().out.splitlines()[1:4]:  # no class: the key, then the file in the folder
        _, _, key, source = line.split()
        assert source == str(runs["images"] / key)
    picture = Image.open(grid).convert("RGB")
    for column in (1, 2, 3):
        assert frame_pixel(picture, 0, 0, column, 3) == GREY
        assert thumbnail_of(picture, 0, column, 3).getcolors(1) is None
    # The top-1 of a query that is in the folder is the query itself: the query's own thumbnail.
    assert thumbnail_of(picture, 0, 0, 3).tobytes() == thumbnail_of(picture, 0, 1, 3).tobytes()
