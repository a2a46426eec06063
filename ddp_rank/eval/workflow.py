"""The ``ddp-rank eval`` workflow as a library function (the CLI only parses arguments).

Results accumulate in one JSON file, ``{name: {metric: value}, ...}``, so several evaluations (raw pixels, the
untrained network, the trained one) can be written to the same file and printed as one table.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate.utils import gather_object

from ddp_rank.config import Config, ConfigError, to_dict
from ddp_rank.data.reading.shard_cache import open_cache
from ddp_rank.data.reading.transforms import transform_from_config
from ddp_rank.distributed import end_process_group
from ddp_rank.eval.bootstrap import QueryBootstrap
from ddp_rank.eval.curves import draw_curves, split_curves
from ddp_rank.eval.eval_model import RAW_PIXEL_SIZE, build_eval_model, feature_shards, images_in_front
from ddp_rank.eval.export import ExportError, embed_batches_to_arrays, write_manifest, write_part
from ddp_rank.eval.per_query import per_query_refusal, write_per_query
from ddp_rank.eval.protocols import VEHICLEID_SIZES
from ddp_rank.eval.report import bootstrap_note, deployment_lines, format_table, write_json
from ddp_rank.eval.retrieval_record import RetrievalPicture, eval_picture_file
from ddp_rank.eval.runner import evaluate_model, vehicleid_splits
from ddp_rank.eval.settings import evaluation_settings, load_run_config
from ddp_rank.eval.sources import folder_batches, split_batches, url_shard_batches
from ddp_rank.model import resolve_checkpoint
from ddp_rank.runtime import autocast_dtype, make_accelerator, open_shards
from ddp_rank.runtime.shards import check_split

log = logging.getLogger(__name__)

__all__ = [
    "RAW_PIXEL_SIZE",
    "Evaluation",
    "build_eval_model",
    "describe_export",
    "draw_curve_pictures",
    "evaluate_and_record",
    "export_embeddings",
    "load_run_config",
    "open_and_check_split",
    "results_table",
]


def open_and_check_split(cfg: Config, split: str | None) -> None:
    """The shards open (``split`` None) and hold ``split``; errors say how to fix it."""
    manifest = open_shards(cfg.data.shards, cfg.model.backbone)
    if split is not None:
        check_split(manifest, cfg.data.shards, split)


def _splits_to_evaluate(cfg: Config, split: str | None) -> tuple[str | None, str]:
    """(the split to pass to the evaluation or None for the default, a description for the output).

    VehicleID shards built by the recipe hold one split per test list (``test_small`` ...); with no ``--split``
    the evaluation takes every list in ``eval.vehicleid_sizes``, not only ``data.test_split``.
    """
    if split is None and cfg.eval.protocol == "vehicleid":
        per_size = vehicleid_splits(evaluation_settings(cfg))
        if per_size:
            return None, ", ".join(per_size[s] for s in VEHICLEID_SIZES if s in per_size)
    target = split or cfg.data.test_split
    if not target:
        raise ConfigError("no split to evaluate: pass --split or set data.test_split")
    open_and_check_split(cfg, target)
    return split, target


def results_table(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table of an accumulated results JSON (entries in insertion order)."""
    return format_table({name: r.get("metrics", r) for name, r in results.items()})


@dataclass(frozen=True)
class Evaluation:
    """One evaluation as ``ddp-rank eval`` reports it: the metrics, the row name, what was evaluated, the
    results JSON it was added to (``written``: by this process, rank 0) and the curve pictures drawn beside it."""

    metrics: dict[str, Any]
    label: str
    protocol: str
    split: str
    path: Path
    written: bool
    pictures: tuple[Path, ...] = ()
    retrieval: Path | None = None
    """``<results>-retrieval-<name>.png``: sampled queries and their top-k (None: not drawn, e.g. feature
    shards); a training run's own ``retrieval.png`` is left as it is."""
    per_query: Path | None = None
    """The ``--per-query`` file written (None: not asked for, or not this rank)."""

    def table(self) -> str:
        queries = int(self.metrics.get("num_queries", 0))
        counted = f" ({queries} queries)" if "num_queries" in self.metrics else ""
        lines = [
            f"{self.protocol} protocol, split '{self.split}'{counted}",
            format_table({self.label: self.metrics}),
        ]
        note = bootstrap_note(self.metrics)
        if note:
            lines.append(note)
        lines += [f"{name}: {line}" for name, line in deployment_lines(self.metrics).items()]
        if self.pictures:
            lines.append("curves: " + ", ".join(str(p) for p in self.pictures))
        if self.retrieval is not None:
            lines.append(f"retrieval picture: {self.retrieval} (its legend says what the frames mean)")
        if self.per_query is not None:
            lines.append(f"per-query values: {self.per_query}")
        return "\n".join(lines)


