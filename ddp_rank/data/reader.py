"""Reading whole classes: one ranged read per class, checked against the manifest, then parsed.

``ClassReader.read(class_id)`` finds the class's shard and byte range in the manifest, reads it through the
``ShardStore`` (local or remote), checks the range's digest and sample count, and returns the samples in stored
order. Any failure (missing shard, HTTP error, short read, digest mismatch, corrupt tar) raises
``ClassReadError`` naming the shard and the reason; a shard that failed as a whole (missing, unreachable) is
remembered so its other classes fail fast without another request.
"""

from __future__ import annotations

import os

from ddp_rank.data.manifest import ClassSpan, Manifest, ShardInfo, span_digest
from ddp_rank.data.shard_cache import ShardCache
from ddp_rank.data.storage import ShardStore
from ddp_rank.data.tar_scan import SpanError, SpanSample, parse_span


class ClassReadError(Exception):
    """A class could not be read; ``shard`` names its shard (for the error and the counts)."""

    def __init__(self, class_id: int, shard: str, reason: str) -> None:
        super().__init__(f"class {class_id} in {shard}: {reason}")
        self.class_id = class_id
        self.shard = shard
        self.reason = reason


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
        self.where: dict[int, tuple[ShardInfo, ClassSpan]] = {
            span.id: (shard, span) for shard in manifest.split(split).shards for span in shard.classes
        }
        self.dead_shards: dict[str, str] = {}
        """Shards that failed as a whole in this process: name -> reason."""

    def read(self, class_id: int) -> list[SpanSample]:
        shard, span = self.where[class_id]
        if shard.path in self.dead_shards:
            raise ClassReadError(class_id, shard.path, self.dead_shards[shard.path])
        try:
            data = self.store.read(shard, span.offset, span.length)
        except FileNotFoundError as exc:
            self.dead_shards[shard.path] = f"not found ({exc})"
            raise ClassReadError(class_id, shard.path, self.dead_shards[shard.path]) from exc
        except Exception as exc:
            # Any other storage failure (HTTP status, network, short read) costs this class only.
            raise ClassReadError(class_id, shard.path, f"{type(exc).__name__}: {exc}") from exc
        if span_digest(data) != span.digest:
            raise ClassReadError(
                class_id, shard.path, "bytes do not match the manifest's digest (corrupt shard)"
            )
        try:
            return parse_span(data, span.count)
        except SpanError as exc:
            raise ClassReadError(class_id, shard.path, str(exc)) from exc

    def close(self) -> None:
        self.store.close()
