"""Feature shards: samples that are one float16 vector each instead of image bytes.

``ddp-rank shards features`` embeds every image of a shard set once with a frozen backbone and writes a shard
set with the same splits, shards, classes and categories whose samples hold the backbone's output. A sample is
``<key>.f16`` (the vector as raw little-endian float16 bytes: never unpickled, never decoded as an image),
``<key>.cls`` and ``<key>.json`` as in image shards. The manifest records, under ``build.features``, how the
vectors were made (``FeatureRecord``): the backbone, its weights' digest, the evaluation transform, the
precision and the dimension; a model reading the vectors is a head only (``model.backbone=features``), and an
image to search with is embedded with the recorded backbone first.

The data layer reads such a set with no transform: ``decode_vector`` turns a member's bytes into a float32
vector, checked for its length and for finite values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ddp_rank.data.features.whitening import WhiteningRecord
from ddp_rank.data.format.manifest import Manifest

FEATURE_EXTENSION = "f16"
"""The member of a feature sample: the vector as raw little-endian float16 bytes."""
FEATURE_DTYPE = np.dtype("<f2")
BUILD_KEY = "features"
"""Where the record lives in the manifest: ``build.features``."""


class FeatureRecordError(ValueError):
    """A manifest's ``build.features`` record is missing or malformed (the message names the field)."""


@dataclass(frozen=True)
class FeatureRecord:
    """How the vectors of a feature shard set were made: enough to embed a new image the same way."""

    backbone: str
    """``model.backbone`` of the config the vectors were made with (resnet50, timm:..., ...)."""
    weights: str
    """``model.weights`` of that config (none, default, a weights name or a file path)."""
    pooling: str
    """``model.pooling`` of that config."""
    weights_digest: str
    """sha256 of the backbone's state_dict as it embedded (names, dtypes, shapes and bytes of every tensor)."""
    dim: int
    """Length of every vector (the backbone's output width)."""
    transform: dict[str, Any]
    """The evaluation transform's settings: ``crop``, ``resize_size``, ``image_size`` (``data.*`` keys)."""
    mixed_precision: str
    """The launcher's precision the backbone ran in (no, fp16, bf16)."""
    init_seed: int
    """The torch seed the backbone was built under (``train.seed``): what random weights are drawn from."""
    source: str
    """The image shard set the vectors were made from."""
    output_stride: int = 32
    """``model.output_stride`` of that config (manifests written before it existed hold none: 32)."""
    whitening: WhiteningRecord | None = None
    """The map the vectors were whitened with after the backbone (``ddp-rank shards whiten``), None for the
    backbone's own vectors; ``dim`` is then the whitened length."""

    def to_json(self) -> dict[str, Any]:
        """The record as the manifest holds it (no ``whitening`` key for the backbone's own vectors)."""
        raw = asdict(self)
        if self.whitening is None:
            del raw["whitening"]
        return raw

    @classmethod
    def from_json(cls, raw: Any, where: str) -> FeatureRecord:
        """Parse and check the record; ``where`` names the manifest in errors."""
        if not isinstance(raw, dict):
            raise FeatureRecordError(f"{where}: build.{BUILD_KEY} is a {type(raw).__name__}, not an object")
        text_fields = ("backbone", "weights", "pooling", "weights_digest", "mixed_precision", "source")
        for name in text_fields:
            if not isinstance(raw.get(name), str) or not raw[name]:
                raise FeatureRecordError(
                    f"{where}: build.{BUILD_KEY}.{name} is missing or not a non-empty text"
                )
        dim = raw.get("dim")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise FeatureRecordError(
                f"{where}: build.{BUILD_KEY}.dim must be a positive integer, got {dim!r}"
            )
        seed = raw.get("init_seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise FeatureRecordError(f"{where}: build.{BUILD_KEY}.init_seed must be an integer, got {seed!r}")
        transform = raw.get("transform")
        keys = ("crop", "resize_size", "image_size")
        if not isinstance(transform, dict) or any(k not in transform for k in keys):
            raise FeatureRecordError(
                f"{where}: build.{BUILD_KEY}.transform must hold {', '.join(keys)}, got {transform!r}"
            )
        stride = raw.get("output_stride", 32)
        # An integer, as dim and init_seed are: 16.0 == 16, but would travel on as a float.
        if not isinstance(stride, int) or isinstance(stride, bool) or stride not in (16, 32):
            raise FeatureRecordError(
                f"{where}: build.{BUILD_KEY}.output_stride must be 16 or 32, got {stride!r}"
            )
        whitening = None
        if raw.get("whitening") is not None:
            try:
                whitening = WhiteningRecord.from_json(raw["whitening"], f"build.{BUILD_KEY}.whitening")
            except ValueError as exc:
                raise FeatureRecordError(f"{where}: {exc}") from exc
        known = {*text_fields, "dim", "transform", "init_seed", "output_stride", "whitening"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise FeatureRecordError(f"{where}: build.{BUILD_KEY} has unknown field(s) {', '.join(unknown)}")
        return cls(
            backbone=raw["backbone"],
            weights=raw["weights"],
            pooling=raw["pooling"],
            weights_digest=raw["weights_digest"],
            dim=dim,
            transform=dict(transform),
            mixed_precision=raw["mixed_precision"],
            init_seed=seed,
            source=raw["source"],
            output_stride=stride,
            whitening=whitening,
        )


def feature_record(manifest: Manifest) -> FeatureRecord | None:
    """The manifest's feature record, None for image shards; raises ``FeatureRecordError`` if malformed."""
    if BUILD_KEY not in manifest.build:
        return None
    return FeatureRecord.from_json(manifest.build[BUILD_KEY], f"{manifest.root}/manifest.json")


def feature_dim(manifest: Manifest) -> int | None:
    """The vectors' length for feature shards, None for image shards."""
    record = feature_record(manifest)
    return None if record is None else record.dim


def encode_vector(vector: np.ndarray) -> bytes:
    """A vector as the bytes of its ``.f16`` member (raw little-endian float16)."""
    return np.ascontiguousarray(vector, dtype=FEATURE_DTYPE).tobytes()


def decode_vector(data: bytes, dim: int) -> np.ndarray:
    """The float32 vector of a ``.f16`` member; ``ValueError`` for a wrong length or a non-finite value."""
    if len(data) != 2 * dim:
        raise ValueError(f"{len(data)} bytes where a vector of {dim} float16 values takes {2 * dim}")
    vector = np.frombuffer(data, dtype=FEATURE_DTYPE).astype(np.float32)
    if not np.isfinite(vector).all():
        raise ValueError("the vector holds a non-finite value")
    return vector


__all__ = [
    "BUILD_KEY",
    "FEATURE_EXTENSION",
    "FeatureRecord",
    "FeatureRecordError",
    "decode_vector",
    "encode_vector",
    "feature_dim",
    "feature_record",
]
