"""``ddp-rank shards reshard``: some 1,500 samples written by ``webdataset.ShardWriter`` in shuffled order,
indexed in place, rewritten into the project's layout: one category per shard, classes contiguous, every batch
the same as on the source, memory bounded by the setting, no half shard, identical output after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.data.building.reshard import STATE_DIR, ReshardError, ReshardOptions, reshard
from ddp_rank.data.building.shard_index import IndexOptions, find_splits, index_shards
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.serve import serve_directory
from ddp_rank.data.reading.storage import ShardStore
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig
from tests.helpers.foreign_shards import foreign_samples, ordered, write_with_shardwriter

REPO = Path(__file__).resolve().parents[2]
TINY = TransformConfig(resize=8, crop=6)
SMALL = ReshardOptions(max_samples=40, memory_bytes=32 * 1024, progress=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 1,500 samples of 280 classes in 4 categories, shuffled, 100 per tar, indexed in place: each class
    cut across several tars, more reads than fit the memory setting, enough output shards to kill a run in."""
    root = tmp_path_factory.mktemp("reshard") / "wds"
    samples = foreign_samples(classes_per_category=70, categories=4, seed=1)
    assert len(samples) > 1200
    write_with_shardwriter(root, ordered(samples, "shuffled", seed=2), "cls", maxcount=100)
    index_shards(root, find_splits(root, []), IndexOptions(category_field="family")).manifest.save(root)
    return root