def evaluate_and_record(
    cfg: Config,
    checkpoint: str | None = None,
    baseline: str | None = None,
    split: str | None = None,
    name: str | None = None,
    output: str | None = None,
    bootstrap: QueryBootstrap | None = None,
    per_query: str | None = None,
) -> Evaluation:
    """Evaluate on every rank; rank 0 adds the result to the JSON (``output``, default OUTPUT_DIR/eval.json).
    ``bootstrap``: each metric's spread over the queries or identities too. ``per_query``: rank 0 also writes
    each query's values there (``ddp_rank.eval.per_query``; sop, inshop). Tears down the process group."""
    refusal = per_query_refusal(cfg.eval.protocol) if per_query is not None else None
    if refusal is not None:
        raise ConfigError(refusal)
    if per_query is not None and Path(per_query).is_dir():
        raise ConfigError(
            f"--per-query {per_query} is a folder: give the file to write, e.g. {per_query}/queries.npz"
        )
    if bootstrap is not None and cfg.eval.protocol == "vehicleid":
        raise ConfigError(
            "--bootstrap resamples the queries (sop, inshop) or the identities (verification, identification); "
            "VehicleID's figures average random galleries (eval.vehicleid_repeats): leave out --bootstrap"
        )
    open_and_check_split(cfg, None)
    split, described = _splits_to_evaluate(cfg, split)
    if checkpoint is not None and baseline is not None:
        raise ConfigError("pass either --checkpoint or --baseline, not both")
    settings = evaluation_settings(cfg)
    accelerator = make_accelerator(cfg)
    try:
        shards = feature_shards(cfg.model, cfg.data)
        model, default_name = build_eval_model(cfg.model, cfg.data.image_size, shards, checkpoint, baseline)
        model.to(accelerator.device)
        picture = RetrievalPicture(settings, accelerator.is_main_process)
        result = evaluate_model(
            model,
            settings,
            split,
            device=accelerator.device,
            autocast_dtype=autocast_dtype(accelerator),
            bootstrap=bootstrap,
            on_embedded=picture.capture,
            per_query=per_query is not None,
        )
        queries = result.pop("per_query", None)  # rank 0 only: the other ranks write nothing
        metrics, curves = split_curves(result)
        label = name or default_name
        out_path = Path(output) if output else Path(cfg.train.output_dir) / "eval.json"
        pictures: list[Path] = []
        retrieval: Path | None = None
        written_per_query: Path | None = None
        if accelerator.is_main_process:
            results: dict[str, Any] = json.loads(out_path.read_text()) if out_path.is_file() else {}
            results[label] = {
                "metrics": metrics,
                "protocol": cfg.eval.protocol,
                "split": described,
                "shards": cfg.data.shards,
                "checkpoint": checkpoint,
                **({"curves": curves} if curves else {}),
            }
            write_json(results, out_path)
            pictures = draw_curve_pictures(results, out_path)
            drawn_as = eval_picture_file(out_path, label)
            retrieval = picture.write(label, out_path.parent, accelerator.device, file=drawn_as)
            if per_query is not None and queries is not None:
                written_per_query = write_per_query(queries, per_query)
        return Evaluation(
            metrics,
            label,
            cfg.eval.protocol,
            described,
            out_path,
            accelerator.is_main_process,
            tuple(pictures),
            retrieval,
            written_per_query,
        )
    finally:
        accelerator.end_training()
        end_process_group()


def draw_curve_pictures(results: dict[str, dict[str, Any]], path: Path) -> list[Path]:
    """``<stem>-roc.png``, ``-det``, ``-pr``, ``-cmc`` beside the results JSON ``path``: one line per entry of
    the JSON that has curves (raw pixels, before and after training on one figure)."""
    curves = {name: entry["curves"] for name, entry in results.items() if entry.get("curves")}
    return draw_curves(curves, path.parent, prefix=f"{path.stem}-") if curves else []


