"""Cross-rank agreement on what each rank met outside the collectives: failures and counters.

A rank that fails before a collective (its data could not be read, say) would leave the others blocked in the
next one until the process-group timeout. ``raise_if_any_failed`` is a collective every rank calls at the same
point: one flag all-reduce when all is well, and when some rank failed, every rank raises ``RankFailure`` with
that rank's message. ``agree`` carries a second flag the same way: a request to stop (a signal one rank
received), which every rank then sees at the same step. ``gather_counts`` sums per-rank counters and merges name lists for the logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddp_rank.distributed.process_group import ProcessGroup, collective_device, is_distributed


class RankFailure(RuntimeError):
    """Some rank failed at an agreement point; the message is the first failing rank's."""


def raise_if_any_failed(error: str | None, group: ProcessGroup | None = None) -> None:
    """Collective: raise ``RankFailure`` on every rank if ``error`` is set on any rank (None: this rank is fine)."""
    agree(error, group=group)


def agree(error: str | None, stop: bool = False, group: ProcessGroup | None = None) -> bool:
    """Collective: raise ``RankFailure`` on every rank if ``error`` is set on any rank; otherwise return whether
    any rank asked to ``stop`` (a signal, say), so that every rank stops at the same point. One all-reduce of
    two flags when all is well."""
    if not is_distributed(group):
        if error is not None:
            raise RankFailure(error)
        return stop
    flags = torch.tensor(
        [0 if error is None else 1, int(stop)], dtype=torch.int64, device=collective_device(group)
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0].item()) == 0:
        return bool(flags[1].item())
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, error, group=group)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    first_rank, first = failed[0]
    others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise RankFailure(f"rank {first_rank}{others}: {first}")


def gather_counts(counts: Mapping[str, Any], group: ProcessGroup | None = None) -> dict[str, Any]:
    """Collective: integers summed over ranks, lists merged (sorted, unique), from every rank's ``counts``."""
    if is_distributed(group):
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, dict(counts), group=group)
    else:
        gathered = [dict(counts)]
    merged: dict[str, Any] = {}
    for one in gathered:
        for key, value in one.items():
            if isinstance(value, list | tuple | set):
                merged[key] = sorted(set(merged.get(key, [])) | set(value))
            else:
                merged[key] = merged.get(key, 0) + value
    return merged
