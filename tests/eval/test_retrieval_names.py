"""The user's names in the retrieval pictures and the record: shards built from class folders with real names
(``014.Indigo_Bunting``) give records that keep each sample's class name and source file, captions that show them
(shortened to fit, with a legend), and ``ddp-rank eval`` draws its own picture beside a run's ``retrieval.png``
instead of over it. The label text is tested, not the pixels."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.retrieval_captions import RECORD_LEGEND, search_legend
from ddp_rank.eval.retrieval_grid import GridLayout, LegendEntry, caption_lines, legend_rows, shorten
from ddp_rank.eval.retrieval_record import (
    GRID_FILE,
    RECORD_FILE,
    Neighbour,
    QueryRow,
    RetrievalRecord,
    ShardImages,
    eval_picture_file,
    read_records,
    record_cells,
    with_names,
)
from ddp_rank.eval.retrieval_search_grid import export_images, hit_names, url_images
from tests.helpers.training import TINY_OVERRIDES

LONG = "001.Black_footed_Albatross_of_the_North_Pacific"
CLASSES = ["014.Indigo_Bunting", "015.Lazuli_Bunting", "016.Painted_Bunting", LONG]


def write_named_folder(root: Path) -> Path:
    """``root/<class>/<Class>_000<i>_<n>.png``: 3 images of 16 px per class, one colour per class."""
    rng = np.random.default_rng(0)
    for number, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True)
        colour = rng.integers(0, 256, size=3)
        for i in range(3):
            pixels = np.clip(colour + rng.integers(0, 64, size=(16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{name.split('.', 1)[1]}_{i:04d}_{1000 * number + i}.png")
    return root


@pytest.fixture(scope="module")
def named_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("named")
    images = write_named_folder(root / "birds")
    out = root / "shards"
    # Every class in the test split: the picture's queries can come from each of them.
    records = [replace(r, split="test") for r in read_image_folder(images)]
    build_shards(records, out, BuildOptions(progress=False))
    return out


# ---------------------------------------------------------------------------------------------- text only
def test_long_names_are_shortened_in_the_middle_to_the_cell_width() -> None:
    layout = GridLayout()
    assert layout.caption_chars == 18 and shorten("014.Indigo_Bunting", 18) == "014.Indigo_Bunting"
    short = shorten(LONG, 18)
    assert short == "001.Blac.._Pacific"  # the number and the start, the end
    source = "/data/birds/001/Black_footed_Albatross_0001_1.jpg"
    record = RetrievalRecord(
        "shards", "test", "sop", 0,
        (QueryRow("c0000003_00000", 3, LONG, source, neighbours=(Neighbour("c0000004_00001", 4, score=0.5),)),),
    )  # fmt: skip
    queries, blocks = record_cells([record], [lambda label, key: None])
    assert caption_lines(queries[0], layout) == [short, "Black_fo..01_1.jpg"]  # the file, not its folder
    assert caption_lines(blocks[0][0][0], layout) == ["0.500", "class 4"]  # no name recorded: the id


def test_the_legend_says_what_frames_and_captions_mean_and_wraps_to_a_narrow_picture() -> None:
    layout = GridLayout()
    wide = legend_rows(RECORD_LEGEND, layout.size(4, 1, 5)[0], layout)
    narrow = legend_rows(RECORD_LEGEND, layout.size(4, 1, 1)[0], layout)
    texts = [entry.text for row in wide for entry in row]
    assert texts == ["query: its class, its file", "the query's class", "another class",
                     "caption: cosine similarity, class"]  # fmt: skip
    assert len(wide) == 1 and len(narrow) > 1
    assert [entry.text for row in narrow for entry in row] == texts  # wrapped, not cut
    # The search legend: hits are compared with the top hit, or, in an image folder, with nothing.
    assert "top hit: the class compared with" in [e.text for e in search_legend(True)]
    assert [e.colour for e in search_legend(False)].count(None) == 1
    assert legend_rows([LegendEntry(None, "x" * 500)], 230, layout)[0][0].text.count("..") == 1


def test_a_record_without_names_takes_them_from_its_shards_and_keeps_its_own(named_shards: Path) -> None:
    manifest = Manifest.load(named_shards)
    images = ShardImages(manifest, "test")
    try:
        key = next(iter(images.samples(0)))
        other = next(iter(images.samples(1)))
        old = RetrievalRecord(
            str(named_shards), "test", "sop", 0,
            (QueryRow(key, 0, neighbours=(
                Neighbour(other, 1, score=0.9), Neighbour(other, 1, "kept", "k.png", score=0.8)
            )),),
        )  # fmt: skip
        filled = with_names(old, images.names).queries[0]
    finally:
        images.close()
    assert (filled.name, filled.neighbours[0].name) == (manifest.classes[0].name, manifest.classes[1].name)
    assert Path(filled.source).parent.name == filled.name and Path(filled.source).is_file()
    assert (filled.neighbours[1].name, filled.neighbours[1].source) == ("kept", "k.png")


def test_split_export_names_and_url_names_after_the_scan(named_shards: Path) -> None:
    """A split export names its hits from the manifest and the samples' json; shards at a URL only once the
    picture's scan has read them (never a scan of their own); an unnamed source gives the ids."""
    fetch, close = export_images({"kind": "split", "shards": str(named_shards), "split": "test"})
    try:
        manifest = Manifest.load(named_shards)
        label = next(c.id for c in manifest.classes if c.name == LONG)
        key = next(iter(fetch.samples(label)))  # type: ignore[attr-defined]
        named = hit_names(fetch)(label, key)
        assert named.name == LONG and Path(named.source).parent.name == LONG
    finally:
        close()
    (shard,) = [s for s in manifest.split("test").shards if label in {span.id for span in s.classes}]
    urls = url_images(str(named_shards / shard.path))
    assert hit_names(urls)(label, key).name == ""  # not scanned yet
    urls.want({key})  # type: ignore[attr-defined]
    assert urls(label, key) is not None
    assert hit_names(urls)(label, key).name == LONG
    assert hit_names(None)(label, key).name == ""


