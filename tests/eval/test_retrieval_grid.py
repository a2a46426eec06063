"""The retrieval picture: frames read back from the PNG match the labels, the bytes are reproducible, the query
sample is seeded, and `ddp-rank eval` draws the neighbours its own search finds, framed by their true class."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.reader import ClassReader
from ddp_rank.data.reading.transforms import decode_image
from ddp_rank.eval.protocols import EmbeddedSet
from ddp_rank.eval.retrieval_grid import (
    GREEN,
    GREY,
    QUERY_BLUE,
    RED,
    Cell,
    GridLayout,
    draw_grid,
    save_png,
    thumbnail,
)
from ddp_rank.eval.retrieval_record import (
    RECORD_FILE,
    eval_picture_file,
    read_records,
    sample_query_rows,
)
from ddp_rank.eval.runner import embed_split, key_index
from ddp_rank.eval.settings import evaluation_settings
from ddp_rank.eval.workflow import build_eval_model
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

LAYOUT = GridLayout()
GRID_FILE = eval_picture_file("eval.json", "raw pixels")
"""The picture `ddp-rank eval --baseline raw-pixels --output OUT/eval.json` draws beside its results."""
K = 5
"""Neighbours per query in the evaluations: more than the 3 other images of a test class, so both colours show."""


def frame_pixel(picture: Image.Image, row: int, block: int, column: int, k: int) -> tuple[int, int, int]:
    """A pixel inside the frame band of a cell (its top-left corner + half the frame width)."""
    x, y = LAYOUT.cell_origin(row, block, column, k)
    return picture.getpixel((x + LAYOUT.frame // 2, y + LAYOUT.cell // 2))


def solid(colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (40, 30), colour)


def test_frames_are_drawn_where_the_layout_says_in_the_colour_of_the_match(tmp_path: Path) -> None:
    queries = [Cell(solid((0, 0, 0)), None, "class 1"), Cell(None, None)]
    matches = [[True, False, None], [False, True]]
    blocks = [[[Cell(solid((10 * i, 50, 90)), m, f"{i}") for i, m in enumerate(row)] for row in matches]]
    picture = Image.open(save_png(draw_grid(queries, blocks), tmp_path / "g.png")).convert("RGB")
    assert picture.size == LAYOUT.size(rows=2, blocks=1, k=3)
    colours = {True: GREEN, False: RED, None: GREY}
    for row, row_matches in enumerate(matches):
        assert frame_pixel(picture, row, 0, 0, 3) == QUERY_BLUE
        for column, match in enumerate(row_matches, start=1):
            assert frame_pixel(picture, row, 0, column, 3) == colours[match]
    # Inside the frame: the thumbnail itself (a solid image stays solid at its centre).
    x, y = LAYOUT.cell_origin(0, 0, 2, 3)
    assert picture.getpixel((x + LAYOUT.cell // 2, y + LAYOUT.cell // 2)) == (10, 50, 90)
    # A row with fewer neighbours leaves the last cell blank (white), with no frame.
    assert frame_pixel(picture, 1, 0, 3, 3) == (255, 255, 255)


def test_two_blocks_side_by_side_and_identical_bytes(tmp_path: Path) -> None:
    queries = [Cell(solid((0, 0, 0)), None)]
    blocks = [[[Cell(solid((1, 2, 3)), True)]], [[Cell(solid((4, 5, 6)), False)]]]
    first = save_png(draw_grid(queries, blocks), tmp_path / "a.png")
    second = save_png(draw_grid(queries, blocks), tmp_path / "b.png")
    assert first.read_bytes() == second.read_bytes()
    picture = Image.open(first).convert("RGB")
    assert frame_pixel(picture, 0, 0, 1, 1) == GREEN and frame_pixel(picture, 0, 1, 1, 1) == RED
    assert LAYOUT.cell_origin(0, 1, 1, 1)[0] > LAYOUT.cell_origin(0, 0, 1, 1)[0] + LAYOUT.cell


def test_grid_refuses_blocks_that_do_not_match_the_queries() -> None:
    with pytest.raises(ValueError, match="one list of neighbours per query"):
        draw_grid([Cell(None, None)], [[[], []]])


def test_query_sample_is_seeded_a_prefix_and_keeps_the_protocol_roles() -> None:
    labels = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 6, 7, 7])
    data = EmbeddedSet(torch.randn(len(labels), 4), labels, torch.zeros(len(labels), dtype=torch.long))
    a, database = sample_query_rows(data, "sop", 6, seed=3)
    b, _ = sample_query_rows(data, "sop", 6, seed=3)
    c, _ = sample_query_rows(data, "sop", 6, seed=4)
    np.testing.assert_array_equal(a, b)
    assert a.tolist() != c.tolist()
    # A smaller sample is a prefix of the same draw.
    assert sample_query_rows(data, "sop", 3, seed=3)[0].tolist() == a[:3].tolist()
    assert {4, 8} & set(a.tolist()) == set() and len(database) == len(labels)  # lone classes 2, 4 never drawn
    subsets = ["query", "gallery"] * 7 + ["query"]
    inshop = EmbeddedSet.from_lists(torch.randn(15, 4), labels.tolist(), subsets)
    queries, gallery = sample_query_rows(inshop, "inshop", 15, seed=0)
    assert set(gallery.tolist()) == set(range(1, 15, 2))
    assert all(subsets[q] == "query" and labels[q] in labels[gallery] for q in queries.tolist())


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("grid"))


def evaluate(shards: Path, out: Path, *extra: str) -> Path:
    args = ["eval", "--baseline", "raw-pixels", "--output", str(out / "eval.json")]
    assert main([*args, *TINY_OVERRIDES, f"data.shards={shards}", "eval.grid_queries=5", f"eval.grid_k={K}",
                 *extra]) == 0  # fmt: skip
    return out


def test_eval_draws_its_own_neighbours_framed_by_their_true_class(shards: Path, tmp_path: Path) -> None:
    out = evaluate(shards, tmp_path / "a")
    ((name, record),) = read_records(out / RECORD_FILE).items()
    assert name == "raw pixels" and record.split == "test" and len(record.queries) == 5
    # The neighbours are those of an exact search over the same embeddings (itself left out).
    cfg = load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}"])
    model, _ = build_eval_model(cfg.model, cfg.data.image_size, None, None, "raw-pixels")
    data = embed_split(model, evaluation_settings(cfg), "test")
    manifest = Manifest.load(shards)
    reader = ClassReader(manifest, "test")
    by_hash = {key_index(s.key): (s.key, s.image) for c in reader.where for s in reader.read(c)}
    keys = [by_hash[int(i)][0] for i in data.index]
    for q in record.queries:
        row = keys.index(q.key)
        scores = data.embeddings @ data.embeddings[row]
        scores[row] = -np.inf
        best = torch.sort(scores, descending=True).values[:K]
        # Each neighbour is at its own score, and those are the K best (ties may come in either order).
        mine = torch.tensor([float(scores[keys.index(n.key)]) for n in q.neighbours])
        torch.testing.assert_close(mine, torch.tensor([n.score for n in q.neighbours]), rtol=0, atol=1e-5)
        torch.testing.assert_close(mine, best, rtol=0, atol=1e-5)
        assert q.key not in [n.key for n in q.neighbours]
        # The labels are the samples' true classes: the builder names each key after its class (c<class>_<n>).
        assert q.label == int(q.key[1:8]) and all(n.label == int(n.key[1:8]) for n in q.neighbours)
    picture = Image.open(out / GRID_FILE).convert("RGB")
    same = 0
    for row, q in enumerate(record.queries):
        assert frame_pixel(picture, row, 0, 0, K) == QUERY_BLUE
        for column, n in enumerate(q.neighbours, start=1):
            assert frame_pixel(picture, row, 0, column, K) == (GREEN if n.label == q.label else RED)
            same += n.label == q.label
            # The thumbnail is that sample's image.
            x, y = LAYOUT.cell_origin(row, 0, column, K)
            inner = picture.crop((x + LAYOUT.frame, y + LAYOUT.frame, x + LAYOUT.frame + LAYOUT.thumb,
                                  y + LAYOUT.frame + LAYOUT.thumb))  # fmt: skip
            image = by_hash[key_index(n.key)][1]
            assert inner.tobytes() == thumbnail(decode_image(image, 128), LAYOUT.thumb).tobytes()
    assert 0 < same < 5 * K  # both colours are tested


def test_same_seed_same_bytes_other_seed_other_queries(shards: Path, tmp_path: Path) -> None:
    a = evaluate(shards, tmp_path / "a")
    b = evaluate(shards, tmp_path / "b")
    c = evaluate(shards, tmp_path / "c", "eval.grid_seed=1")
    assert (a / GRID_FILE).read_bytes() == (b / GRID_FILE).read_bytes()
    keys = {p: [q.key for q in next(iter(read_records(p / RECORD_FILE).values())).queries] for p in (a, c)}
    assert keys[a] != keys[c]
    assert (a / GRID_FILE).read_bytes() != (c / GRID_FILE).read_bytes()


def test_no_picture_when_asked_for_none(shards: Path, tmp_path: Path) -> None:
    out = evaluate(shards, tmp_path / "a", "eval.grid_queries=0")
    assert not list(out.glob("*retrieval*.png")) and not (out / RECORD_FILE).exists()
    assert "raw pixels" in json.loads((out / "eval.json").read_text())


def test_feature_shards_draw_no_picture_and_say_so_once(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ddp_rank.eval.retrieval_record import RetrievalPicture

    feat = tmp_path / "feat"
    assert main(["shards", "features", str(shards), str(feat), *TINY_OVERRIDES, "--no-progress"]) == 0
    head = [*TINY_OVERRIDES, "model.backbone=features", f"data.shards={feat}"]
    out = tmp_path / "eval"
    with caplog.at_level("INFO", logger="ddp_rank.eval.retrieval_record"):
        assert main(["eval", *head, "--baseline", "raw-pixels", "--output", str(out / "eval.json")]) == 0
        assert not list(out.glob("*retrieval*.png")) and not (out / RECORD_FILE).exists()
        # A run's evaluations share one RetrievalPicture: the second says nothing more.
        picture = RetrievalPicture(evaluation_settings(load_config(None, head)), is_main=True)
        data = EmbeddedSet(torch.randn(4, 8), torch.tensor([0, 0, 1, 1]), torch.zeros(4, dtype=torch.long))
        for _ in range(2):
            picture.capture("test", data)
            assert picture.write("step", tmp_path / "run") is None
    said = [r.message for r in caplog.records if "no retrieval picture" in r.message]
    assert said == ["no retrieval picture: the test shards hold feature vectors, not images"] * 2  # eval, run


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_draw_the_same_picture_as_one(shards: Path, tmp_path: Path) -> None:
    """The gathered rows are sorted by key, whatever the world size: the same queries, neighbours and bytes."""
    from tests.helpers.training import launch

    one = evaluate(shards, tmp_path / "one")
    two = tmp_path / "two"
    result = launch("eval", "--baseline", "raw-pixels", "--output", str(two / "eval.json"), *TINY_OVERRIDES,
                    f"data.shards={shards}", "eval.grid_queries=5", f"eval.grid_k={K}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (two / GRID_FILE).read_bytes() == (one / GRID_FILE).read_bytes()
    assert read_records(two / RECORD_FILE) == read_records(one / RECORD_FILE)


def test_the_pictures_decode_within_the_users_pixel_limit(tmp_path: Path) -> None:
    import io

    from ddp_rank.eval.retrieval_record import decode_thumbnail
    from ddp_rank.eval.retrieval_search_grid import folder_images

    buffer = io.BytesIO()
    Image.new("RGB", (20, 10), (200, 0, 0)).save(buffer, "PNG")  # 200 pixels
    data = buffer.getvalue()
    assert decode_thumbnail(data, "k", 200) is not None and decode_thumbnail(data, "k", 199) is None
    (tmp_path / "a.png").write_bytes(data)
    assert folder_images(tmp_path, 200)(0, "a.png") is not None
    assert folder_images(tmp_path, 199)(0, "a.png") is None
