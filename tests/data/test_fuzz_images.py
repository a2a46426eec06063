"""Seeded fuzzing of the image bytes inside shards (``tests/helpers/image_fuzz.py``: CMYK, 16-bit, palette and
animated images, each cut short, flipped and given a huge size in its header; decompression bombs; files that
are no image) through the training stream and ``shards verify``. Every case must end in a counted replacement
(the stream) or one line naming the sample (verify), within a bounded time and memory: no traceback, and no
bomb decoded."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from ddp_rank.cli import main
from ddp_rank.data.building.shard_index import IndexOptions, find_splits, index_shards
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.eval_reader import EvalShards
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig
from tests.helpers.image_fuzz import FuzzCase, fuzz_cases, legitimate_images

pytestmark = pytest.mark.slow

GOOD_CLASSES = 24
CASE_LIMIT_S = 5.0
"""A step or a command slower than this counts as a hang (each takes milliseconds)."""
MEMORY_LIMIT_MB = 64
"""More than this over a sound set's peak means an image was decoded that should not have been (the
12,000 x 12,000 bomb alone is 144 MB as PIL holds it, 576 MB in RGB)."""


def _png(seed: int) -> bytes:
    import io

    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (12, 12, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _write_and_index(root: Path, cases: list[FuzzCase]) -> None:
    """Class ``f<i>`` holds case i and a sound image, class ``g<j>`` two sound images; keys ``<class>_<n>``."""
    root.mkdir(parents=True)
    with wds.ShardWriter(str(root / "part-%05d.tar"), maxcount=40, verbose=0) as sink:
        for i, case in enumerate(cases):
            sink.write({"__key__": f"f{i:03d}_0", case.ext: case.data, "json": '{"family": "k"}'})
            sink.write({"__key__": f"f{i:03d}_1", "png": _png(i), "json": '{"family": "k"}'})
        for j in range(GOOD_CLASSES):
            for n in range(2):
                sink.write(
                    {"__key__": f"g{j:03d}_{n}", "png": _png(1000 + 2 * j + n), "json": '{"family": "k"}'}
                )
    options = IndexOptions(class_from_key="_", category_field="family")
    index_shards(root, find_splits(root, []), options).manifest.save(root)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[FuzzCase]]:
    root = tmp_path_factory.mktemp("image-fuzz") / "wds"
    cases = fuzz_cases()
    _write_and_index(root, cases)
    return root, cases


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The legitimate images alone, in the same layout: the baseline of the memory check."""
    root = tmp_path_factory.mktemp("image-sound") / "wds"
    _write_and_index(root, legitimate_images())
    return root


def _classes(cases: list[FuzzCase], must_fail: bool | None = None, names: set[str] | None = None) -> set[str]:
    return {
        f"f{i:03d}"
        for i, c in enumerate(cases)
        if (must_fail is None or c.must_fail == must_fail) and (names is None or c.name in names)
    }


def _one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message, message


_NAMED = re.compile(r"image (f\d{3})_0\.(?:jpg|png|webp) does not decode: ")


def test_stream_replaces_and_counts_every_image_that_does_not_decode(
    fuzzed: tuple[Path, list[FuzzCase]], caplog: pytest.LogCaptureFixture
) -> None:
    root, cases = fuzzed
    stream = ShardStream(
        Manifest.load(root),
        8,
        schedule=ScheduleConfig(strategy="pk", images_per_class=2),
        transform=TransformConfig(resize=8, crop=8),
        rank=0,
        world_size=1,
    )
    fuzz = _classes(cases)
    loaded: set[str] = set()
    replaced = decode_errors = 0
    slowest = 0.0
    caplog.set_level(logging.WARNING, logger="ddp_rank.data.reading.stream")
    try:
        for epoch in range(20):
            for step in range(stream.steps_per_epoch):
                start = time.perf_counter()
                batch = stream.batch(epoch, step)
                slowest = max(slowest, time.perf_counter() - start)
                replaced += batch.events.replaced_classes
                decode_errors += batch.events.decode_errors
                loaded |= {key.split("_")[0] for key in batch.keys}
            refused = {m.group(1) for r in caplog.records if (m := _NAMED.search(r.getMessage()))}
            if fuzz <= loaded | refused:
                break
    finally:
        stream.reader.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for message in warnings:
        _one_line(message)
    print(
        f"\n{len(cases)} image cases: {len(fuzz & loaded)} decoded, {len(refused)} replaced ({replaced} times)"
    )
    assert fuzz <= loaded | refused, sorted(fuzz - loaded - refused)  # every case was drawn
    assert not loaded & refused  # an image that fails once fails every time: never in a batch
    assert _classes(cases, must_fail=True) <= refused, sorted(_classes(cases, must_fail=True) - refused)
    assert _classes(cases, names={c.name for c in legitimate_images()}) <= loaded  # CMYK, 16-bit, animated...
    assert replaced == decode_errors > 0  # each failure replaced once and counted once
    # each cause (shard and reason) logged once, however many classes it fails
    assert 0 < len(warnings) <= decode_errors and len(set(warnings)) == len(warnings)
    assert slowest < CASE_LIMIT_S


