"""``ddp-rank shards whiten``: feature shards whose vectors are PCA-whitened (``data.features.whitening``).

The map is fitted on the training split's vectors only, so the test split is whitened as unseen data would be.
The output mirrors the source as ``shards features`` does (same splits, shard paths, classes, keys and json),
with the map in ``whitening.safetensors`` and the manifest's feature record that of the source plus a
``whitening`` entry naming the file and its sha256; ``dim`` is the whitened length. The backbone stays recorded,
so ``search`` of an image file runs that backbone, then this map, then the head.

Resume works as for ``shards features``: the map is written into the progress directory before any shard, and a
build started again reuses it (refitting could round differently), keeps every shard with a record, and writes
the others; the map joins the shards when the manifest is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.data.features.records import FeatureRecord, decode_vector, encode_vector, feature_record
from ddp_rank.data.features.whitening import (
    WHITENING_FILE,
    Whitening,
    WhiteningError,
    WhiteningRecord,
    fit_whitening,
    parse_whitening,
)
from ddp_rank.data.format.manifest import Manifest, ShardInfo
from ddp_rank.data.reading.reader import ClassReader, ClassReadError
from ddp_rank.eval.features.build import (
    PROGRESS_DIR,
    FeatureBuildError,
    all_shards,
    claim_build,
    done_path,
    finish_build,
    open_build_source,
    prepare_destination,
    shard_json,
    write_feature_shard,
)

__all__ = ["WhitenOptions", "whiten_feature_shards"]


@dataclass(frozen=True)
class WhitenOptions:
    dim: int | None = None
    """Axes kept, largest variance first (None: all, the vectors' own length)."""
    shrinkage: float = 1e-4
    """Added to every eigenvalue, times their mean (``ddp_rank.data.features.whitening``)."""
    split: str = "train"
    """The split the map is fitted on."""
    overwrite: bool = False
    progress: bool = True


def whiten_feature_shards(
    source: str, out: str, options: WhitenOptions, on_shard: Callable[[ShardInfo], None] | None = None
) -> tuple[Manifest, np.ndarray]:
    """Whiten the feature shards ``source`` into ``out``; returns the new manifest and the eigenvalues of the
    training vectors' covariance (largest first), whose share kept the caller may report. ``on_shard`` is
    called after each shard written."""
    src, record = _open_source(source, out, options.split)
    if options.dim is not None and not 1 <= options.dim <= record.dim:
        raise FeatureBuildError(
            f"--dim must be between 1 and the vectors' length {record.dim}, got {options.dim}"
        )
    if not options.shrinkage >= 0:
        raise FeatureBuildError(f"--shrinkage must be a number >= 0, got {options.shrinkage}")
    dst = Path(out)
    prepare_destination(dst, options.overwrite)
    whitening, eigenvalues, digest = _fit_or_resume(src, dst, record, options)
    whitened = dataclasses.replace(
        record,
        dim=whitening.dim,
        whitening=WhiteningRecord(
            WHITENING_FILE, digest, record.dim, options.split, options.shrinkage, source
        ),
    )
    claim_build(dst, whitened)
    progress = dst / PROGRESS_DIR
    todo = [(split, shard) for split, shard in all_shards(src) if not done_path(progress, shard).is_file()]
    apply = _Whiten(whitening, record.dim)
    total = sum(shard.samples for _, shard in todo)
    with tqdm(total=total, unit="vec", desc="whiten", disable=not options.progress) as bar:
        for split, shard in todo:
            info = write_feature_shard(src, split, shard, dst, apply, bar)
            atomic_write_text(done_path(progress, shard), json.dumps(shard_json(info)) + "\n")
            if on_shard is not None:
                on_shard(info)
    return finish_build(src, dst, whitened, files=(WHITENING_FILE,)), eigenvalues


def _open_source(source: str, out: str, split: str) -> tuple[Manifest, FeatureRecord]:
    src = open_build_source(source, out)
    record = feature_record(src)
    if record is None:
        raise FeatureBuildError(
            f"SRC={source} holds images, not feature vectors: make feature shards first with "
            "`ddp-rank shards features`, then whiten those"
        )
    if record.whitening is not None:
        raise FeatureBuildError(
            f"SRC={source} is whitened already (from {record.whitening.source}): whiten that set instead"
        )
    if split not in src.splits:
        raise FeatureBuildError(
            f"--split {split} is not a split of {source} (it has {sorted(src.splits)}): the map is fitted on the "
            "training split"
        )
    return src, record


def _fit_or_resume(
    src: Manifest, dst: Path, record: FeatureRecord, options: WhitenOptions
) -> tuple[Whitening, np.ndarray, str]:
    """The map of an unfinished build in DST (and its file's sha256), or a new one fitted and written there."""
    path = dst / PROGRESS_DIR / WHITENING_FILE
    eigenvalues_path = dst / PROGRESS_DIR / "eigenvalues.npy"
    if path.is_file() and eigenvalues_path.is_file():
        data = path.read_bytes()
        try:
            whitening = parse_whitening(data, record.dim, str(path))
        except WhiteningError as exc:
            raise FeatureBuildError(f"{exc}: pass --overwrite to start afresh") from exc
        wanted = record.dim if options.dim is None else options.dim
        if whitening.dim != wanted:
            raise FeatureBuildError(
                f"DST={dst} holds an unfinished whitening to {whitening.dim} axes, not {wanted}: rerun it "
                "with the same --dim to finish it, or pass --overwrite to start afresh"
            )
        return whitening, np.load(eigenvalues_path), hashlib.sha256(data).hexdigest()
    try:
        whitening, eigenvalues = fit_whitening(
            _vectors(src, options.split, record.dim), options.dim, options.shrinkage
        )
    except WhiteningError as exc:
        raise FeatureBuildError(f"SRC={src.root}: {exc}") from exc
    np.save(eigenvalues_path, eigenvalues)
    return whitening, eigenvalues, whitening.save(path)


def _vectors(src: Manifest, split: str, dim: int, batch: int = 16_384) -> Iterator[np.ndarray]:
    """The split's vectors, ``batch`` at a time, class by class in manifest order."""
    reader = ClassReader(src, split)
    pending: list[np.ndarray] = []
    try:
        for class_id in reader.where:
            try:
                pending += [decode_vector(s.image, dim) for s in reader.read(class_id)]
            except (ClassReadError, ValueError) as exc:
                raise FeatureBuildError(
                    f"SRC={src.root}: {exc}; check the feature shards with `ddp-rank shards verify {src.root}`"
                ) from exc
            if len(pending) >= batch:
                yield np.stack(pending)
                pending = []
        if pending:
            yield np.stack(pending)
    finally:
        reader.close()


class _Whiten:
    """Stored vectors to whitened ones, as ``.f16`` bytes (``eval.features.build.VectorMaker``)."""

    batch = 4096

    def __init__(self, whitening: Whitening, dim: int) -> None:
        self.whitening = whitening
        self.dim = dim

    def __call__(self, samples: list[bytes]) -> list[bytes]:
        vectors = np.stack([decode_vector(data, self.dim) for data in samples])
        return [encode_vector(v) for v in self.whitening.apply(vectors)]
