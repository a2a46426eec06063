"""Seeded fuzzing of what the data layer reads from outside: hundreds of mutations of a ``manifest.json``
(types, missing keys, negative and huge numbers, hostile paths, text that is not JSON) and of a tar shard
(flipped bytes, truncation at and between header boundaries, duplicate keys). Every case must end in a one-line
error or in classes replaced and counted by the stream, quickly: no traceback, no hang, and no file opened
outside the shard root (an audit hook records every ``open``)."""

from __future__ import annotations

import copy
import io
import json
import random
import shutil
import tarfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.info import info_rows
from ddp_rank.data.format.manifest import Manifest, ManifestError, span_digest
from ddp_rank.data.reading.stream import DataError, PlanError, ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig

MANIFEST_CASES = 300
TAR_CASES = 100
CASE_LIMIT_S = 5.0
"""A case slower than this counts as a hang (each takes milliseconds)."""
SECRET = "secret-outside.tar"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("fuzz")
    write_image_folder(tmp / "img", [[2, 2, 3], [3, 3, 2]], image_size=8)
    build_shards(read_image_folder(tmp / "img"), tmp / "s", BuildOptions(max_samples=5, progress=False))
    return tmp / "s"


@pytest.fixture
def workspace(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the shards in ``tmp_path/root/s``, and beside the root a file no read may touch."""
    shutil.copytree(pristine, tmp_path / "root" / "s")
    (tmp_path / "root" / SECRET).write_bytes((tmp_path / "root" / "s" / _first_shard(pristine)).read_bytes())
    (tmp_path / SECRET).write_bytes(b"\0" * 4096)
    return tmp_path / "root" / "s"


def _first_shard(directory: Path) -> str:
    return str(Manifest.load(directory).split("train").shards[0].path)



# ---------------------------------------------------------------- manifest mutations

_HOSTILE_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    -(10**12),
    10**12,
    2**63,
    1e12,
    float("nan"),
    "",
    "x",
    "../../" + SECRET,
    "../" + SECRET,
    "/etc/passwd",
    "//evil.example/x.tar",
    "http://evil.example/x.tar",
    "file:///etc/passwd",
    "a/../../" + SECRET,
    "%2e%2e/" + SECRET,
    "C:\\x.tar",
    [],
    {},
    [0, 1, 2],
    {"id": 0},
]


def _nodes(value: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) of a parsed JSON document."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append((value, key))
        _nodes(child, out)
    return out


def _mutate_manifest(data: dict[str, Any], rng: random.Random) -> str:
    """The text of one seeded mutation of ``data`` (a fresh copy is changed)."""
    kind = rng.choice(["replace", "replace", "replace", "delete", "duplicate", "number", "path", "text"])
    doc = copy.deepcopy(data)
    nodes = _nodes(doc, [])
    container, key = rng.choice(nodes)
    if kind == "replace":
        container[key] = copy.deepcopy(rng.choice(_HOSTILE_VALUES))
    elif kind == "delete":
        del container[key]
    elif kind == "duplicate" and isinstance(container, list):
        container.append(copy.deepcopy(container[key]))
    elif kind == "number":
        numbers = [(c, k) for c, k in nodes if type(c[k]) is int]
        c, k = rng.choice(numbers)
        c[k] = rng.choice([-c[k] - 1, c[k] * 10**9, c[k] + 1, c[k] - 1, 2**40, 2**31 - 1])
    elif kind == "path":
        shard = rng.choice([s for split in doc["splits"].values() for s in split["shards"]])
        shard["path"] = rng.choice([v for v in _HOSTILE_VALUES if isinstance(v, str)])
    elif kind == "text":
        text = json.dumps(doc)
        cut = rng.randrange(len(text))
        return rng.choice([text[:cut], text[:cut] + "\x00" + text[cut:], json.dumps([doc]), "7", "null"])
    return json.dumps(doc)


def _read_everything(directory: Path, only: str | None = None) -> str:
    """Load the manifest and read every class of every split through the training stream's reader and
    ``shards info``; returns the outcome. Anything but a ManifestError / a per-class error propagates."""
    try:
        manifest = Manifest.load(directory)
    except ManifestError as exc:
        _one_line(str(exc))
        return "refused"
    assert info_rows(manifest)  # ``shards info`` takes any manifest the loader accepts
    outcomes = [_stream_outcome(manifest, name) for name in manifest.splits if only in (None, name)]
    return max(outcomes, key=_SEVERITY.index)


_SEVERITY = ["loaded", "replaced", "plan refused", "data error"]


def _stream_outcome(manifest: Manifest, split: str) -> str:
    """Every step of one epoch of the stream on ``split``: 'loaded' (all classes read), 'replaced' (some
    replaced and counted) or 'data error' (no replacement left: one line)."""
    try:
        stream = _stream(manifest, split)
    except PlanError as exc:  # the mutated split cannot fill a batch
        _one_line(str(exc))
        return "plan refused"
    replaced = 0
    try:
        for step in range(stream.steps_per_epoch):
            replaced += stream.batch(0, step).events.replaced_classes
    except DataError as exc:
        _one_line(str(exc))
        return "data error"
    finally:
        stream.reader.close()
    return "replaced" if replaced else "loaded"


def _stream(manifest: Manifest, split: str) -> ShardStream:
    return ShardStream(
        manifest,
        4,
        split=split,
        schedule=ScheduleConfig(strategy="random"),
        transform=TransformConfig(resize=8, crop=8),
        rank=0,
        world_size=1,
    )


def _one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message, message


def _outside(opened: list[str], root: Path) -> list[str]:
    """The opened files that are the planted secrets, a system file, or a tar outside the shard root."""
    inside = root.resolve()
    return [
        p
        for p in opened
        if SECRET in p
        or p.startswith("/etc/")
        or (p.endswith(".tar") and not Path(p).resolve().is_relative_to(inside))
    ]


def test_manifest_mutations_end_in_one_line_or_a_counted_replacement(
    workspace: Path, opened: list[str]
) -> None:
    rng = random.Random(2026)
    original = json.loads((workspace / "manifest.json").read_text())
    outcomes: Counter[str] = Counter()
    slowest = 0.0
    for case in range(MANIFEST_CASES):
        text = _mutate_manifest(original, rng)
        (workspace / "manifest.json").write_text(text)
        start = time.perf_counter()
        try:
            outcomes[_read_everything(workspace)] += 1
        except Exception as exc:  # the point of the test: name the case that escaped
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc} for manifest {text[:300]}")
        slowest = max(slowest, time.perf_counter() - start)
    print(f"\n{MANIFEST_CASES} manifest mutations: {dict(outcomes)}; slowest case {slowest:.2f} s")
    assert outcomes["refused"] > MANIFEST_CASES // 2, outcomes  # most mutations break a checked field
    assert outcomes["loaded"] > 0, outcomes  # some change nothing that matters (a name, the build record)
    assert slowest < CASE_LIMIT_S
    assert _outside(opened, workspace) == []


# ---------------------------------------------------------------- tar mutations


def _members(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each member of a tar: its header to the end of its padded data."""
    spans = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for info in tar:
            end = info.offset_data + -(-info.size // 512) * 512
            spans.append((info.offset, end))
    return spans


def _duplicate_keys(data: bytes, rng: random.Random) -> bytes:
    """The tar with a run of members repeated right after itself: the same keys twice in a row."""
    members = _members(data)
    first = rng.randrange(len(members))
    last = min(len(members), first + rng.choice([1, 3]))
    start, end = members[first][0], members[last - 1][1]
    return data[:end] + data[start:end] + data[end:]


def _mutate_tar(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["flip", "flip", "cut at a header", "cut between", "duplicate keys"])
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.choice([1, 1, 4, 32])):
            out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
        return kind, bytes(out)
    if kind == "cut at a header":
        return kind, data[: 512 * rng.randrange(len(data) // 512)]
    if kind == "cut between":
        return kind, data[: rng.randrange(len(data))]
    return kind, _duplicate_keys(data, rng)


def _consistent(manifest: dict[str, Any], rel: str, data: bytes) -> dict[str, Any]:
    """The manifest with the spans of shard ``rel`` re-digested over the mutated bytes (a hostile writer who
    also forged the manifest): the reader then meets the damage itself instead of a digest mismatch."""
    doc = copy.deepcopy(manifest)
    for split in doc["splits"].values():
        for shard in split["shards"]:
            if shard["path"] != rel:
                continue
            shard["bytes"] = len(data)
            for row in shard["classes"]:
                offset, length = row[2], row[3]
                if offset + length <= len(data):
                    row[4] = span_digest(data[offset : offset + length])
    return doc


@pytest.mark.slow
def test_tar_mutations_end_in_one_line_or_a_counted_replacement(
    workspace: Path, opened: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rng = random.Random(25)
    manifest_path = workspace / "manifest.json"
    original = json.loads(manifest_path.read_text())
    shards = [s["path"] for split in original["splits"].values() for s in split["shards"]]
    pristine = {rel: (workspace / rel).read_bytes() for rel in shards}
    outcomes: Counter[str] = Counter()
    slowest = 0.0
    for case in range(TAR_CASES):
        rel = rng.choice(shards)
        split = rel.split("/")[0]
        kind, data = _mutate_tar(pristine[rel], rng)
        (workspace / rel).write_bytes(data)
        start = time.perf_counter()
        try:
            for label, doc in (("as built", original), ("forged", _consistent(original, rel, data))):
                manifest_path.write_text(json.dumps(doc))
                outcomes[f"{kind}, {label}: {_read_everything(workspace, split)}"] += 1
            manifest_path.write_text(json.dumps(original))
            outcomes[f"verify: {_cli(['shards', 'verify', str(workspace), '--workers', '1'], capsys)}"] += 1
            index = ["shards", "index", str(workspace), "--out", str(tmp_path / "index")]
            outcomes[f"index: {_cli(index, capsys)}"] += 1
        except Exception as exc:
            pytest.fail(f"case {case} ({kind} of {rel}): {type(exc).__name__}: {exc}")
        finally:
            (workspace / rel).write_bytes(pristine[rel])
            manifest_path.write_text(json.dumps(original))
        slowest = max(slowest, time.perf_counter() - start)
    print(f"\n{TAR_CASES} tar mutations: {dict(sorted(outcomes.items()))}; slowest case {slowest:.2f} s")
    assert any("replaced" in k for k in outcomes), outcomes
    assert outcomes["verify: refused"] > 0 and outcomes["index: refused"] > 0, outcomes
    assert slowest < CASE_LIMIT_S
    assert _outside(opened, workspace) == []


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run a ``ddp-rank`` command; 'ok' or 'refused', after checking that each error line stands alone."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for line in err.splitlines():
        _one_line(line)
    return "ok" if code == 0 else "refused"
