"""``manifest.json`` is checked field by field when loaded, and a shard path cannot lead a read outside the
shard root: the loader refuses it, and so does the place where a path is resolved for reading."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest, ManifestError, confined_join, shard_path_problem
from ddp_rank.data.reading.reader import ClassReader, ClassReadError

Mutation = Callable[[dict[str, Any]], Any]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two categories, five classes, four shards; the first shard holds two classes of 2 images."""
    tmp = tmp_path_factory.mktemp("built")
    write_image_folder(tmp / "img", [[2, 2, 3], [3, 3]], image_size=8)
    build_shards(read_image_folder(tmp / "img"), tmp / "s", BuildOptions(max_samples=5, progress=False))
    return tmp / "s"


@pytest.fixture
def shards(built: Path, tmp_path: Path) -> Path:
    """A fresh copy of the manifest beside links to the built tars (mutations write only the manifest)."""
    out = tmp_path / "shards"
    for path in built.rglob("*"):
        target = out / path.relative_to(built)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.name == "manifest.json":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    return out


def _mutate(directory: Path, change: Mutation) -> Path:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    replaced = change(data)
    path.write_text(json.dumps(data if replaced is None else replaced))
    return path


def _shard(data: dict[str, Any], index: int = 0) -> dict[str, Any]:
    shard: dict[str, Any] = data["splits"]["train"]["shards"][index]
    return shard


def _set(where: Callable[[dict[str, Any]], Any], key: Any, value: Any) -> Mutation:
    def change(data: dict[str, Any]) -> None:
        where(data)[key] = value

    return change


def _first_span(data: dict[str, Any]) -> list[Any]:
    span: list[Any] = _shard(data)["classes"][0]
    return span