def export_embeddings(
    cfg: Config,
    checkpoint: str | None,
    output: str,
    split: str | None = None,
    images: str | None = None,
    shards_url: str | None = None,
    on_bad: str = "skip",
) -> dict[str, Any]:
    """Embed the source on every rank, each writing its part; rank 0 writes ``export.json``. Tears down.

    ``on_bad="skip"`` leaves images that do not decode out: each rank logs its own, one line per file, and
    ``export.json`` lists those of ``--images`` and ``--shards-url`` under ``skipped`` (``name: why``; a split's
    reader logs them, as evaluation does). ``on_bad="error"`` stops at the first, naming it (``--images`` and
    ``--shards-url``). No embedding at all is an error: ``ExportError``, and no ``export.json`` is written."""
    if on_bad not in ("error", "skip"):
        raise ConfigError(f"--on-bad {on_bad}: valid are error, skip")
    if on_bad == "error" and images is None and shards_url is None:
        raise ConfigError(
            "--on-bad error applies to --images and --shards-url: a split's images that do not decode are left "
            "out and logged, as in evaluation; check the split first with `ddp-rank shards verify`"
        )
    if images is None and shards_url is None:
        split = split or cfg.data.test_split
        if not split:
            raise ConfigError(
                "nothing to export: pass --split, --images or --shards-url (or set data.test_split)"
            )
        open_and_check_split(cfg, split)
        source: dict[str, Any] = {"kind": "split", "shards": cfg.data.shards, "split": split}
    elif images is not None:
        source = {"kind": "images", "folder": images}
    else:
        source = {"kind": "shards_url", "url": shards_url}
    ckpt = str(resolve_checkpoint(checkpoint).resolve()) if checkpoint else None
    accelerator = make_accelerator(cfg)
    try:
        rank, world = accelerator.process_index, accelerator.num_processes
        skipped: list[str] | None = [] if on_bad == "skip" else None
        data_part = cfg.data
        shards = feature_shards(cfg.model, data_part)
        model, _ = build_eval_model(cfg.model, data_part.image_size, shards, ckpt, None)
        if source["kind"] != "split":
            # Images into a head trained on feature shards: the backbone the shards record goes first.
            model, data_part = images_in_front(model, data_part, shards)
        model.to(accelerator.device)
        transform, bs = transform_from_config(data_part), cfg.eval.batch_size
        cache = open_cache(data_part.cache_dir, data_part.cache_max_gb)
        if source["kind"] == "split":
            batches = split_batches(
                data_part.shards, source["split"], transform, bs, rank, world, data_part.num_workers, cache
            )
        elif source["kind"] == "images":
            batches = folder_batches(source["folder"], transform, bs, rank, world, skipped)
        else:
            batches = url_shard_batches(source["url"], transform, bs, rank, world, skipped, cache)
        dtype = autocast_dtype(accelerator)
        data = embed_batches_to_arrays(model, batches, cfg.model.embedding_dim, accelerator.device, dtype)
        for line in skipped or []:
            log.warning(f"skipped an image that does not decode: {line}")
        every_skipped = gather_object(skipped) if skipped is not None and world > 1 else skipped
        rows = sum(gather_object([len(data)])) if world > 1 else len(data)
        if rows == 0:
            left_out = f" ({len(every_skipped)} skipped: {every_skipped[0]}, ...)" if every_skipped else ""
            raise ExportError(
                f"exported 0 embeddings: no image could be embedded ({_describe(source)}){left_out}; "
                "nothing written"
            )
        write_part(output, rank, world, data)
        accelerator.wait_for_everyone()
        manifest: dict[str, Any] = {}
        if accelerator.is_main_process:
            meta: dict[str, Any] = {
                "source": source,
                "checkpoint": ckpt,
                "model": cfg.model.backbone,
                # ``search`` embeds its queries in the precision the collection was embedded in.
                "mixed_precision": str(accelerator.mixed_precision),
                "config": to_dict(cfg),
            }
            if every_skipped is not None:
                meta["skipped"] = list(every_skipped)
            manifest = write_manifest(output, world, meta)
        accelerator.wait_for_everyone()
        return manifest
    finally:
        accelerator.end_training()
        end_process_group()


def describe_export(manifest: dict[str, Any], output: str) -> str:
    """The line ``ddp-rank export`` prints for the ``export.json`` it wrote."""
    skipped = manifest.get("skipped")
    left_out = f"; skipped {len(skipped)} unreadable file(s), listed in export.json" if skipped else ""
    return (
        f"exported {manifest['rows']} embeddings of dim {manifest['dim']} ({_describe(manifest['source'])}) to "
        f"{output} in {len(manifest['parts'])} part(s){left_out}"
    )


def _describe(source: dict[str, Any]) -> str:
    if source["kind"] == "split":
        return f"split '{source['split']}' of {source['shards']}"
    if source["kind"] == "images":
        return f"images under {source['folder']}"
    return f"shards at {source['url']}"
