"""Parse, don't trust: ``manifest.json`` becomes a typed ``Manifest`` here, and only here, every field checked.

Every reader of a shard set (``plan``, ``train``, ``eval``, ``shards verify`` / ``info``, the stream) loads its
manifest through ``Manifest.load`` / ``Manifest.from_json``, which call :func:`parse_manifest`. A manifest is
refused with a ``ManifestError`` of one line: the file, the field as a JSON path
(``splits.train.shards[3].classes[0][3]``), what is wrong and how to fix it. Two passes:

1. the file's shape, a pydantic model of typed dicts (:data:`MANIFEST_FILE`, whose JSON schema documents the
   format): objects, lists, strings and integers where the format has them, strictly (``true`` is not a number,
   ``1e12`` not an integer); bounds that need no other field (offsets >= 0, a span at least a tar header and
   at most ``MAX_SPAN_BYTES``: a span is read into memory in one piece, so a forged length of 1e12 must not
   become a 1 TB allocation; a shard at most ``MAX_SHARD_BYTES``); digests of the right length and alphabet;
   shard paths that stay inside the shard root (``manifest_parts.shard_path_problem``: relative, no ``..``, no
   scheme, host or drive; ``Manifest.shard_url`` checks again where a path is resolved for reading);
2. what ties fields together, in Python on the validated values: class ``i`` of ``classes`` has id ``i``, each
   class's category and each span's class exist, a split lists each class once and its count of a class is the
   sum of the counts of its spans (a class may be several spans, in one shard or several: shards made by other
   tools), a shard's ``samples`` the sum of its spans' counts, a shard's category (null when its classes mix
   categories) that of each of its classes, each span inside its shard's bytes and apart from the other spans,
   at least a tar header (512 bytes) per sample.

``build`` stays free-form (each tool records what it likes there); unknown keys are ignored, so a newer writer's
additions do not break an older reader.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Annotated, Any, NamedTuple, NoReturn

from pydantic import AfterValidator, Field, Strict, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, TypedDict

from ddp_rank.data.format.manifest_parts import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ClassInfo,
    ClassSpan,
    ManifestError,
    ShardInfo,
    SplitInfo,
    join_location,
    shard_path_problem,
    split_name_problem,
)

__all__ = ["MANIFEST_FILE", "MAX_SHARD_BYTES", "MAX_SPAN_BYTES", "ManifestFields", "parse_manifest"]

TAR_BLOCK = 512
"""Every tar member starts with a header of this size, so a sample takes at least this many bytes."""
MAX_SPAN_BYTES = 1 << 32
"""Largest byte span a manifest may give a class (4 GiB: thousands of full-size images); a reader holds a span
in memory while it checks its digest."""
MAX_SHARD_BYTES = 1 << 40
"""Largest shard a manifest may describe (1 TiB)."""
_REBUILD = (
    "rebuild the manifest with `ddp-rank shards build` (or `ddp-rank shards index` for other tools' shards)"
)
_PATH_FIX = (
    "a shard path is relative to the manifest's folder (or its shards_root) and stays inside it: move the "
    "shard there and record its relative path"
)
_ROOT_FIX = "set it to where the shards are (`ddp-rank shards index URL --out DIR` records it)"


def _safe_path(path: str) -> str:
    problem = shard_path_problem(path)
    if problem is not None:
        raise PydanticCustomError(
            "manifest", "{text} {problem}", {"text": repr(path[:120]), "problem": problem}
        )
    return path


def _absolute_root(text: str) -> str:
    """``shards_root`` is the manifest writer's choice of where the shards are (``shards index URL --out``):
    an absolute local path or a URL with a host, without ``..``."""
    scheme, sep, rest = text.partition("://")
    absolute = text.startswith("/") or (sep and scheme.isidentifier() and rest and not rest.startswith("/"))
    if sep and scheme == "file":
        absolute = rest.startswith("/")
    if not absolute or any(ord(c) < 32 for c in text) or ".." in text.split("/"):
        raise PydanticCustomError(
            "manifest",
            "{text} is not an absolute directory or a URL with a host",
            {"text": repr(text[:120]), "fix": _ROOT_FIX},
        )
    return text


def _reason(text: str) -> str:
    """``shared_classes`` says why the splits share classes: a blank one says nothing."""
    if not text.strip():
        raise PydanticCustomError(
            "manifest",
            "is blank",
            {
                "fix": "write why the splits share classes there (`--shared-classes REASON`), or remove the key"
            },
        )
    return text


Integer = Annotated[int, Strict()]
Count = Annotated[int, Strict(), Field(ge=0)]
Text = Annotated[str, Strict()]
Id = Annotated[int | None, Strict()]
"""A category's id, or null (unlabelled; a shard whose classes mix categories); its range is checked in pass 2."""


