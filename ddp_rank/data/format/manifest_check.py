"""Parse, don't trust: ``manifest.json`` becomes a typed ``Manifest`` here, and only here, every field checked.

Every reader of a shard set (``plan``, ``train``, ``eval``, ``shards verify`` / ``info``, the stream) loads its
manifest through ``Manifest.load`` / ``Manifest.from_json``, which call :func:`parse_manifest`. A manifest is
refused with a ``ManifestError`` of one line: the file, the field as a JSON path
(``splits.train.shards[3].classes[0][3]``), what is wrong and how to fix it. Checked:

- types: objects, lists, strings and integers where the format has them (``true`` is not a number, ``1e12``
  not an integer);
- ids that agree: class ``i`` of ``classes`` has id ``i``, each class's category and each span's class exist,
  a split lists each class once, and the split's count of a class is the sum of the counts of its spans (a class
  may be several spans, in one shard or several: shards made by other tools), a shard's ``samples`` the sum of
  its spans' counts, a shard's category (null when its classes mix categories) that of each of its classes;
- ranges: offsets >= 0, each span inside its shard's bytes and apart from the other spans of the shard, at
  least a tar header (512 bytes) per sample, a span at most ``MAX_SPAN_BYTES`` (a span is read into memory in
  one piece: a forged length of 1e12 must not become a 1 TB allocation), a shard at most ``MAX_SHARD_BYTES``;
- digests of the right length and alphabet;
- shard paths that stay inside the shard root (``manifest_parts.shard_path_problem``: relative, no ``..``, no scheme,
  host or drive); ``Manifest.shard_url`` checks again where a path is resolved for reading.

``build`` stays free-form (each tool records what it likes there); unknown keys are ignored, so a newer writer's
additions do not break an older reader.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from typing import Any, NamedTuple, NoReturn

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

__all__ = ["MAX_SHARD_BYTES", "MAX_SPAN_BYTES", "ManifestFields", "parse_manifest"]

TAR_BLOCK = 512
"""Every tar member starts with a header of this size, so a sample takes at least this many bytes."""
MAX_SPAN_BYTES = 1 << 32
"""Largest byte span a manifest may give a class (4 GiB: thousands of full-size images); a reader holds a span
in memory while it checks its digest."""
MAX_SHARD_BYTES = 1 << 40
"""Largest shard a manifest may describe (1 TiB)."""
_MISSING = object()
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SPAN_DIGEST = re.compile(r"[0-9a-f]{32}")
_REBUILD = (
    "rebuild the manifest with `ddp-rank shards build` (or `ddp-rank shards index` for other tools' shards)"
)
_PATH_FIX = (
    "a shard path is relative to the manifest's folder (or its shards_root) and stays inside it: move the "
    "shard there and record its relative path"
)


class _Checker:
    """Typed reads of a parsed JSON value that fail with the file and the JSON path of the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str, fix: str = _REBUILD) -> NoReturn:
        raise ManifestError(f"{self.source}: {where}: {problem}; {fix}")

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"{_kind(value)} where a JSON object is expected")
        return value

    def array(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(where, f"{_kind(value)} where a JSON list is expected")
        return value

    def key(self, obj: dict[str, Any], name: str, where: str) -> Any:
        if name not in obj:
            self.fail(_join(where, name), "missing")
        return obj[name]

    def text(self, value: Any, where: str, pattern: re.Pattern[str] | None = None) -> str:
        if not isinstance(value, str):
            self.fail(where, f"{_kind(value)} where a string is expected")
        if pattern is not None and not pattern.fullmatch(value):
            size = pattern.pattern.rsplit("{", 1)[-1].rstrip("}")
            self.fail(where, f"{value[:80]!r} is not a digest ({size} lowercase hex digits)")
        return value

    def integer(self, value: Any, where: str, minimum: int = 0, maximum: int | None = None) -> int:
        if type(value) is not int:  # bool is an int subclass: ``true`` is not a count
            self.fail(where, f"{_kind(value)} where an integer is expected")
        if value < minimum or (maximum is not None and value > maximum):
            upper = "" if maximum is None else f" and at most {maximum:,}"
            self.fail(where, f"{value:,} is out of range (at least {minimum:,}{upper})")
        return value

    def optional_id(self, value: Any, where: str, count: int, what: str) -> int | None:
        if value is None:
            return None
        if type(value) is not int:
            self.fail(where, f"{_kind(value)} where a {what} id (or null) is expected")
        if not 0 <= value < count:
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


def parse_manifest(data: Any, root: str | None = None) -> ManifestFields:
    """The checked fields of ``data`` (the parsed JSON of ``<root>/manifest.json``), or ``ManifestError``."""
    check = _Checker(join_location(root, MANIFEST_NAME) if root else MANIFEST_NAME)
    top = (
        data
        if isinstance(data, dict)
        else check.fail("(top level)", f"{_kind(data)} where a manifest object is expected")
    )
    fmt, version = top.get("format"), top.get("version")
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
    categories = _categories(check, check.key(top, "categories", ""))
    classes = _classes(check, check.key(top, "classes", ""), len(categories))
    raw_splits = check.obj(check.key(top, "splits", ""), "splits")
    if not raw_splits:
        check.fail("splits", "empty: the manifest has no split")
    splits = {name: _split(check, name, raw, classes, len(categories)) for name, raw in raw_splits.items()}
    build = check.obj(top.get("build", {}), "build")
    shards_root = top.get("shards_root")
    if shards_root is not None:
        _check_shards_root(check, shards_root)
    return ManifestFields(
        categories=categories, classes=classes, splits=splits, build=dict(build), shards_root=shards_root
    )


def _categories(check: _Checker, raw: Any) -> tuple[str, ...]:
    names = tuple(check.text(v, f"categories[{i}]") for i, v in enumerate(check.array(raw, "categories")))
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            check.fail(f"categories[{i}]", f"{name[:80]!r} is listed twice (also categories[{seen[name]}])")
        seen[name] = i
    return names


def _classes(check: _Checker, raw: Any, n_categories: int) -> tuple[ClassInfo, ...]:
    out = []
    for i, c in enumerate(check.array(raw, "classes")):
        # The common case in one expression (manifests of 200,000 classes); any doubt goes to the field checks.
        category = c.get("category", _MISSING) if type(c) is dict else _MISSING
        if (
            type(c) is dict
            and type(c.get("id")) is int
            and c["id"] == i
            and type(c.get("name")) is str
            and (category is None or (type(category) is int and 0 <= category < n_categories))
        ):
            out.append(ClassInfo(i, c["name"], category))
        else:
            out.append(_class(check, i, c, n_categories))
    return tuple(out)


def _class(check: _Checker, i: int, raw: Any, n_categories: int) -> ClassInfo:
    where = f"classes[{i}]"
    c = check.obj(raw, where)
    class_id = check.integer(check.key(c, "id", where), f"{where}.id")
    if class_id != i:
        check.fail(f"{where}.id", f"{class_id} where the class at position {i} must have id {i}")
    name = check.text(check.key(c, "name", where), f"{where}.name")
    category = check.optional_id(
        check.key(c, "category", where), f"{where}.category", n_categories, "category"
    )
    return ClassInfo(class_id, name, category)


def _split(
    check: _Checker, name: str, raw: Any, classes: tuple[ClassInfo, ...], n_categories: int
) -> SplitInfo:
    where = f"splits.{name}"
    if not name:
        check.fail(where, "a split with an empty name")
    if problem := split_name_problem(name):
        check.fail(where, problem)
    split = check.obj(raw, where)
    counts: dict[int, int] = {}
    positions: dict[int, int] = {}
    for i, entry in enumerate(check.array(check.key(split, "classes", where), f"{where}.classes")):
        cid, count = (entry.get("id"), entry.get("count")) if type(entry) is dict else (None, None)
        if (
            type(cid) is int
            and 0 <= cid < len(classes)
            and cid not in counts
            and type(count) is int
            and count >= 1
        ):
            counts[cid], positions[cid] = count, i  # the common case; any doubt goes to the field checks
            continue
        at = f"{where}.classes[{i}]"
        c = check.obj(entry, at)
        cid = check.optional_id(check.key(c, "id", at), f"{at}.id", len(classes), "class")
        if cid is None:
            check.fail(f"{at}.id", "null where a class id is expected")
        if cid in counts:
            check.fail(f"{at}.id", f"class {cid} is listed twice (also {where}.classes[{positions[cid]}])")
        counts[cid] = check.integer(check.key(c, "count", at), f"{at}.count", minimum=1)
        positions[cid] = i
    raw_shards = check.array(check.key(split, "shards", where), f"{where}.shards")
    shards = tuple(
        _shard(check, f"{where}.shards[{i}]", s, classes, n_categories) for i, s in enumerate(raw_shards)
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
    check: _Checker, where: str, raw: Any, classes: tuple[ClassInfo, ...], n_categories: int
) -> ShardInfo:
    s = check.obj(raw, where)
    path = check.text(check.key(s, "path", where), f"{where}.path")
    problem = shard_path_problem(path)
    if problem is not None:
        check.fail(f"{where}.path", f"{path[:120]!r} {problem}", _PATH_FIX)
    category = check.optional_id(
        check.key(s, "category", where), f"{where}.category", n_categories, "category"
    )
    size = check.integer(check.key(s, "bytes", where), f"{where}.bytes", maximum=MAX_SHARD_BYTES)
    samples = check.integer(check.key(s, "samples", where), f"{where}.samples", maximum=size // TAR_BLOCK)
    sha256 = check.text(check.key(s, "sha256", where), f"{where}.sha256", _SHA256)
    spans = tuple(
        _span(check, where, j, row, len(classes), size)
        for j, row in enumerate(check.array(check.key(s, "classes", where), f"{where}.classes"))
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
    return ShardInfo(path=path, category=category, classes=spans, samples=samples, bytes=size, sha256=sha256)


def _span(check: _Checker, shard: str, j: int, raw: Any, n_classes: int, shard_bytes: int) -> ClassSpan:
    """Span row ``j`` of the shard at JSON path ``shard``."""
    if type(raw) is list and len(raw) == 5:  # the common case in one expression; any doubt: the field checks
        class_id, count, offset, length, digest = raw
        if (
            type(class_id) is int
            and type(count) is int
            and type(offset) is int
            and type(length) is int
            and type(digest) is str
            and 0 <= class_id < n_classes
            and offset >= 0
            and TAR_BLOCK <= length <= MAX_SPAN_BYTES
            and offset + length <= shard_bytes
            and 1 <= count <= length // TAR_BLOCK
            and _SPAN_DIGEST.fullmatch(digest)
        ):
            return ClassSpan(class_id, count, offset, length, digest)
    where = f"{shard}.classes[{j}]"
    row = check.array(raw, where)
    if len(row) != 5:
        check.fail(where, f"{len(row)} values where a span row is [class id, count, offset, length, digest]")
    class_id = check.optional_id(row[0], f"{where}[0]", n_classes, "class")
    if class_id is None:
        check.fail(f"{where}[0]", "null where a class id is expected")
    count = check.integer(row[1], f"{where}[1]", minimum=1)
    offset = check.integer(row[2], f"{where}[2]", maximum=max(0, shard_bytes - TAR_BLOCK))
    length = check.integer(
        row[3], f"{where}[3]", minimum=TAR_BLOCK, maximum=min(MAX_SPAN_BYTES, shard_bytes - offset)
    )
    if count > length // TAR_BLOCK:
        check.fail(
            f"{where}[1]", f"{count:,} samples cannot fit in {length:,} bytes (a tar header is {TAR_BLOCK})"
        )
    digest = check.text(row[4], f"{where}[4]", _SPAN_DIGEST)
    return ClassSpan(class_id, count, offset, length, digest)


def _check_shards_root(check: _Checker, value: Any) -> None:
    """``shards_root`` is the manifest writer's choice of where the shards are (``shards index URL --out``):
    an absolute local path or a URL with a host, without ``..``."""
    text = check.text(value, "shards_root")
    scheme, sep, rest = text.partition("://")
    absolute = text.startswith("/") or (sep and scheme.isidentifier() and rest and not rest.startswith("/"))
    if sep and scheme == "file":
        absolute = rest.startswith("/")
    if not absolute or any(ord(c) < 32 for c in text) or ".." in text.split("/"):
        check.fail(
            "shards_root",
            f"{text[:120]!r} is not an absolute directory or a URL with a host",
            "set it to where the shards are (`ddp-rank shards index URL --out DIR` records it)",
        )


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


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
    return "a JSON list" if isinstance(value, list) else "a JSON object"
