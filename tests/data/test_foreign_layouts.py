"""Shards of any layout read: shuffled, classes cut across tars by ``maxcount``, interleaved classes, written by
``webdataset.ShardWriter`` with the class in a ``.cls`` member, a json field or the key's prefix. A class is then
several byte spans; what the stream and the evaluation reader see must equal the same data in the project's own
layout (one span per class), built from the same images."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.shard_index import IndexOptions, ShardIndexError, find_splits, index_shards
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.fragmentation import Fragmentation, fragmentation
from ddp_rank.data.format.info import format_info
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.eval_reader import EvalShards
from ddp_rank.data.reading.reader import ClassReader, ClassReadError
from ddp_rank.data.reading.serve import RangeRequestHandler
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig
from tests.helpers.foreign_shards import (
    foreign_samples,
    index_options,
    ordered,
    write_as_image_folder,
    write_with_shardwriter,
)
from tests.helpers.training import TINY_OVERRIDES

TINY = TransformConfig(resize=8, crop=6)
SAMPLES = foreign_samples()


def _index(root: Path, convention: str) -> Manifest:
    options = IndexOptions(**index_options(convention))  # type: ignore[arg-type]
    manifest = index_shards(root, find_splits(root, []), options).manifest
    manifest.save(root)
    return Manifest.load(root)


def _own_layout(tmp_path: Path) -> Manifest:
    """The same images built into the project's own layout (one category per shard, classes contiguous)."""
    write_as_image_folder(tmp_path / "images", SAMPLES)
    build_shards(read_image_folder(tmp_path / "images"), tmp_path / "own", BuildOptions(progress=False))
    return Manifest.load(tmp_path / "own")


def _images_by_class(manifest: Manifest) -> dict[str, list[str]]:
    """Class name -> sorted digests of its images, read through the stream's reader."""
    reader = ClassReader(manifest, "train")
    try:
        return {
            manifest.classes[cid].name: sorted(hashlib.sha256(s.image).hexdigest() for s in reader.read(cid))
            for cid in reader.where
        }
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("layout", "convention"),
    [
        ("shuffled", "cls"),
        ("shuffled", "json"),
        ("shuffled", "key"),
        ("shuffled", "txt"),
        ("sorted", "cls"),
        ("interleaved", "json"),
    ],
)
def test_any_layout_indexes_verifies_and_reads_every_image_of_every_class(
    tmp_path: Path, layout: str, convention: str
) -> None:
    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, layout), convention, maxcount=25)
    manifest = _index(root, convention)
    assert verify_shards(root) == []
    own = _own_layout(tmp_path)
    # Same classes, ids, categories and counts as the project's own layout of the same images ...
    assert [(c.name, c.category) for c in manifest.classes] == [(c.name, c.category) for c in own.classes]
    assert manifest.categories == own.categories
    assert manifest.split("train").class_counts == own.split("train").class_counts
    # ... and every class reads back exactly its images, whatever the number of its spans.
    assert _images_by_class(manifest) == _images_by_class(own)
    frag = fragmentation(manifest, "train")
    if layout == "sorted":  # maxcount=25 cuts some classes across two tars, and only those
        assert frag.classes < frag.spans < 2 * frag.classes and frag.max_spans == 2
    else:  # no two samples of a class adjacent (interleaved), or few (shuffled)
        assert frag.spans > 0.7 * len(SAMPLES)
    # A tar mixes categories: its category is null.
    assert any(shard.category is None for shard in manifest.split("train").shards)


