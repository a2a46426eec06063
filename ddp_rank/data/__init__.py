"""The data layer: shard format, build and index, the global sampling plan, ranged reads, the stream, the eval reader.

Four parts: ``format`` (the manifest and the tar layout), ``building`` (making and checking shard sets),
``sampling`` (the global plan of each step and its dealing to the ranks) and ``reading`` (ranged reads, the
cache, decoding, the training stream, the evaluation reader). Feature shards are ``data.features``.

It knows nothing of losses or training. Public names are imported lazily, so the shard tools (and the worker
processes they start) do not pay for importing torch.
"""

from __future__ import annotations

from ddp_rank.lazy_exports import lazy_exports

_EXPORTS = {
    "Manifest": "ddp_rank.data.format.manifest",
    "BuildOptions": "ddp_rank.data.building.build",
    "build_shards": "ddp_rank.data.building.build",
    "Record": "ddp_rank.data.building.listing",
    "read_image_folder": "ddp_rank.data.building.listing",
    "read_csv_listing": "ddp_rank.data.building.listing",
    "verify_shards": "ddp_rank.data.building.verify",
    "format_info": "ddp_rank.data.format.info",
    "ScheduleConfig": "ddp_rank.data.sampling.schedule",
    "CategorySchedule": "ddp_rank.data.sampling.schedule",
    "Catalog": "ddp_rank.data.sampling.plan",
    "GlobalPlan": "ddp_rank.data.sampling.plan",
    "PlanError": "ddp_rank.data.sampling.plan",
    "deal": "ddp_rank.data.sampling.dealing",
    "ClassReader": "ddp_rank.data.reading.reader",
    "ShardStore": "ddp_rank.data.reading.storage",
    "index_shards": "ddp_rank.data.building.shard_index",
    "reshard": "ddp_rank.data.building.reshard",
    "ReshardOptions": "ddp_rank.data.building.reshard",
    "fragmentation": "ddp_rank.data.format.fragmentation",
    "DataError": "ddp_rank.data.reading.stream",
    "ShardStream": "ddp_rank.data.reading.stream",
    "StreamLoader": "ddp_rank.data.reading.loader",
    "EvalShards": "ddp_rank.data.reading.eval_reader",
    "EvalSplitBatch": "ddp_rank.data.reading.eval_reader",
    "TransformConfig": "ddp_rank.data.reading.transforms",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
