"""The data layer: shard format, build and index, the global sampling plan, ranged reads, the stream, the eval reader.

It knows nothing of losses or training. Public names are imported lazily, so the shard tools (and the worker
processes they start) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Manifest": "ddp_rank.data.manifest",
    "BuildOptions": "ddp_rank.data.build",
    "build_shards": "ddp_rank.data.build",
    "Record": "ddp_rank.data.listing",
    "read_image_folder": "ddp_rank.data.listing",
    "read_csv_listing": "ddp_rank.data.listing",
    "verify_shards": "ddp_rank.data.verify",
    "format_info": "ddp_rank.data.info",
    "ScheduleConfig": "ddp_rank.data.schedule",
    "CategorySchedule": "ddp_rank.data.schedule",
    "Catalog": "ddp_rank.data.plan",
    "GlobalPlan": "ddp_rank.data.plan",
    "PlanError": "ddp_rank.data.plan",
    "deal": "ddp_rank.data.dealing",
    "ClassReader": "ddp_rank.data.reader",
    "ShardStore": "ddp_rank.data.storage",
    "index_shards": "ddp_rank.data.shard_index",
    "reshard": "ddp_rank.data.reshard",
    "ReshardOptions": "ddp_rank.data.reshard",
    "fragmentation": "ddp_rank.data.fragmentation",
    "DataError": "ddp_rank.data.stream",
    "ShardStream": "ddp_rank.data.stream",
    "StreamLoader": "ddp_rank.data.loader",
    "EvalShards": "ddp_rank.data.eval_reader",
    "EvalSplitBatch": "ddp_rank.data.eval_reader",
    "TransformConfig": "ddp_rank.data.transforms",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddp_rank.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
