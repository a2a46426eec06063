"""``ddp-rank shards features``: embed every image of a shard set once with a frozen backbone, into feature shards.

The output mirrors the source: the same splits, shard paths, classes (in the same order, so the same byte-range
layout and plan) and categories; each sample's image becomes ``<key>.f16``, the backbone's output as float16
(``ddp_rank.data.features.records``). The backbone is the config's (``model.backbone``, ``model.weights``,
``model.pooling``), in eval mode, with the evaluation transform of ``data.*``, in the launcher's precision; the
manifest records all of that under ``build.features`` with the digest of the weights, so that an image searched
later is embedded the same way.

The resumable writing (``prepare_destination``, ``claim_build``, ``write_feature_shard``, ``finish_build``) is shared
with ``ddp-rank shards whiten`` (``features.whiten``), which maps stored vectors instead of embedding images.

Work sharing and resume: the shards still to write are dealt round-robin to the ranks of the launch; each
shard is written whole under a temporary name and renamed (``tar_writer``), then a small record of it (its
manifest entry) is written beside, in ``DST/.features-build/``. A build killed at any point starts again where
it stopped: shards with a record are kept, any other is written again. The manifest comes last, written by rank
0 once every rank is done; the records are removed then. A second build with another backbone or source into a
directory holding an unfinished one is refused (``--overwrite`` starts it afresh).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.config import FEATURES_BACKBONE, ConfigError, DataConfig, ModelConfig
from ddp_rank.data.features.records import BUILD_KEY, FeatureRecord, encode_vector, feature_record
from ddp_rank.data.format.manifest import MANIFEST_NAME, ClassSpan, Manifest, ShardInfo, SplitInfo, is_url
from ddp_rank.data.format.tar_scan import SpanSample
from ddp_rank.data.format.tar_writer import shard_writer
from ddp_rank.data.reading.decode import ImageDecodeError, decode_image
from ddp_rank.data.reading.reader import ClassReader, ClassReadError
from ddp_rank.data.reading.transforms import collate_images, test_transform, transform_from_config
from ddp_rank.eval.embed import autocast
from ddp_rank.model import EmbeddingNet, build_model
from ddp_rank.model.feature_head import build_seeded, image_features, weights_digest
from ddp_rank.runtime import autocast_dtype

__all__ = [
    "FeatureBuildError",
    "FeatureBuildOptions",
    "VectorMaker",
    "all_shards",
    "build_feature_shards",
    "claim_build",
    "done_path",
    "feature_record_for",
    "finish_build",
    "open_build_source",
    "prepare_destination",
    "shard_json",
    "write_feature_shard",
]

PROGRESS_DIR = ".features-build"
"""Inside DST while a build runs: ``build.json`` (what is being built) and one record per finished shard."""


class FeatureBuildError(ValueError):
    """The feature build cannot run or go on; the message names the file or setting and the fix."""


@dataclass(frozen=True)
class FeatureBuildOptions:
    batch_size: int = 256
    """Images per forward pass of the backbone."""
    overwrite: bool = False
    """Start afresh in a DST that holds feature shards or an unfinished build (nothing else there is touched)."""
    progress: bool = True


def feature_record_for(
    model: ModelConfig, data: DataConfig, seed: int, backbone: EmbeddingNet, mixed_precision: str, source: str
) -> FeatureRecord:
    """The ``build.features`` record of vectors made by ``backbone`` (built from the ``model`` section with
    fresh weights drawn from ``seed``, its images read with the ``data`` section's transform)."""
    return FeatureRecord(
        backbone=model.backbone,
        weights=model.weights,
        pooling=model.pooling,
        weights_digest=weights_digest(backbone.backbone),
        dim=int(backbone.head.in_features),
        transform={"crop": data.crop, "resize_size": data.resize_size, "image_size": data.image_size},
        mixed_precision=mixed_precision,
        init_seed=seed,
        source=source,
        output_stride=model.output_stride,
    )


def build_feature_shards(
    model: ModelConfig,
    data: DataConfig,
    seed: int,
    source: str,
    out: str,
    accelerator: Any,
    options: FeatureBuildOptions,
    on_shard: Callable[[ShardInfo], None] | None = None,
) -> Manifest | None:
    """Build feature shards of ``source`` in ``out`` on every rank of ``accelerator``; rank 0 returns the
    manifest it wrote, the other ranks None. ``on_shard`` is called after each shard this rank finished.
    ``model``: the backbone that makes the vectors (the config's ``model`` section; ``seed``: ``train.seed``,
    which draws the weights a backbone has no file for); ``data``: the transform of its images."""
    src = _open_source(source, out)
    backbone = _backbone(model, data.image_size, seed)
    device = accelerator.device
    backbone.to(device)
    record = feature_record_for(model, data, seed, backbone, str(accelerator.mixed_precision), source)
    dst = Path(out)
    progress = dst / PROGRESS_DIR
    if accelerator.is_main_process:
        _start(dst, record, options.overwrite)
    accelerator.wait_for_everyone()
    todo = [(split, shard) for split, shard in all_shards(src) if not done_path(progress, shard).is_file()]
    mine = todo[accelerator.process_index :: accelerator.num_processes]
    embed = _Embedder(backbone, data, device, accelerator, options.batch_size)
    total = sum(shard.samples for _, shard in mine)
    desc = (
        f"features (rank 0 of {accelerator.num_processes})" if accelerator.num_processes > 1 else "features"
    )
    bar = tqdm(
        total=total, unit="img", desc=desc, disable=not (options.progress and accelerator.is_main_process)
    )
    try:
        for split, shard in mine:
            info = write_feature_shard(src, split, shard, dst, embed, bar)
            atomic_write_text(done_path(progress, shard), json.dumps(shard_json(info)) + "\n")
            if on_shard is not None:
                on_shard(info)
    finally:
        bar.close()
    accelerator.wait_for_everyone()
    manifest = None
    if accelerator.is_main_process:
        manifest = finish_build(src, dst, record)
    accelerator.wait_for_everyone()
    return manifest


def _open_source(source: str, out: str) -> Manifest:
    src = open_build_source(source, out)
    if feature_record(src) is not None:
        raise FeatureBuildError(
            f"SRC={source} holds feature vectors already, not images: pass the image shards they were made from"
        )
    return src


def open_build_source(source: str, out: str) -> Manifest:
    """The manifest of SRC, for a build into the local directory ``out``, which must be another one."""
    if is_url(out):
        raise FeatureBuildError(f"DST={out} is a URL: shards are written to a local directory")
    try:
        src = Manifest.load(source)
    except (FileNotFoundError, ValueError) as exc:
        raise FeatureBuildError(f"SRC={source}: {exc}") from exc
    if Path(out).resolve() == Path(source).resolve():
        raise FeatureBuildError(f"DST={out} is SRC: write the new shards to another directory")
    return src


def _backbone(model: ModelConfig, image_size: int, seed: int) -> EmbeddingNet:
    if model.backbone == FEATURES_BACKBONE:
        raise ConfigError(
            f"model.backbone={FEATURES_BACKBONE} has no image backbone to embed with: the config of "
            "`ddp-rank shards features` names the backbone that makes the vectors (resnet50, timm:..., ...)"
        )
    net = build_seeded(lambda: build_model(model, image_size), seed)
    net.eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def _start(dst: Path, record: FeatureRecord, overwrite: bool) -> None:
    """Create DST, or check that what it holds is this build's to resume; ``overwrite`` clears an earlier one."""
    prepare_destination(dst, overwrite)
    claim_build(dst, record)


def prepare_destination(dst: Path, overwrite: bool) -> None:
    """Refuse a DST that holds a finished set or other files; ``overwrite`` clears an earlier build first.
    Leaves DST with its progress directory, empty or holding the unfinished build to resume."""
    progress = dst / PROGRESS_DIR
    if overwrite:
        shutil.rmtree(progress, ignore_errors=True)
        (dst / MANIFEST_NAME).unlink(missing_ok=True)
    if (dst / MANIFEST_NAME).is_file():
        raise FeatureBuildError(
            f"DST={dst} already holds a finished shard set ({MANIFEST_NAME}); pass --overwrite to replace it"
        )
    if not overwrite and dst.is_dir() and not progress.is_dir() and any(dst.iterdir()):
        raise FeatureBuildError(
            f"DST={dst} is not empty and holds no unfinished feature build: use a new directory"
        )
    progress.mkdir(parents=True, exist_ok=True)


def claim_build(dst: Path, record: FeatureRecord) -> None:
    """Record what this build makes, or check that the unfinished build in DST made the same."""
    started = dst / PROGRESS_DIR / "build.json"
    # A build started before a field existed holds none: it ran with the field's default (output_stride 32).
    wanted = {**_record_defaults(), **record.to_json()}
    if started.is_file():
        previous = {**_record_defaults(), **json.loads(started.read_text(encoding="utf-8"))}
        if previous != wanted:
            changed = sorted(k for k in wanted if previous.get(k) != wanted[k])
            raise FeatureBuildError(
                f"DST={dst} holds an unfinished feature build with another {', '.join(changed)}; rerun it with "
                "the same config to finish it, or pass --overwrite to start afresh"
            )
        return
    atomic_write_text(started, json.dumps(record.to_json(), indent=1) + "\n")


def _record_defaults() -> dict[str, Any]:
    """The :class:`FeatureRecord` fields that have a default, with it."""
    return {f.name: f.default for f in fields(FeatureRecord) if f.default is not MISSING}


def all_shards(src: Manifest) -> Iterator[tuple[str, ShardInfo]]:
    for name in sorted(src.splits):
        for shard in src.splits[name].shards:
            yield name, shard


def done_path(progress: Path, shard: ShardInfo) -> Path:
    return progress / (shard.path.replace("/", "__") + ".json")


class _Embedder:
    """Images to backbone vectors in batches, in eval mode and the launcher's precision."""

    def __init__(
        self, model: EmbeddingNet, data: DataConfig, device: torch.device, accelerator: Any, batch: int
    ):
        self.model = model
        self.device = device
        self.dtype = autocast_dtype(accelerator)
        self.transform_config = transform_from_config(data, pixels="uint8")
        self.transform = test_transform(self.transform_config)
        self.batch = batch

    @torch.no_grad()
    def __call__(self, images: list[bytes]) -> list[bytes]:
        """The vectors of ``images``; an image that does not decode raises ``ImageDecodeError`` named by its
        position in ``images`` (``write_feature_shard`` names the sample)."""
        out: list[bytes] = []
        config = self.transform_config
        for start in range(0, len(images), self.batch):
            tensors = [
                self.transform(decode_image(data, config.resize, name=str(i), max_pixels=config.max_pixels))
                for i, data in enumerate(images[start : start + self.batch], start)
            ]
            batch = collate_images(tensors, self.transform_config).to(self.device)
            with autocast(self.device, self.dtype):
                vectors = image_features(self.model, batch)
            out.extend(encode_vector(v) for v in vectors.float().cpu().numpy())
        return out


class VectorMaker(Protocol):
    """What turns a source shard's samples into the output's vectors: the backbone on images (``_Embedder``),
    or a map on vectors (``ddp_rank.eval.features.whiten``)."""

    batch: int
    """Samples per call."""

    def __call__(self, samples: list[bytes], /) -> list[bytes]:
        """The ``.f16`` bytes of each sample's vector, in order."""
        ...


def write_feature_shard(
    src: Manifest, split: str, shard: ShardInfo, dst: Path, embed: VectorMaker, bar: tqdm
) -> ShardInfo:
    """Embed one source shard's classes and write its feature shard (same path, classes, keys, json)."""
    reader = ClassReader(src, split)
    path = dst / shard.path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with shard_writer(path) as writer:
            # Classes are small: gather a batch's worth before each forward pass, then write in class order.
            pending: list[tuple[int, SpanSample]] = []
            for index, span in enumerate(shard.classes):
                pending += [(span.id, s) for s in _read(reader, span, shard, src)]
                if len(pending) >= embed.batch or index == len(shard.classes) - 1:
                    vectors = _embed_named(embed, pending, shard, src)
                    for (class_id, sample), vector in zip(pending, vectors):
                        meta = json.loads(sample.meta.decode("utf-8")) if sample.meta else {}
                        writer.add(sample.key, "f16", vector, class_id, meta)
                    bar.update(len(pending))
                    pending = []
            nbytes, digest = writer.close()
    finally:
        reader.close()
    return ShardInfo(shard.path, shard.category, tuple(writer.spans), writer.samples, nbytes, digest)


def _embed_named(
    embed: VectorMaker, pending: list[tuple[int, SpanSample]], shard: ShardInfo, src: Manifest
) -> list[bytes]:
    """``embed`` of the samples' payloads; an image that does not decode stops the build with its name (a
    feature shard holds every sample of the source: there is no replacement to write)."""
    try:
        return embed([s.image for _, s in pending])
    except ImageDecodeError as exc:
        class_id, sample = pending[int(exc.name)]
        raise FeatureBuildError(
            f"SRC={src.root}: {shard.path}: class {class_id}: image {sample.key}.{sample.image_ext} does not "
            f"decode: {exc.reason}; check the image shards with `ddp-rank shards verify {src.root}`"
        ) from exc


def _read(reader: ClassReader, span: ClassSpan, shard: ShardInfo, src: Manifest) -> list[SpanSample]:
    try:
        return reader.read(span.id)
    except ClassReadError as exc:
        raise FeatureBuildError(
            f"SRC={src.root}: {exc}; check the image shards with `ddp-rank shards verify {src.root}`"
        ) from exc


def shard_json(info: ShardInfo) -> dict[str, Any]:
    return {**asdict(info), "classes": [[c.id, c.count, c.offset, c.length, c.digest] for c in info.classes]}


def _shard_from_json(raw: dict[str, Any]) -> ShardInfo:
    spans = tuple(ClassSpan(int(a), int(b), int(c), int(d), str(e)) for a, b, c, d, e in raw["classes"])
    return ShardInfo(
        raw["path"], raw["category"], spans, int(raw["samples"]), int(raw["bytes"]), raw["sha256"]
    )


def finish_build(src: Manifest, dst: Path, record: FeatureRecord, files: tuple[str, ...] = ()) -> Manifest:
    """The manifest of the finished set (the source's splits, classes and categories; the feature shards).
    ``files`` are moved from the progress directory into DST first: the manifest that names them comes last."""
    progress = dst / PROGRESS_DIR
    for name in files:
        os.replace(progress / name, dst / name)
    splits = {}
    for name, split in src.splits.items():
        shards = []
        for shard in split.shards:
            done = done_path(progress, shard)
            if not done.is_file():
                raise FeatureBuildError(
                    f"shard {shard.path} was not written by any rank; run the build again"
                )
            shards.append(_shard_from_json(json.loads(done.read_text(encoding="utf-8"))))
        splits[name] = SplitInfo(name=name, class_counts=dict(split.class_counts), shards=tuple(shards))
    manifest = Manifest(
        categories=src.categories,
        classes=src.classes,
        splits=splits,
        build={BUILD_KEY: record.to_json()},
        root=str(dst),
        shared_classes=src.shared_classes,  # the source's protocol holds for its vectors too
    )
    manifest.save(dst)
    shutil.rmtree(progress, ignore_errors=True)
    return manifest