# ---------------------------------------------------------------------------------------------- eval
@pytest.mark.slow
def test_eval_records_and_captions_the_users_names_beside_the_runs_own_picture(
    named_shards: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / GRID_FILE).write_bytes(b"the training run's own picture")
    args = ["eval", "--baseline", "raw-pixels", "--output", str(run / "eval.json"), *TINY_OVERRIDES,
            f"data.shards={named_shards}", "eval.grid_queries=4", "eval.grid_k=2"]  # fmt: skip
    assert main(args) == 0
    assert (run / GRID_FILE).read_bytes() == b"the training run's own picture"  # kept
    drawn = run / eval_picture_file(run / "eval.json", "raw pixels")
    assert drawn.name == "eval-retrieval-raw-pixels.png"
    picture = Image.open(drawn)
    legend = legend_rows(RECORD_LEGEND, picture.width)
    assert picture.size == GridLayout().size(4, 1, 2, len(legend))
    record = read_records(run / RECORD_FILE)["raw pixels"]
    saved = json.loads((run / RECORD_FILE).read_text())["raw pixels"]["queries"][0]
    assert saved["name"] in CLASSES and saved["neighbours"][0]["name"] in CLASSES  # the JSON keeps them
    for q in record.queries:
        for row in (q, *q.neighbours):
            # Full names in the record: the class folder's, and the file the sample was built from.
            assert row.name in CLASSES and Path(row.source).parent.name == row.name
            assert Path(row.source).is_file()
    queries, blocks = record_cells([record], [lambda label, key: None])
    for q, cell, hits in zip(record.queries, queries, blocks[0]):
        assert caption_lines(cell) == [shorten(q.name, 18), shorten(Path(q.source).name, 18)]
        for n, hit in zip(q.neighbours, hits):
            assert caption_lines(hit) == [f"{n.score:.3f}", shorten(n.name, 18)]


# ---------------------------------------------------------------------------------------------- search
@pytest.mark.slow
def test_search_prints_and_captions_each_hits_class_name_and_source_file(
    named_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("faiss")
    from ddp_rank.eval.retrieval_search_grid import search_cells
    from ddp_rank.eval.search import Searcher

    export, index, grid = tmp_path / "export", tmp_path / "index", tmp_path / "hits.png"
    tiny = [*TINY_OVERRIDES, f"data.shards={named_shards}", "data.test_split=test"]
    assert main(["export", "--output", str(export), *tiny]) == 0  # the untrained network: names, not quality
    assert main(["index", str(export), "--output", str(index)]) == 0
    query = next((named_shards.parent / "birds" / "014.Indigo_Bunting").iterdir())
    capsys.readouterr()
    assert main(["search", str(index), str(query), "-k", "3", "--grid", str(grid)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(query) and printed[-1] == f"grid: {grid}"
    manifest = Manifest.load(named_shards)
    for line in printed[1:4]:
        # "   1  0.9876  c0000002_00001  016.Painted_Bunting (label 2)  /.../016.Painted_Bunting/Painted_...png"
        found = re.fullmatch(r" +\d +-?[\d.]+ +c\d+_\d+ +(\S+) \(label (\d+)\) +(\S+)", line)
        assert found is not None, line
        name, label, source = found.groups()
        assert name == manifest.classes[int(label)].name and name in CLASSES
        assert Path(source).parent.name == name and Path(source).is_file()
    assert Image.open(grid).width > 0  # still written
    searcher = Searcher.from_index(index)
    hits = searcher.search_files([query], k=3)
    fetch, close = export_images(searcher.index.info["export"]["source"])
    try:
        _, rows = search_cells([query], hits, fetch)
    finally:
        close()
    assert [caption_lines(cell)[1] for cell in rows[0]] == [
        shorten(manifest.classes[hit.label].name, 18) for hit in hits[0]
    ]
    # Shards moved away since the export: the ids, and one line saying why the names are missing.
    moved = named_shards.with_name("moved")
    named_shards.rename(moved)
    try:
        assert main(["search", str(index), str(query), "-k", "3"]) == 0
    finally:
        moved.rename(named_shards)
    captured = capsys.readouterr()
    assert re.fullmatch(r" +1 +-?[\d.]+ +c\d+_\d+  label \d+", captured.out.splitlines()[1])
    (err,) = captured.err.splitlines()
    assert err.startswith("ddp-rank search: the hits' class names and files are not shown: ")
    assert f"{named_shards}/manifest.json not found" in err