# (mutation, the JSON path the message must name, a word of the problem)
CASES: dict[str, tuple[Mutation, str, str]] = {
    "a JSON list": (lambda d: [d], "(top level)", "a JSON list"),
    "no splits": (lambda d: d.pop("splits") and None, "splits: missing", "missing"),
    "splits a list": (_set(lambda d: d, "splits", []), "splits:", "a JSON list"),
    "path a number": (_set(_shard, "path", 123), "splits.train.shards[0].path", "the number 123"),
    "path up and out": (
        _set(_shard, "path", "../../../etc/hostname"),
        "splits.train.shards[0].path",
        "'..' segment",
    ),
    "absolute path": (_set(_shard, "path", "/etc/passwd"), "splits.train.shards[0].path", "absolute"),
    "another host": (
        _set(_shard, "path", "http://evil.example/x.tar"),
        "splits.train.shards[0].path",
        "no scheme",
    ),
    "network path": (_set(_shard, "path", "//evil.example/x.tar"), "splits.train.shards[0].path", "absolute"),
    "encoded dots": (_set(_shard, "path", "%2e%2e/x.tar"), "splits.train.shards[0].path", "'%'"),
    "a class missing from its split": (
        lambda d: d["splits"]["train"]["classes"].pop(0) and None,
        "splits.train.shards[0].classes[0][0]",
        "not listed in splits.train.classes",
    ),
    "an unknown class": (
        _set(_first_span, 0, 99),
        "splits.train.shards[0].classes[0][0]",
        "class 99 does not exist",
    ),
    "a float length": (_set(_first_span, 3, 1e12), "splits.train.shards[0].classes[0][3]", "integer"),
    "a huge length": (_set(_first_span, 3, 10**12), "splits.train.shards[0].classes[0][3]", "out of range"),
    "a negative offset": (_set(_first_span, 2, -1), "splits.train.shards[0].classes[0][2]", "out of range"),
    "a boolean count": (_set(_first_span, 1, True), "splits.train.shards[0].classes[0][1]", "boolean"),
    "a count off the spans": (
        lambda d: d["splits"]["train"]["classes"][0].update(count=99),
        "splits.train.classes[0].count",
        "the split's shards hold",
    ),
    "samples off the spans": (_set(_shard, "samples", 1), "splits.train.shards[0].samples", "spans hold"),
    "a short span row": (
        lambda d: _first_span(d).pop() and None,
        "splits.train.shards[0].classes[0]",
        "[class id, count, offset, length, digest]",
    ),
    "a bad digest": (
        _set(_first_span, 4, "zz"),
        "splits.train.shards[0].classes[0][4]",
        "32 lowercase hex digits",
    ),
    "a bad sha256": (_set(_shard, "sha256", None), "splits.train.shards[0].sha256", "null"),
    "a huge shard": (_set(_shard, "bytes", 2**50), "splits.train.shards[0].bytes", "out of range"),
    "an unknown category": (
        lambda d: d["classes"][0].update(category=7),
        "classes[0].category",
        "category 7 does not exist",
    ),
    "ids out of order": (lambda d: d["classes"][0].update(id=1), "classes[0].id", "must have id 0"),
    "a shard listed twice": (
        lambda d: d["splits"]["train"]["shards"].append(_shard(d)),
        "splits.train.shards[",
        "listed twice",
    ),
    "a shard of another category": (
        _set(_shard, "category", 1),
        "splits.train.shards[0].classes[0][0]",
        "category null",
    ),
    "a relative shards_root": (_set(lambda d: d, "shards_root", "elsewhere"), "shards_root", "absolute"),
    "an unknown format": (_set(lambda d: d, "format", "tar"), "format", "not a ddp_rank-shards"),
    # A split name is the folder its shards are written to (``shards reshard``): one safe segment.
    "a split named ..": (
        lambda d: d["splits"].__setitem__("..", d["splits"].pop("train")),
        "splits...:",
        "split name '..' is not allowed: use letters, digits",
    ),
    "a split name with a slash": (
        lambda d: d["splits"].__setitem__("a/b", d["splits"].pop("train")),
        "splits.a/b:",
        "split name 'a/b' is not allowed",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_fault_is_refused_naming_the_file_and_the_field(shards: Path, case: str) -> None:
    change, field, problem = CASES[case]
    path = _mutate(shards, change)
    with pytest.raises(ManifestError) as raised:
        Manifest.load(shards)
    message = str(raised.value)
    assert message.startswith(f"{path}: "), message
    assert field in message and problem in message, message
    assert "\n" not in message


def test_overlapping_spans_are_refused(shards: Path) -> None:
    def overlap(data: dict[str, Any]) -> None:
        spans = _shard(data)["classes"]
        assert len(spans) >= 2, "the fixture puts two classes in a shard"
        spans[1][2] = spans[0][2] + 512

    _mutate(shards, overlap)
    with pytest.raises(ManifestError, match=r"classes\[1\]\[2\]: the span overlaps"):
        Manifest.load(shards)


def test_a_class_in_several_spans_is_accepted_and_summed(shards: Path) -> None:
    """The layout of other tools' shards: one class as two spans (here: two halves of one span, as if another
    class's samples lay between them) adds up to the split's count."""

    def split_span(data: dict[str, Any]) -> None:
        spans = _shard(data)["classes"]
        cid, count, offset, length, digest = spans[0]
        sample = length // count
        spans[0] = [cid, 1, offset, sample, digest]
        spans.insert(1, [cid, count - 1, offset + sample, length - sample, digest])
        _shard(data)["category"] = None

    _mutate(shards, split_span)
    manifest = Manifest.load(shards)
    first = manifest.split("train").shards[0]
    assert [s.id for s in first.classes[:2]] == [first.classes[0].id] * 2
    assert first.category is None


def test_not_json_names_the_file(shards: Path) -> None:
    path = shards / "manifest.json"
    path.write_text("{\n")
    with pytest.raises(ManifestError, match=rf"^{path}: not JSON \(.* at line 2 column 1\)"):
        Manifest.load(shards)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ManifestError, match=rf"^{path}: not UTF-8"):
        Manifest.load(shards)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match=rf"^{path}: "):
        Manifest.load(shards)


@pytest.mark.parametrize(
    "path",
    [
        "../x.tar",
        "/etc/passwd",
        "a/../../x.tar",
        "a//b.tar",
        "./a.tar",
        "s3://b/x.tar",
        "C:\\x.tar",
        "a\x00b",
    ],
)
def test_unsafe_paths_are_named(path: str) -> None:
    assert shard_path_problem(path) is not None
    with pytest.raises(ManifestError, match="stay inside"):
        confined_join("/data/shards", path)
    with pytest.raises(ManifestError, match="stay inside"):
        confined_join("https://host/data", path)