def test_the_stream_draws_the_same_classes_as_the_own_layout_and_reads_each_once_per_span(
    tmp_path: Path,
) -> None:
    """The global plan depends on the manifest's classes and counts only: the same steps, class by class, on
    either layout; the images of a class drawn whole are the same images."""
    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "shuffled"), "cls", maxcount=20)
    foreign, own = _index(root, "cls"), _own_layout(tmp_path)

    def steps(manifest: Manifest) -> list[list[tuple[int, list[str]]]]:
        stream = ShardStream(
            manifest, 16, schedule=ScheduleConfig(batches_per_pair=2, seed=3), transform=TINY, augment=False,
            rank=0, world_size=1,
        )  # fmt: skip
        out = []
        for batch in stream.iter_worker(0, 1):
            by_class: dict[int, list[str]] = {}
            for label, image in zip(batch.labels.tolist(), batch.images):
                by_class.setdefault(label, []).append(hashlib.sha256(image.numpy().tobytes()).hexdigest())
            out.append(sorted((c, sorted(v)) for c, v in by_class.items()))
        return out

    foreign_steps, own_steps = steps(foreign), steps(own)
    assert len(foreign_steps) == len(own_steps) > 2
    whole = 0
    for f_step, o_step in zip(foreign_steps, own_steps):
        assert [c for c, _ in f_step] == [c for c, _ in o_step]
        for (cid, f_images), (_, o_images) in zip(f_step, o_step):
            if len(f_images) == own.split("train").class_counts[cid]:  # the whole class: the same images
                assert f_images == o_images
                whole += 1
    assert whole > 0


def test_evaluation_reads_each_class_of_several_spans_once(tmp_path: Path) -> None:
    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "interleaved"), "json", maxcount=25)
    manifest = _index(root, "json")
    keys = []
    for rank in range(2):
        reader = EvalShards(manifest, "train", batch_size=7, transform=TINY, rank=rank, world_size=2)
        keys += [k for w in range(2) for b in reader.iter_worker(w, 2) for k in b.keys]
    truth = [
        s["__key__"] for s in wds.WebDataset(sorted(str(p) for p in root.glob("*.tar")), shardshuffle=False)
    ]
    assert sorted(keys) == sorted(truth)


def test_shuffled_shards_index_and_train_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "shuffled"), "key", maxcount=30)
    code = main(["shards", "index", str(root), "--class-from-key", "_", "--category-field", "family"])
    out = capsys.readouterr().out
    assert code == 0
    assert "spans per class" not in out and "per class, at most" in out and "shards reshard" in out
    assert main(["shards", "verify", str(root), "--workers", "1"]) == 0
    assert "per class, at most" in format_info(root)
    assert main(["plan", *TINY_OVERRIDES, f"data.shards={root}", "data.test_split="]) == 0
    out = capsys.readouterr().out
    # A local folder: the reshard hint, not the advice for reads from a URL.
    assert "reads per step" in out and "ddp-rank shards reshard" in out and "read from a URL" not in out
    run = tmp_path / "run"
    train = ["train", *TINY_OVERRIDES, f"data.shards={root}", "data.test_split=", f"train.output_dir={run}"]
    assert main([*train, "train.steps=3"]) == 0
    assert json.loads((run / "run.json").read_text())["steps"] == 3


def test_an_index_error_names_the_tar_as_it_lies(tmp_path: Path) -> None:
    """The tars at the top level are named as they are (not under a ``train/`` that does not exist)."""
    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "shuffled"), "json", maxcount=25)
    with pytest.raises(ShardIndexError) as err:
        index_shards(root, find_splits(root, []), IndexOptions(class_field="species"))
    named = str(err.value).split(":")[0]
    assert (root / named).is_file(), err.value
    with pytest.raises(ShardIndexError, match="--class-from-key"):
        index_shards(root, find_splits(root, []), IndexOptions(class_from_key="-"))


class _CountingHandler(RangeRequestHandler):
    """Range requests answered after a pause, counting how many are in flight at once."""

    lock = threading.Lock()
    in_flight = 0
    most = 0
    ranges = 0

    def send_head(self) -> Any:
        if "Range" in self.headers:
            cls = type(self)
            with cls.lock:
                cls.in_flight += 1
                cls.ranges += 1
                cls.most = max(cls.most, cls.in_flight)
            time.sleep(0.02)
            with cls.lock:
                cls.in_flight -= 1
        return super().send_head()


