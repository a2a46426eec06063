"""How many requests a split's classes cost: spans per class, the size of a span, and requests per step.

A class is one byte span in ddp_rank's own layout and several in shards made by other tools and indexed in place
(shuffled samples: about one span per image). Each span is one read: a seek on a local disk, one HTTP / S3 / GCS
request from a URL. A remote request costs a round trip before its first byte (tens of milliseconds on object
storage) and then streams at some tens of MB/s, so a request much smaller than the bytes that stream in one round
trip is paid for in latency, not in transfer: reads are then bound by how many requests per second the storage and
the client sustain, not by bandwidth. ``REQUEST_BOUND_BYTES`` (1 MiB: 25 ms at 40 MB/s) is where the two costs
meet. ``ddp-rank shards info`` and ``ddp-rank plan`` report these figures from the manifest alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.format.manifest_parts import is_url

REQUEST_BOUND_BYTES = 1 << 20
"""Mean span size under which reads from a URL are bound by requests, not bandwidth (module docstring)."""


@dataclass(frozen=True)
class Fragmentation:
    """The spans of one split's classes."""

    split: str
    classes: int
    spans: int
    max_spans: int
    """Spans of the most fragmented class."""
    span_bytes: int
    """Bytes of all spans together."""
    spans_of: Mapping[int, int]
    """Class id -> its number of spans."""

    @property
    def spans_per_class(self) -> float:
        return self.spans / max(1, self.classes)

    @property
    def mean_span_bytes(self) -> float:
        return self.span_bytes / max(1, self.spans)

    @property
    def request_bound(self) -> bool:
        """Whether reads from a URL would be bound by requests (mean span under ``REQUEST_BOUND_BYTES``)."""
        return self.spans > 0 and self.mean_span_bytes < REQUEST_BOUND_BYTES

    def requests(self, class_ids: Iterable[int]) -> int:
        """Reads that loading these classes takes (one per span, a class listed twice read twice)."""
        return sum(self.spans_of.get(cid, 0) for cid in class_ids)

    def summary(self) -> str:
        """``S spans for C classes (x per class, at most m), mean span K KiB``."""
        return (
            f"{self.spans:,} spans for {self.classes:,} classes ({self.spans_per_class:.1f} per class, at most "
            f"{self.max_spans:,}), mean span {self.mean_span_bytes / 1024:.1f} KiB"
        )

    def bound(self) -> str:
        """Which of requests or bandwidth would bound reads from a URL, in words."""
        if self.request_bound:
            return "request-bound"
        return f"bandwidth-bound (mean span >= {REQUEST_BOUND_BYTES / 2**20:g} MiB)"

    def advice(self, shards: str = "DIR") -> str | None:
        """What to do when reads of ``shards`` from a URL would be request-bound, or None when there is nothing to
        do. A local folder gets no URL advice (a span there is a seek, not a round trip); only its classes cut into
        several spans get the ``reshard`` hint, as each span is still a read of its own."""
        if not self.request_bound:
            return None
        if not is_url(shards):
            if self.spans <= self.classes:
                return None
            return (
                f"classes lie in {self.spans_per_class:.1f} spans each on average, one read per span: "
                f"`ddp-rank shards reshard {shards} OUT` makes every class one read (most useful before serving "
                "the shards from a URL)"
            )
        why = (
            f"read from a URL, split {self.split!r} would be request-bound (spans under "
            f"{REQUEST_BOUND_BYTES / 2**20:g} MiB cost more in round trips than in transfer)"
        )
        cache = "set data.cache_dir=DIR (each shard is then fetched whole, once per node)"
        if self.spans > self.classes:
            return f"{why}: {cache}, or make every class one span with `ddp-rank shards reshard {shards} OUT`"
        return f"{why}: {cache}"


def fragmentation(manifest: Manifest, split: str) -> Fragmentation:
    """The fragmentation of ``split``, from the manifest alone."""
    spans_of: dict[int, int] = {}
    span_bytes = 0
    for shard in manifest.split(split).shards:
        for span in shard.classes:
            spans_of[span.id] = spans_of.get(span.id, 0) + 1
            span_bytes += span.length
    return Fragmentation(
        split=split,
        classes=len(spans_of),
        spans=sum(spans_of.values()),
        max_spans=max(spans_of.values(), default=0),
        span_bytes=span_bytes,
        spans_of=spans_of,
    )
