"""Reading whole classes: one ranged read per span of the class, checked against the manifest, then parsed.

A class is one or more byte spans (``ClassSpan``) of the split's shards: ONE in the project's own layout (a class
is contiguous in one shard), several in shards made by other tools and indexed in place (shuffled samples, a
class cut across tars, classes interleaved). ``ClassReader.read(class_id)`` reads every span of the class through
the ``ShardStore`` (one request per span; concurrently for spans read by range from a URL), checks each span's
digest and sample count, and returns the samples in manifest order: spans in the order the split lists its
shards and their spans, samples in stored order within a span. Any failure (missing shard, HTTP error, short
read, digest mismatch, corrupt tar) raises ``ClassReadError`` naming the shard and the reason; a shard that failed
as a whole (missing, unreachable) is remembered so its other classes fail fast without another request.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ddp_rank.data.format.manifest import ClassSpan, Manifest, ShardInfo, span_digest
from ddp_rank.data.format.tar_scan import SpanError, SpanSample, parse_span
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.data.reading.storage import ShardStore


class ClassReadError(Exception):
    """A class could not be read; ``shard`` names its shard (for the error and the counts)."""

    def __init__(self, class_id: int, shard: str, reason: str) -> None:
        super().__init__(f"class {class_id} in {shard}: {reason}")
        self.class_id = class_id
        self.shard = shard
        self.reason = reason


def group_failures(failures: Sequence[ClassReadError], named: int = 3, causes: int = 3) -> str:
    """The failures of several classes in one line: each cause (shard and reason) once, with how many classes it
    cost and the first ``named`` of them; at most ``causes`` causes, then how many more. A truncated shard fails
    every class it holds for the same reason: its message once, not once per class."""
    by_cause: dict[tuple[str, str], list[int]] = {}
    for failure in failures:
        by_cause.setdefault((failure.shard, failure.reason), []).append(failure.class_id)
    parts = []
    for (shard, reason), ids in list(by_cause.items())[:causes]:
        listed = ", ".join(str(i) for i in ids[:named]) + (
            f" and {len(ids) - named} more" if len(ids) > named else ""
        )
        parts.append(f"{shard}: {reason} ({len(ids)} class{'' if len(ids) == 1 else 'es'}: {listed})")
    if len(by_cause) > causes:
        parts.append(f"and {len(by_cause) - causes} more cause(s)")
    return "; ".join(parts)


def class_spans(manifest: Manifest, split: str) -> dict[int, list[tuple[ShardInfo, ClassSpan]]]:
    """Every class of a split -> its spans, in manifest order (shards as the split lists them, spans as each
    shard lists them); the classes in the order their first span appears."""
    where: dict[int, list[tuple[ShardInfo, ClassSpan]]] = {}
    for shard in manifest.split(split).shards:
        for span in shard.classes:
            where.setdefault(span.id, []).append((shard, span))
    return where


class ClassReader:
    """Whole-class reads for one split of a manifest."""

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        cache_dir: str | os.PathLike[str] | ShardCache | None = None,
    ) -> None:
        self.manifest = manifest
        self.store = ShardStore(manifest, cache_dir=cache_dir)
        self.where = class_spans(manifest, split)
        """Class id -> its (shard, span) pairs in manifest order."""
        self.dead_shards: dict[str, str] = {}
        """Shards that failed as a whole in this process: name -> reason."""

    def read(self, class_id: int) -> list[SpanSample]:
        spans = self.where[class_id]
        for shard, _ in spans:
            if shard.path in self.dead_shards:
                raise ClassReadError(class_id, shard.path, self.dead_shards[shard.path])
        results = self.store.read_many([(shard, span.offset, span.length) for shard, span in spans])
        samples: list[SpanSample] = []
        for (shard, span), result in zip(spans, results):
            samples.extend(self._check(class_id, shard, span, result))
        return samples

    def shard_of(self, class_id: int, index: int) -> str:
        """The shard holding sample ``index`` of the class (in ``read``'s order), for naming it in errors."""
        for shard, span in self.where[class_id]:
            if index < span.count:
                return shard.path
            index -= span.count
        return self.where[class_id][-1][0].path

    def close(self) -> None:
        self.store.close()

    def _check(
        self, class_id: int, shard: ShardInfo, span: ClassSpan, result: bytes | BaseException
    ) -> Sequence[SpanSample]:
        """One span's samples, or ``ClassReadError`` for what the read raised or a span that is not as listed."""
        if isinstance(result, FileNotFoundError):
            self.dead_shards[shard.path] = f"not found ({result})"
            raise ClassReadError(class_id, shard.path, self.dead_shards[shard.path]) from result
        if isinstance(result, BaseException):
            # Any other storage failure (HTTP status, network, short read) costs this class only.
            raise ClassReadError(class_id, shard.path, f"{type(result).__name__}: {result}") from result
        if span_digest(result) != span.digest:
            raise ClassReadError(
                class_id, shard.path, "bytes do not match the manifest's digest (corrupt shard)"
            )
        try:
            return parse_span(result, span.count)
        except SpanError as exc:
            raise ClassReadError(class_id, shard.path, str(exc)) from exc