@pytest.mark.slow
def test_a_class_of_several_spans_is_read_from_a_url_with_concurrent_requests(tmp_path: Path) -> None:
    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "interleaved"), "cls", maxcount=25)
    local = _index(root, "cls")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_CountingHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = Manifest(local.categories, local.classes, local.splits, local.build, root=url)
        spans = sum(len(s.classes) for s in remote.split("train").shards)
        assert _images_by_class(remote) == _images_by_class(local)
        assert _CountingHandler.ranges == spans  # one request per span
        assert _CountingHandler.most > 1  # the spans of a class were requested concurrently
        # A span that does not match its digest costs its class, naming the shard.
        shard = remote.split("train").shards[1]
        path = root / shard.path
        data = bytearray(path.read_bytes())
        data[shard.classes[0].offset + 600] ^= 0xFF
        path.write_bytes(bytes(data))
        reader = ClassReader(remote, "train")
        with pytest.raises(ClassReadError, match=f"{shard.path}: bytes do not match the manifest's digest"):
            reader.read(shard.classes[0].id)
        reader.close()
    finally:
        server.shutdown()
        server.server_close()


def test_reads_per_step_are_what_the_stream_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ddp-rank plan``'s count (spans of each class dealt to each rank) against the requests the two ranks'
    streams make for the same steps."""
    from ddp_rank.data.reading.storage import ShardStore
    from ddp_rank.data.sampling.dealing import deal

    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "shuffled"), "json", maxcount=25)
    manifest = _index(root, "json")
    requests: list[int] = []
    read_many = ShardStore.read_many

    def spy(self: ShardStore, batch: list[tuple[object, int, int]]) -> list[bytes | Exception]:
        requests.append(len(batch))
        return read_many(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardStore, "read_many", spy)
    schedule = ScheduleConfig(batches_per_pair=2, seed=7)
    streams = [
        ShardStream(manifest, 24, schedule=schedule, transform=TINY, rank=r, world_size=2) for r in range(2)
    ]
    frag = fragmentation(manifest, "train")
    for step in range(3):
        requests.clear()
        for stream in streams:
            stream.batch(0, step)
        parts = deal(streams[0].plan.step(0, step), 2, schedule.seed)
        assert sum(requests) == sum(frag.requests(p.class_id for p in part) for part in parts) > 0


def test_reshard_is_advised_only_where_classes_are_fragmented(tmp_path: Path) -> None:
    own = fragmentation(_own_layout(tmp_path), "train")
    assert own.spans == own.classes and own.max_spans == 1
    # small classes: request-bound from a URL even when contiguous, but resharding cannot help
    advice = own.advice("s3://bucket/shards")
    assert advice is not None and "data.cache_dir=DIR" in advice and "reshard" not in advice
    assert own.advice("shards") is None  # a local folder: nothing to do
    big = Fragmentation("train", classes=2, spans=4, max_spans=2, span_bytes=4 * 2**21, spans_of={0: 2, 1: 2})
    assert not big.request_bound and big.advice() is None and big.bound().startswith("bandwidth-bound")
    assert big.requests([0, 1, 1]) == 6


def test_info_counts_a_shard_that_mixes_categories_under_each_of_them(tmp_path: Path) -> None:
    from ddp_rank.data.format.info import info_rows

    root = tmp_path / "wds"
    write_with_shardwriter(root, ordered(SAMPLES, "shuffled"), "cls", maxcount=30)
    manifest = _index(root, "cls")
    shards = manifest.split("train").shards
    rows = {category: row for _, category, *row in info_rows(manifest)}
    for c, name in enumerate(manifest.categories):
        holding = [s for s in shards if any(manifest.classes[x.id].category == c for x in s.classes)]
        classes = [k for k in manifest.classes if k.category == c]
        images = sum(manifest.split("train").class_counts[k.id] for k in classes)
        assert rows[name][:3] == [len(classes), images, len(holding)]
    assert rows["TOTAL"][:3] == [len(manifest.classes), len(SAMPLES), len(shards)]
    shared_mb = sum(rows[name][3] for name in manifest.categories)
    assert abs(shared_mb - rows["TOTAL"][3]) < 1e-9  # each shard's bytes shared out, none counted twice