@pytest.fixture(scope="module")
def resharded_and_reads(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The resharded copy, and the span bytes of each read of the source it took."""
    dst = tmp_path_factory.mktemp("out") / "contiguous"
    held: list[int] = []
    read_many = ShardStore.read_many

    def spy(self: ShardStore, requests: list[tuple[object, int, int]]) -> list[bytes | Exception]:
        held.append(sum(length for _, _, length in requests))
        return read_many(self, requests)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardStore, "read_many", spy)
        reshard(source, dst, SMALL)
    return dst, held


@pytest.fixture(scope="module")
def resharded(resharded_and_reads: tuple[Path, list[int]]) -> Path:
    return resharded_and_reads[0]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_output_has_the_projects_layout_and_verifies(source: Path, resharded: Path) -> None:
    before, after = Manifest.load(source), Manifest.load(resharded)
    assert after.classes == before.classes and after.categories == before.categories
    assert after.split("train").class_counts == before.split("train").class_counts
    shards = after.split("train").shards
    assert all(s.category is not None for s in shards)  # one category per shard
    assert all(s.samples <= 40 for s in shards)
    spans = [span.id for s in shards for span in s.classes]
    assert len(spans) == len(set(spans)) == len(after.classes)  # every class is one span
    assert sum(len(s.classes) for s in before.split("train").shards) > 2 * len(before.classes)
    assert verify_shards(resharded, decode=True) == []
    assert not (resharded / STATE_DIR).exists()


def test_every_batch_is_the_same_on_the_resharded_copy(source: Path, resharded: Path) -> None:
    """Class ids, counts and each class's sample order are kept: the same plan reads the same images, and the
    augmentation (seeded by class and image index) gives the same tensors."""

    def batches(shards: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
        stream = ShardStream(
            shards,
            32,
            schedule=ScheduleConfig(batches_per_pair=2, seed=5),
            transform=TINY,
            rank=1,
            world_size=2,
        )
        return [(b.images, b.labels) for b in (stream.batch(e, s) for e in (0, 1) for s in range(4))]

    for (xa, ya), (xb, yb) in zip(batches(source), batches(resharded), strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_memory_is_bounded_by_the_setting(resharded_and_reads: tuple[Path, list[int]]) -> None:
    """No read of the source holds more span bytes than memory_bytes (every span here is smaller)."""
    _, held = resharded_and_reads
    assert max(held) <= SMALL.memory_bytes and len(held) > 20
    assert max(held) > SMALL.memory_bytes // 2  # windows are filled, not one span each


@pytest.mark.slow
def test_a_killed_reshard_resumes_to_identical_output(source: Path, resharded: Path, tmp_path: Path) -> None:
    dst = tmp_path / "killed"
    cmd = [sys.executable, "-m", "ddp_rank.cli", "shards", "reshard", str(source), str(dst), "--max-samples", "40",
           "--memory-mb", "0.03125", "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = dst / STATE_DIR / "done.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.is_file() and journal.read_text().count("\n") >= 3:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (dst / "manifest.json").exists(), "the reshard finished before it could be killed mid-way"
    # Whatever carries a final name is a whole shard, identical to the uninterrupted run's.
    expected = _files(resharded)
    for name, data in _files(dst).items():
        if name.endswith(".tar") and not name.split("/")[-1].startswith("."):
            assert data == expected[name], name
    assert main(["shards", "reshard", str(source), str(dst), "--max-samples", "40", "--no-progress"]) == 0
    assert _files(dst) == expected


@pytest.mark.slow
def test_a_source_behind_a_url_gives_the_same_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, ordered(foreign_samples(12, 3), "shuffled"), "json", maxcount=40)
    options = IndexOptions(class_field="label", category_field="family")
    index_shards(src, find_splits(src, []), options).manifest.save(src)
    small = ReshardOptions(max_samples=30, memory_bytes=16 * 1024, progress=False)
    cli = [
        "shards",
        "reshard",
        str(src),
        str(tmp_path / "local"),
        "--max-samples",
        "30",
        "--memory-mb",
        "0.015625",
    ]
    assert main(cli) == 0
    captured = capsys.readouterr()
    assert "reshard: 100%" in captured.err and "TOTAL" in captured.out  # the progress bar, then the table
    with serve_directory(src) as url:
        reshard(url, tmp_path / "remote", small)
        # A local manifest of shards at a URL (`shards index URL --out DIR`) as the source.
        brace = f"train=part-{{00000..{len(list(src.glob('*.tar'))) - 1:05d}}}.tar"
        index = [
            "shards",
            "index",
            url,
            "--split",
            brace,
            "--class-field",
            "label",
            "--category-field",
            "family",
        ]
        assert main([*index, "--out", str(tmp_path / "manifest")]) == 0
        reshard(tmp_path / "manifest", tmp_path / "via-manifest", small)
    local, remote = _files(tmp_path / "local"), _files(tmp_path / "remote")
    tars = {k: v for k, v in local.items() if k.endswith(".tar")}
    assert {k: v for k, v in remote.items() if k.endswith(".tar")} == tars
    assert {k: v for k, v in _files(tmp_path / "via-manifest").items() if k.endswith(".tar")} == tars
    assert len(local) > 3 and Manifest.load(tmp_path / "remote").build["resharded_from"] == url


def test_bad_destinations_settings_and_sources_are_refused_by_name(
    source: Path, resharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["shards", "reshard", str(source), str(tmp_path / "zero"), "--memory-mb", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory-mb (memory_bytes=0) is too small" in err
    assert main(["shards", "reshard", str(tmp_path / "nowhere"), str(tmp_path / "x"), "--no-progress"]) == 2
    assert "manifest.json not found" in capsys.readouterr().err
    with pytest.raises(ReshardError, match="holds finished shards; pick a new DST"):
        reshard(source, resharded, SMALL)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("x")
    with pytest.raises(ReshardError, match="is not empty"):
        reshard(source, tmp_path / "full", SMALL)
    # A run under way with other settings is not mixed with a new one.
    dst = tmp_path / "other"
    (dst / STATE_DIR).mkdir(parents=True)
    (dst / STATE_DIR / "plan.json").write_text('{"source": "elsewhere", "options": {}}')
    with pytest.raises(ReshardError, match=r"plan\.json: .* unfinished reshard of elsewhere"):
        reshard(source, dst, SMALL)
    # A corrupt source span stops the run naming the shard; no half shard is left under a final name.
    copy = tmp_path / "src"
    copy.mkdir()
    for name, data in _files(source).items():
        (copy / name).write_bytes(data)
    shard = Manifest.load(copy).split("train").shards[2]
    data = bytearray((copy / shard.path).read_bytes())
    data[shard.classes[0].offset + 700] ^= 0xFF
    (copy / shard.path).write_bytes(bytes(data))
    code = main(
        ["shards", "reshard", str(copy), str(tmp_path / "bad"), "--no-progress", "--max-samples", "40"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{shard.path}: class" in err and "digest" in err
    expected = _files(resharded)
    for name, got in _files(tmp_path / "bad").items():
        if name.endswith(".tar"):
            assert not name.split("/")[-1].startswith(".") and got == expected[name]


@pytest.mark.slow
def test_a_span_larger_than_the_memory_setting_is_streamed(resharded: Path, tmp_path: Path) -> None:
    """The contiguous copy as a source: every class is one span of several KiB. With 1 KiB of memory each is
    streamed member by member; the output equals that of reads held whole, and a corrupt span is refused."""
    biggest = max(span.length for s in Manifest.load(resharded).split("train").shards for span in s.classes)
    assert biggest > 2048
    whole = ReshardOptions(max_samples=200, memory_bytes=biggest, progress=False)
    reshard(resharded, tmp_path / "whole", whole)
    reshard(
        resharded, tmp_path / "streamed", ReshardOptions(max_samples=200, memory_bytes=1024, progress=False)
    )
    tars = {k: v for k, v in _files(tmp_path / "whole").items() if k.endswith(".tar")}
    assert tars == {k: v for k, v in _files(tmp_path / "streamed").items() if k.endswith(".tar")}
    copy = tmp_path / "copy"
    for name, data in _files(resharded).items():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(data)
    shard = Manifest.load(copy).split("train").shards[0]
    data = bytearray((copy / shard.path).read_bytes())
    data[shard.classes[1].offset + 700] ^= 0xFF
    (copy / shard.path).write_bytes(bytes(data))
    with pytest.raises(ReshardError, match=f"{shard.path}: class {shard.classes[1].id} .*digest"):
        reshard(copy, tmp_path / "bad", ReshardOptions(max_samples=200, memory_bytes=1024, progress=False))
    assert not [p for p in (tmp_path / "bad").rglob("*.tar")]
