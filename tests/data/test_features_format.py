"""The feature sample kind of the data layer: the .f16 member's bytes, the build.features record, and the stream
and evaluation reader returning the stored vectors (checked against the tar read with tarfile)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.features.records import FeatureRecord, FeatureRecordError, decode_vector, encode_vector
from ddp_rank.data.features.synthetic import write_feature_shards
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.eval_reader import EvalShards
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.sampling.schedule import ScheduleConfig
from tests.helpers.feature_shards import RECORD


def vectors_by_key(shards: Path) -> dict[str, np.ndarray]:
    """Every vector of a shard set, read with tarfile and numpy alone."""
    out = {}
    for tar in sorted(shards.glob("*/*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".f16"):
                    raw = tf.extractfile(m).read()  # type: ignore[union-attr]
                    out[m.name.removesuffix(".f16")] = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    return out


def test_vector_bytes_are_little_endian_float16_and_checked() -> None:
    v = np.array([1.0, -2.5, 65504.0], dtype=np.float32)
    data = encode_vector(v)
    assert data == b"\x00\x3c\x00\xc1\xff\x7b"  # IEEE half, little-endian, by hand
    np.testing.assert_array_equal(decode_vector(data, 3), v)
    with pytest.raises(ValueError, match="6 bytes where a vector of 4"):
        decode_vector(data, 4)
    with pytest.raises(ValueError, match="non-finite"):
        decode_vector(encode_vector(np.array([np.nan, 0.0, 1.0])), 3)


def test_record_is_parsed_and_every_field_checked() -> None:
    assert FeatureRecord.from_json(RECORD, "m").dim == RECORD["dim"]
    for broken, message in (
        ({**RECORD, "dim": 0}, "dim must be a positive integer"),
        ({k: v for k, v in RECORD.items() if k != "weights_digest"}, "weights_digest is missing"),
        ({**RECORD, "transform": {"crop": "paper"}}, "transform must hold"),
        ({**RECORD, "extra": 1}, "unknown field"),
        ("resnet50", "not an object"),
    ):
        with pytest.raises(FeatureRecordError, match=message):
            FeatureRecord.from_json(broken, "m")


def test_stream_and_eval_reader_yield_the_stored_vectors(tmp_path: Path) -> None:
    shards = write_feature_shards(tmp_path / "f", classes_per_category=[6, 6], images=4, dim=8)
    assert verify_shards(shards) == []
    stored = vectors_by_key(shards)
    stream = ShardStream(shards, 16, schedule=ScheduleConfig(strategy="hard", seed=3), rank=0, world_size=1)
    batch = stream.batch(0, 0)
    assert batch.images.shape == (16, 8) and batch.images.dtype == torch.float32
    expected = np.stack([stored[k] for k in batch.keys])
    np.testing.assert_array_equal(batch.images.numpy(), expected)
    labels = [int(k[1:8]) for k in batch.keys]  # key c<class>_<n>
    assert batch.labels.tolist() == labels
    seen = {}
    for b in EvalShards(shards, "test", batch_size=5, rank=0, world_size=1):
        seen.update({k: row for k, row in zip(b.keys, b.images.numpy())})
    test_classes = Manifest.load(shards).splits["test"].class_counts
    test_keys = {k for k in stored if int(k[1:8]) in test_classes}
    assert set(seen) == test_keys
    for k in seen:
        np.testing.assert_array_equal(seen[k], stored[k])


def test_verify_names_a_vector_of_the_wrong_length(tmp_path: Path) -> None:
    shards = write_feature_shards(tmp_path / "f", classes_per_category=[3], images=2, dim=8)
    raw = json.loads((shards / "manifest.json").read_text())
    raw["build"]["features"]["dim"] = 9  # the record no longer fits the stored vectors
    (shards / "manifest.json").write_text(json.dumps(raw))
    problems = [str(p) for p in verify_shards(shards)]
    assert problems and all("bytes where a vector of 9 float16 values takes 18" in p for p in problems)


def test_record_output_stride_round_trips_and_defaults_to_the_whole_network() -> None:
    record = FeatureRecord.from_json({**RECORD, "output_stride": 16}, "m")
    assert record.output_stride == 16
    assert json.loads(json.dumps(record.to_json()))["output_stride"] == 16
    assert FeatureRecord.from_json(json.loads(json.dumps(record.to_json())), "m") == record
    assert "output_stride" not in RECORD, "the helper's record is one written before output_stride existed"
    assert FeatureRecord.from_json(RECORD, "m").output_stride == 32


@pytest.mark.parametrize("stride", [8, "16", True, 16.0, None])
def test_record_output_stride_must_be_16_or_32(stride: object) -> None:
    with pytest.raises(
        FeatureRecordError, match=rf"m: build.features.output_stride must be 16 or 32, got {stride!r}"
    ):
        FeatureRecord.from_json({**RECORD, "output_stride": stride}, "m")