@pytest.mark.parametrize("path", ["train/train-c0000-00000.tar", "part-0001.tar", "a b/c+d=e.tar"])
def test_safe_paths_join_inside_the_root(path: str) -> None:
    assert shard_path_problem(path) is None
    assert confined_join("/data/shards", path) == f"/data/shards/{path}"
    assert confined_join("https://host/data/", path) == f"https://host/data/{path}"



def test_a_manifest_built_in_code_cannot_read_outside_either(
    shards: Path, tmp_path: Path, opened: list[str]
) -> None:
    """Defence in depth: a ``Manifest`` made without the loader, whose shard path leaves the root, is refused
    where the reader resolves the path, and the read costs that class only (counted replacement upstream)."""
    outside = tmp_path / "outside.tar"
    outside.write_bytes(b"secret" * 100)
    del opened[:]  # (writing it was this test's own open)
    manifest = Manifest.load(shards)
    train = manifest.split("train")
    bad = replace(train.shards[0], path="../outside.tar")
    hostile = replace(manifest, splits={"train": replace(train, shards=(bad, *train.shards[1:]))})
    reader = ClassReader(hostile, "train")
    with pytest.raises(ClassReadError, match="stay inside"):
        reader.read(bad.classes[0].id)
    assert reader.read(train.shards[1].classes[0].id)  # the other shards still read
    assert not [p for p in opened if "outside" in p]


@pytest.mark.parametrize("command", ["plan", "info", "verify", "train", "eval"])
def test_commands_refuse_a_hostile_manifest_in_one_line(
    shards: Path, command: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _mutate(shards, _set(_shard, "path", "../../../etc/hostname"))
    run = [
        f"data.shards={shards}",
        "model.backbone=tiny_cnn",
        "model.weights=none",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    argv = {
        "plan": ["plan", f"data.shards={shards}", "model.backbone=tiny_cnn", "data.global_batch_size=4"],
        "train": ["train", *run],
        "eval": ["eval", "--baseline", "raw-pixels", *run],
        "info": ["shards", "info", str(shards)],
        "verify": ["shards", "verify", str(shards)],
    }[command]
    code = main(argv)
    captured = capsys.readouterr()
    assert code != 0
    assert "ok: the run can start" not in captured.out
    assert f"{path}: splits.train.shards[0].path: '../../../etc/hostname'" in captured.err
    assert "Traceback" not in captured.err


def test_train_and_eval_refuse_it_before_any_process_starts(shards: Path) -> None:
    from ddp_rank.config import load_config
    from ddp_rank.runtime import TrainError, open_shards

    _mutate(shards, _set(_first_span, 3, 10**12))
    cfg = load_config(None, [f"data.shards={shards}"])
    with pytest.raises(TrainError, match=r"splits\.train\.shards\[0\]\.classes\[0\]\[3\]: 1,000,000,000,000"):
        open_shards(cfg.data.shards, cfg.model.backbone)


def test_a_shard_of_another_size_than_recorded_is_not_read(built: Path, tmp_path: Path) -> None:
    """The manifest's ``bytes`` bound every span (checked at load); the reader holds the file to them, so a
    truncated or swapped shard costs its classes before any span is read."""
    shards = tmp_path / "s"
    shutil.copytree(built, shards)
    manifest = Manifest.load(shards)
    shard = manifest.split("train").shards[0]
    path = shards / shard.path
    path.write_bytes(path.read_bytes()[: shard.bytes // 2])
    reader = ClassReader(manifest, "train")
    with pytest.raises(
        ClassReadError, match=rf"is {shard.bytes // 2:,} bytes, the manifest says {shard.bytes:,}"
    ):
        reader.read(shard.classes[-1].id)
    reader.close()


def test_the_format_has_a_json_schema(built: Path) -> None:
    """The checks of the file's shape are a pydantic model: its JSON schema documents the format, and a built
    manifest passes it."""
    from ddp_rank.data.format.manifest_check import MANIFEST_FILE

    schema = MANIFEST_FILE.json_schema()
    assert {"format", "version", "categories", "classes", "splits"} <= set(schema["required"])
    shard = schema["$defs"]["ShardEntry"]["properties"]
    assert shard["sha256"]["pattern"] == "^[0-9a-f]{64}$" and shard["bytes"]["maximum"] == 1 << 40
    MANIFEST_FILE.validate_python(json.loads((built / "manifest.json").read_text()))