class ClassEntry(TypedDict):
    """``classes[i]``: class ``i`` of the whole set."""

    id: Count
    name: Text
    category: Id


class SplitClass(TypedDict):
    """``splits.<name>.classes[j]``: a class of the split and its image count there."""

    id: Integer
    count: Annotated[int, Strict(), Field(ge=1)]


SpanRow = tuple[
    Integer,
    Annotated[int, Strict(), Field(ge=1)],
    Count,
    Annotated[int, Strict(), Field(ge=TAR_BLOCK, le=MAX_SPAN_BYTES)],
    Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{32}$")],
]
"""``[class id, count, offset, length, digest]``: a class's byte range in its shard (a compact row: manifests of
200,000 classes)."""


class ShardEntry(TypedDict):
    """``splits.<name>.shards[k]``: one tar shard and the spans of its classes, in the order they are stored."""

    path: Annotated[str, Strict(), AfterValidator(_safe_path)]
    category: Id
    bytes: Annotated[int, Strict(), Field(ge=0, le=MAX_SHARD_BYTES)]
    samples: Count
    sha256: Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{64}$")]
    classes: list[SpanRow]


class SplitEntry(TypedDict):
    classes: list[SplitClass]
    shards: list[ShardEntry]


class ManifestFile(TypedDict):
    """``manifest.json`` of format ``ddp_rank-shards`` version 2 (its ``format`` and ``version`` are checked
    first, apart: a v1 manifest gets the command that upgrades it)."""

    format: Text
    version: Integer
    categories: list[Text]
    classes: list[ClassEntry]
    splits: dict[str, SplitEntry]
    build: NotRequired[dict[str, Any]]
    shards_root: NotRequired[Annotated[str, Strict(), AfterValidator(_absolute_root)]]
    shared_classes: NotRequired[Annotated[str, Strict(), AfterValidator(_reason)]]
    """Why the splits may share classes (``--shared-classes REASON``, ``class_leaks``); absent: they may not."""


MANIFEST_FILE: TypeAdapter[ManifestFile] = TypeAdapter(ManifestFile)
"""The validator of the file's shape (``MANIFEST_FILE.json_schema()``: the format for the documentation)."""

_EXPECTED = {"int": "an integer", "string": "a string", "dict": "a JSON object", "list": "a JSON list"}
_EXPECTED.update(tuple="a JSON list", model="a JSON object")


class _Checker:
    """The failures of pass 2, with the file and the JSON path of the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str, fix: str = _REBUILD) -> NoReturn:
        raise ManifestError(f"{self.source}: {where}: {problem}; {fix}")

    def shape(self, exc: ValidationError) -> NoReturn:
        """Pass 1's first error as one line."""
        error = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
        kind, value, ctx = error["type"], error["input"], error.get("ctx") or {}
        if kind == "missing" and isinstance(error["loc"][-1], int):  # a span row of fewer than 5 values
            kind, where = "too_short", where.rsplit("[", 1)[0]
        if kind == "missing":
            self.fail(where, "missing")
        if kind == "manifest":
            self.fail(where, error["msg"], ctx.get("fix", _PATH_FIX))
        if kind in ("too_short", "too_long") and isinstance(value, list) and ".classes[" in where:
            self.fail(
                where, f"{len(value)} values where a span row is [class id, count, offset, length, digest]"
            )
        if kind == "string_pattern_mismatch":
            size = str(ctx["pattern"]).rsplit("{", 1)[-1].split("}")[0]
            self.fail(where, f"{value[:80]!r} is not a digest ({size} lowercase hex digits)")
        if kind in ("greater_than_equal", "less_than_equal"):
            bound = "at least" if kind == "greater_than_equal" else "at most"
            self.fail(where, f"{value:,} is out of range ({bound} {next(iter(ctx.values())):,})")
        expected = _EXPECTED.get(kind.split("_")[0])
        if where.endswith(".category"):
            expected = "a category id (or null)"
        elif (where.endswith("].id") and where.startswith("splits.")) or where.endswith("][0]"):
            expected = "a class id"
        if expected is not None and kind.endswith("_type"):
            self.fail(where, f"{_kind(value)} where {expected} is expected")
        self.fail(where, f"{_kind(value)}: {error['msg']}")

    def optional_id(self, value: int | None, where: str, count: int, what: str) -> int | None:
        if value is not None and not 0 <= value < count:
            self.fail(where, f"{what} {value} does not exist (the manifest has {count:,} {what}s)")
        return value