def test_the_evaluation_reader_leaves_out_each_image_that_does_not_decode(
    fuzzed: tuple[Path, list[FuzzCase]], caplog: pytest.LogCaptureFixture
) -> None:
    root, cases = fuzzed
    caplog.set_level(logging.WARNING, logger="ddp_rank.data.reading.eval_reader")
    reader = EvalShards(
        root, "train", batch_size=16, transform=TransformConfig(resize=8, crop=8), rank=0, world_size=1
    )
    keys = [key for batch in reader for key in batch.keys]
    left_out = {m.group(1) for r in caplog.records if (m := _NAMED.search(r.getMessage()))}
    assert len(keys) + len(left_out) == reader.total == len(set(keys)) + len(left_out)  # each once, or named
    assert _classes(cases, must_fail=True) <= left_out
    assert {f"{c}_0" for c in _classes(cases, names={c.name for c in legitimate_images()})} <= set(keys)


def test_shards_verify_names_every_image_that_does_not_decode(
    fuzzed: tuple[Path, list[FuzzCase]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, cases = fuzzed
    start = time.perf_counter()
    assert main(["shards", "verify", str(root), "--workers", "1"]) == 1
    assert time.perf_counter() - start < CASE_LIMIT_S
    lines = capsys.readouterr().err.splitlines()
    for line in lines:
        _one_line(line)
    named = {m.group(1) for line in lines if (m := _NAMED.search(line))}
    assert len(named) == len(lines) - 1  # one line per image, then the FAILED line
    assert _classes(cases, must_fail=True) <= named
    assert not named & _classes(cases, names={c.name for c in legitimate_images()})
    bomb = next(line for line in lines if f"image f{_index(cases, 'bomb-20000')}_0.png" in line)
    assert "20000 x 20000 = 400,000,000 pixels is over the limit of 89,478,485" in bomb


def _index(cases: list[FuzzCase], name: str) -> str:
    return f"{next(i for i, c in enumerate(cases) if c.name == name):03d}"


def test_verify_takes_the_pixel_limit(sound: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-image-pixels``: the legitimate 24 x 24 images (576 pixels) are over a limit of 575, and named."""
    assert main(["shards", "verify", str(sound), "--workers", "1", "--max-image-pixels", "576"]) == 0
    capsys.readouterr()
    assert main(["shards", "verify", str(sound), "--workers", "1", "--max-image-pixels", "575"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(legitimate_images()) + 1
    assert all("24 x 24 = 576 pixels is over the limit of 575" in line for line in lines[:-1])
    with pytest.raises(SystemExit):  # argparse's own one line
        main(["shards", "verify", str(sound), "--max-image-pixels", "0"])
    assert "not a positive whole number of pixels" in capsys.readouterr().err


_PEAK = """
import resource, sys
from ddp_rank.cli import main
assert main(["shards", "verify", sys.argv[1], "--workers", "1"]) == 0
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = main(["shards", "verify", sys.argv[2], "--workers", "1"])
print(code, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_bombs_cost_no_memory(fuzzed: tuple[Path, list[FuzzCase]], sound: Path) -> None:
    """Peak memory of ``shards verify`` over the fuzzed shards, above that over sound ones, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, str(sound), str(fuzzed[0])],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    code, grown_mb = (int(v) for v in result.stdout.split()[-2:])
    print(f"\npeak memory of verify over the fuzzed shards: +{grown_mb} MB")
    assert code == 1 and grown_mb < MEMORY_LIMIT_MB


def test_training_over_the_fuzzed_shards_finishes_and_counts_the_replacements(
    fuzzed: tuple[Path, list[FuzzCase]], tmp_path: Path
) -> None:
    """``ddp-rank train`` with a DataLoader worker: the bombs and the rest are replaced, counted in
    metrics.jsonl, and the run finishes (it crashed on a DecompressionBombError before)."""
    import json

    from tests.helpers.training import TINY_OVERRIDES

    run = tmp_path / "run"
    overrides = [*TINY_OVERRIDES, f"data.shards={fuzzed[0]}", f"train.output_dir={run}", "data.sampler=pk",
                 "data.images_per_class=2", "data.num_workers=1", "data.test_split=", "train.steps=12"]  # fmt: skip
    assert main(["train", *overrides]) == 0
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 12
    assert sum(r["data_replaced_classes"] for r in train) == sum(r["data_decode_errors"] for r in train) > 0