class ManifestFields(NamedTuple):
    """A manifest's checked contents: ``Manifest.from_json`` makes the ``Manifest`` of them (this module does
    not import ``Manifest``, whose loading calls it)."""

    categories: tuple[str, ...]
    classes: tuple[ClassInfo, ...]
    splits: dict[str, SplitInfo]
    build: dict[str, Any]
    shards_root: str | None
    shared_classes: str | None


def parse_manifest(data: Any, root: str | None = None) -> ManifestFields:
    """The checked fields of ``data`` (the parsed JSON of ``<root>/manifest.json``), or ``ManifestError``."""
    check = _Checker(join_location(root, MANIFEST_NAME) if root else MANIFEST_NAME)
    if not isinstance(data, dict):
        check.fail("(top level)", f"{_kind(data)} where a manifest object is expected")
    fmt, version = data.get("format"), data.get("version")
    if fmt == FORMAT_NAME and version == 1:
        check.fail(
            "version",
            "a v1 manifest, without the byte range of each class that the stream reads by",
            f"add them in place (the tars are not rewritten) with `ddp-rank shards index {root} --upgrade`",
        )
    if fmt != FORMAT_NAME or version != FORMAT_VERSION:
        check.fail(
            "format",
            f"not a {FORMAT_NAME} v{FORMAT_VERSION} manifest (format={str(fmt)[:40]!r}, version={str(version)[:20]!r})",
            "rebuild the shards with `ddp-rank shards build`",
        )
    try:
        top = MANIFEST_FILE.validate_python(data)
    except ValidationError as exc:
        check.shape(exc)
    categories = _categories(check, top["categories"])
    classes = _classes(check, top["classes"], len(categories))
    if not top["splits"]:
        check.fail("splits", "empty: the manifest has no split")
    splits = {name: _split(check, name, raw, classes, len(categories)) for name, raw in top["splits"].items()}
    return ManifestFields(
        categories=categories,
        classes=classes,
        splits=splits,
        build=dict(top.get("build", {})),
        shards_root=top.get("shards_root"),
        shared_classes=top.get("shared_classes"),
    )


def _categories(check: _Checker, names: list[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            check.fail(f"categories[{i}]", f"{name[:80]!r} is listed twice (also categories[{seen[name]}])")
        seen[name] = i
    return tuple(names)


def _classes(check: _Checker, raw: list[ClassEntry], n_categories: int) -> tuple[ClassInfo, ...]:
    out = []
    for i, c in enumerate(raw):
        category = c["category"]
        if c["id"] != i:
            check.fail(f"classes[{i}].id", f"{c['id']} where the class at position {i} must have id {i}")
        if category is not None and not 0 <= category < n_categories:
            check.optional_id(category, f"classes[{i}].category", n_categories, "category")
        out.append(ClassInfo(i, c["name"], category))
    return tuple(out)


def _split(
    check: _Checker, name: str, raw: SplitEntry, classes: tuple[ClassInfo, ...], n_categories: int
) -> SplitInfo:
    where = f"splits.{name}"
    if not name:
        check.fail(where, "a split with an empty name")
    if problem := split_name_problem(name):
        check.fail(where, problem)
    counts: dict[int, int] = {}
    positions: dict[int, int] = {}
    for i, entry in enumerate(raw["classes"]):
        cid = entry["id"]
        check.optional_id(cid, f"{where}.classes[{i}].id", len(classes), "class")
        if cid in counts:
            check.fail(
                f"{where}.classes[{i}].id",
                f"class {cid} is listed twice (also {where}.classes[{positions[cid]}])",
            )
        counts[cid], positions[cid] = entry["count"], i
    shards = tuple(
        _shard(check, f"{where}.shards[{i}]", s, classes, n_categories) for i, s in enumerate(raw["shards"])
    )
    paths: dict[str, int] = {}
    held: dict[int, int] = defaultdict(int)
    first_span: dict[int, tuple[int, int]] = {}
    for i, shard in enumerate(shards):
        if shard.path in paths:
            check.fail(
                f"{where}.shards[{i}].path",
                f"{shard.path!r} is listed twice (also shards[{paths[shard.path]}])",
            )
        paths[shard.path] = i
        for j, span in enumerate(shard.classes):
            held[span.id] += span.count
            first_span.setdefault(span.id, (i, j))
    for cid, (i, j) in first_span.items():
        if cid not in counts:
            check.fail(
                f"{where}.shards[{i}].classes[{j}][0]", f"class {cid} is not listed in {where}.classes"
            )
    for cid, n in counts.items():
        if held.get(cid, 0) != n:
            check.fail(
                f"{where}.classes[{positions[cid]}].count",
                f"{n:,} images of class {cid}, but the split's shards hold {held.get(cid, 0):,}",
            )
    return SplitInfo(name=name, class_counts=counts, shards=shards)


def _shard(
    check: _Checker, where: str, s: ShardEntry, classes: tuple[ClassInfo, ...], n_categories: int
) -> ShardInfo:
    category = check.optional_id(s["category"], f"{where}.category", n_categories, "category")
    size, samples = s["bytes"], s["samples"]
    if samples > size // TAR_BLOCK:
        check.fail(f"{where}.samples", f"{samples:,} is out of range (at most {size // TAR_BLOCK:,})")
    spans = tuple(
        _span(check, f"{where}.classes[{j}]", row, len(classes), size) for j, row in enumerate(s["classes"])
    )
    by_offset = sorted(range(len(spans)), key=lambda j: spans[j].offset)
    for before, after in itertools.pairwise(by_offset):
        if spans[after].offset < spans[before].offset + spans[before].length:
            check.fail(f"{where}.classes[{after}][2]", f"the span overlaps {where}.classes[{before}]")
    if sum(span.count for span in spans) != samples:
        check.fail(
            f"{where}.samples", f"{samples:,}, but its spans hold {sum(x.count for x in spans):,} samples"
        )
    if category is not None:
        for j, span in enumerate(spans):
            if classes[span.id].category != category:
                check.fail(
                    f"{where}.classes[{j}][0]",
                    f"class {span.id} has category {classes[span.id].category}, the shard category {category} "
                    "(a shard whose classes mix categories has category null)",
                )
    return ShardInfo(
        path=s["path"], category=category, classes=spans, samples=samples, bytes=size, sha256=s["sha256"]
    )


def _span(check: _Checker, where: str, row: tuple[Any, ...], n_classes: int, shard_bytes: int) -> ClassSpan:
    """Span row ``where`` (types and static bounds already checked) against its shard and the class list."""
    class_id, count, offset, length, digest = row
    if 0 <= class_id < n_classes and offset + length <= shard_bytes and count <= length // TAR_BLOCK:
        return ClassSpan(class_id, count, offset, length, digest)  # the common case in one expression
    check.optional_id(class_id, f"{where}[0]", n_classes, "class")
    if offset > max(0, shard_bytes - TAR_BLOCK):
        check.fail(
            f"{where}[2]",
            f"{offset:,} is out of range (at least 0 and at most {max(0, shard_bytes - TAR_BLOCK):,})",
        )
    if offset + length > shard_bytes:
        most = min(MAX_SPAN_BYTES, shard_bytes - offset)
        check.fail(f"{where}[3]", f"{length:,} is out of range (at least {TAR_BLOCK:,} and at most {most:,})")
    check.fail(
        f"{where}[1]", f"{count:,} samples cannot fit in {length:,} bytes (a tar header is {TAR_BLOCK})"
    )


def _kind(value: Any) -> str:
    """``a JSON list``, ``the number 1e+12``: what a value is, for a message."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return f"the number {value!r}"[:60]
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return "a JSON list" if isinstance(value, list | tuple) else "a JSON object"
