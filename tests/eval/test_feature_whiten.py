"""``ddp-rank shards whiten``: the map (fitted on the training split, checked against numpy's own PCA), the
whitened shards (every vector the map of its source vector, stored as float16), resume after a kill, refusals,
a head trained on them, and an image embedded through backbone, map and head as the shards were made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.config import ConfigError, load_config
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.features.records import feature_record
from ddp_rank.data.features.whitening import WhiteningError, fit_whitening, load_whitening
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.model.feature_head import FeatureHeadNet
from ddp_rank.train.trainer import run_training
from tests.eval.test_feature_shards import HEAD, features_cmd, source_batch, stored
from tests.helpers.training import REPO, build_tiny_shards, cpu_env

DIM = 8  # the tiny set has 48 training vectors of 128 values: a covariance of rank 47 at most


def correlated(n: int, d: int, seed: int = 0) -> np.ndarray:
    """Vectors with a common offset, correlated values and variances from 1e-2 to 1e2."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d)) * np.logspace(-1, 1, d)
    return (rng.normal(size=(n, d)) @ mixing + 50.0).astype(np.float32)


def test_the_map_whitens_what_it_was_fitted_on_and_matches_numpys_pca() -> None:
    x = correlated(4000, 12)
    whitening, eigenvalues = fit_whitening(np.array_split(x, 7), shrinkage=0.0)  # streamed in 7 batches
    w = whitening.apply(x)
    np.testing.assert_allclose(w.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(np.cov(w, rowvar=False), np.eye(12), atol=1e-4)
    expected = np.linalg.eigvalsh(np.cov(x.astype(np.float64), rowvar=False))[::-1]
    np.testing.assert_allclose(eigenvalues, expected, rtol=1e-8)
    # Fewer axes: the top principal components, each of unit variance, the largest first.
    top, _ = fit_whitening([x], dim=3, shrinkage=0.0)
    np.testing.assert_allclose(top.apply(x), w[:, :3], rtol=1e-4, atol=1e-4)
    assert top.projection.shape == (12, 3)
    # The same map whatever the batching (the signs of the axes are fixed, not left to eigh).
    again, _ = fit_whitening([x[:5], x[5:]], shrinkage=0.0)
    np.testing.assert_allclose(again.projection, whitening.projection, rtol=1e-4, atol=1e-6)


def test_rank_deficient_vectors_need_fewer_axes_or_shrinkage() -> None:
    x = correlated(2000, 6)
    flat = np.concatenate([x, x[:, :2] + x[:, 2:4]], axis=1)  # 8 values spanning 6 dimensions
    with pytest.raises(WhiteningError, match=r"span only about 6 of their 8 dimensions: pass --dim 6"):
        fit_whitening([flat], shrinkage=0.0)
    shrunk, _ = fit_whitening([flat], shrinkage=1e-3)
    assert np.isfinite(shrunk.projection).all()
    with pytest.raises(WhiteningError, match="at least 2 vectors"):
        fit_whitening([flat[:1]])
    with pytest.raises(WhiteningError, match="--dim must be between 1 and"):
        fit_whitening([flat], dim=9)


def test_the_file_round_trips_and_a_changed_file_is_named(tmp_path: Path) -> None:
    from ddp_rank.data.features.whitening import WHITENING_FILE, WhiteningRecord

    whitening, _ = fit_whitening([correlated(500, 5)], dim=4)
    digest = whitening.save(tmp_path / WHITENING_FILE)
    record = WhiteningRecord(WHITENING_FILE, digest, 5, "train", 1e-4, "src")
    loaded = load_whitening(str(tmp_path), record)
    assert np.array_equal(loaded.mean, whitening.mean)
    assert np.array_equal(loaded.projection, whitening.projection)
    data = bytearray((tmp_path / WHITENING_FILE).read_bytes())
    data[-1] ^= 1
    (tmp_path / WHITENING_FILE).write_bytes(bytes(data))
    with pytest.raises(WhiteningError, match="was changed or damaged; restore it, or whiten the feature shards"):
        load_whitening(str(tmp_path), record)
    (tmp_path / WHITENING_FILE).unlink()
    with pytest.raises(WhiteningError, match=r"cannot be read .*`ddp-rank shards whiten`"):
        load_whitening(str(tmp_path), record)


def whiten_cmd(src: Path, dst: Path, *extra: str) -> list[str]:
    return ["shards", "whiten", str(src), str(dst), "--dim", str(DIM), "--no-progress", *extra]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("whiten")
    shards = build_tiny_shards(root)
    assert main(features_cmd(shards, root / "feat")) == 0
    assert main(whiten_cmd(root / "feat", root / "white")) == 0
    return {"root": root, "images": shards, "feat": root / "feat", "white": root / "white"}


def test_whitened_shards_mirror_the_source_and_hold_the_map_of_each_vector(built: dict[str, Path]) -> None:
    source, white = Manifest.load(built["feat"]), Manifest.load(built["white"])
    assert {n: s.class_counts for n, s in white.splits.items()} == {
        n: s.class_counts for n, s in source.splits.items()
    }
    assert white.classes == source.classes and white.categories == source.categories
    record, before = feature_record(white), feature_record(source)
    assert record is not None and before is not None and record.whitening is not None
    assert record.dim == DIM and record.whitening.input_dim == before.dim == 128
    assert record.whitening.fitted_on == "train" and record.whitening.source == str(built["feat"])
    assert record.weights_digest == before.weights_digest and record.backbone == before.backbone
    assert verify_shards(str(built["white"]), workers=1) == []
    whitening = load_whitening(str(built["white"]), record.whitening)
    raw, out = stored(built["feat"]), stored(built["white"])
    assert set(raw) == set(out)
    for key, (vector, meta) in raw.items():
        expected = whitening.apply(vector[None])[0].astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(out[key][0], expected)
        assert out[key][1] == meta
    # Fitted on the training split: there the kept axes are centred, uncorrelated and of unit variance.
    train = Manifest.load(built["feat"]).splits["train"].class_counts
    x = np.stack([raw[k][0] for k in raw if int(k[1:8]) in train])
    refit, _ = fit_whitening([x], dim=DIM)
    w = refit.apply(x)
    np.testing.assert_allclose(w.mean(0), 0, atol=1e-3)
    np.testing.assert_allclose(np.cov(w, rowvar=False), np.eye(DIM), atol=1e-3)
    np.testing.assert_allclose(np.abs(refit.projection), np.abs(whitening.projection), rtol=1e-3, atol=1e-6)


KILL_AFTER_ONE_SHARD = """
import os, signal, sys
from ddp_rank.eval.features.whiten import WhitenOptions, whiten_feature_shards
whiten_feature_shards(sys.argv[1], sys.argv[2], WhitenOptions(dim=int(sys.argv[3]), progress=False),
                      on_shard=lambda info: os.kill(os.getpid(), signal.SIGKILL))
"""


@pytest.mark.slow
def test_a_killed_whitening_resumes_with_its_map_and_keeps_its_shards(
    built: dict[str, Path], tmp_path: Path
) -> None:
    dst = tmp_path / "white"
    cmd = [sys.executable, "-c", KILL_AFTER_ONE_SHARD, str(built["feat"]), str(dst), str(DIM)]
    proc = subprocess.run(cmd, env={**cpu_env(), "PYTHONPATH": str(REPO)}, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (dst / "manifest.json").exists() and not (dst / "whitening.safetensors").exists()
    (record,) = (dst / ".features-build").glob("*.tar.json")
    first = dst / record.name.removesuffix(".json").replace("__", "/")
    before = first.stat().st_mtime_ns, first.stat().st_ino
    # The map is kept for the resume: fitted again with another thread count, it could round differently.
    fitted = (dst / ".features-build" / "whitening.safetensors").read_bytes()
    assert main(whiten_cmd(built["feat"], dst, "--dim", "4")) == 2  # another map: refused, not mixed in
    assert main(whiten_cmd(built["feat"], dst)) == 0
    assert (first.stat().st_mtime_ns, first.stat().st_ino) == before
    assert Manifest.load(dst).splits == Manifest.load(built["white"]).splits
    assert (dst / "whitening.safetensors").read_bytes() == fitted
    assert not (dst / ".features-build").exists()
    assert main(whiten_cmd(built["feat"], dst)) == 2  # finished: not built twice without --overwrite


def test_bad_sources_and_settings_get_one_line(built: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    commands = [
        (whiten_cmd(built["images"], tmp_path / "a"), "holds images, not feature vectors"),
        (whiten_cmd(built["white"], tmp_path / "b"), "is whitened already"),
        (whiten_cmd(built["feat"], tmp_path / "c", "--dim", "129"), "--dim must be between 1 and"),
        (whiten_cmd(built["feat"], tmp_path / "d", "--split", "val"), "--split val is not a split"),
        (whiten_cmd(built["feat"], tmp_path / "e", "--shrinkage", "-1"), "--shrinkage must be"),
        (whiten_cmd(built["feat"], built["feat"]), "is SRC: write the new shards to another"),
        (whiten_cmd(built["feat"], built["white"]), "already holds a finished shard set"),
    ]
    for command, message in commands:
        capsys.readouterr()
        assert main(command) == 2
        captured = capsys.readouterr()
        assert message in captured.err and "Traceback" not in captured.err
    for name in "abcde":
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())
    # Every axis of 128 values from 48 vectors: the covariance spans too few dimensions, and the error says so.
    capsys.readouterr()
    assert main(["shards", "whiten", str(built["feat"]), str(tmp_path / "f"), "--shrinkage", "0"]) == 2
    assert "pass --dim" in capsys.readouterr().err


def test_an_image_goes_through_the_backbone_then_the_map_as_the_shards_were_made(
    built: dict[str, Path], tmp_path: Path
) -> None:
    from ddp_rank.eval.features.images import image_data, image_model

    cfg = load_config(None, [*HEAD, f"data.shards={built['white']}"])
    record = feature_record(Manifest.load(built["white"]))
    assert record is not None
    head = FeatureHeadNet(DIM, 16)
    inputs: list[torch.Tensor] = []
    head.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))  # what the shards hold
    net = image_model(record, str(built["white"]), head)
    samples = stored(built["white"])
    with torch.no_grad():
        net(source_batch(samples, image_data(cfg.data, record)))
    vectors = inputs[0].numpy()
    expected = np.stack([v for v, _ in samples.values()])
    # float16 rounding of the backbone's output may land one step apart; the map scales that step up.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(vectors, expected, atol=2e-2 * scale)
    assert np.mean(np.abs(vectors - expected) < 1e-3 * scale) > 0.95
    # A damaged map is named, with the fix, before any image is embedded.
    broken = tmp_path / "white"
    shutil.copytree(built["white"], broken)
    (broken / "whitening.safetensors").write_bytes(b"not the map")
    with pytest.raises(ConfigError, match=r"whitening.safetensors: sha256 .* restore it, or whiten"):
        image_model(record, str(broken), FeatureHeadNet(DIM, 16))
    (problem,) = verify_shards(str(broken), workers=1)  # and `shards verify` finds it
    assert problem.shard == "whitening.safetensors" and "was changed or damaged" in problem.message


@pytest.mark.slow
def test_a_head_trains_on_whitened_shards_and_a_malformed_record_is_refused(
    built: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    run = tmp_path / "run"
    cfg = load_config(
        None, [*HEAD, f"data.shards={built['white']}", f"train.output_dir={run}", "train.steps=2"]
    )
    run_training(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2]
    broken = tmp_path / "broken"
    shutil.copytree(built["white"], broken)
    raw = json.loads((broken / "manifest.json").read_text())
    raw["build"]["features"]["whitening"]["input_dim"] = "many"
    (broken / "manifest.json").write_text(json.dumps(raw))
    capsys.readouterr()
    assert main(["plan", *HEAD, f"data.shards={broken}"]) != 0
    captured = capsys.readouterr()
    assert "build.features.whitening.input_dim must be a positive integer" in captured.err + captured.out


def test_a_record_naming_a_file_outside_the_shard_root_is_refused() -> None:
    from ddp_rank.data.features.whitening import WhiteningRecord

    good = {"file": "whitening.safetensors", "sha256": "ab", "input_dim": 4, "fitted_on": "train",
            "shrinkage": 0.0, "source": "feat"}  # fmt: skip
    assert WhiteningRecord.from_json(good, "w").file == "whitening.safetensors"
    for name in ("../whitening.safetensors", "sub/w.safetensors", "..\\w.safetensors", ".."):
        with pytest.raises(ValueError, match="must be a file name in the shard set's root"):
            WhiteningRecord.from_json({**good, "file": name}, "w")
    with pytest.raises(ValueError, match="unknown field"):
        WhiteningRecord.from_json({**good, "extra": 1}, "w")


def test_the_map_runs_in_float32_under_the_callers_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """``search`` may embed under the run's autocast: the backbone follows it, the map does not (the build
    computed it in float32), so the head sees the vectors the shards hold."""
    import ddp_rank.model.feature_head as feature_head
    from ddp_rank.model.feature_head import ImageFeatureNet

    whitening, _ = fit_whitening([correlated(400, 12)], dim=6)
    monkeypatch.setattr(feature_head, "image_features", lambda backbone, x: x)  # vectors in, as the backbone's
    head = FeatureHeadNet(6, 4)
    seen: list[torch.Tensor] = []
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    maps = (torch.from_numpy(whitening.mean), torch.from_numpy(whitening.projection))
    net = ImageFeatureNet(FeatureHeadNet(12, 4), head, None, maps)
    x = torch.from_numpy(correlated(8, 12, seed=1)).to(torch.float16).float()
    with torch.no_grad():
        net(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(x)
    expected = whitening.apply(x.numpy()).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(seen[0].numpy(), expected)
    np.testing.assert_array_equal(seen[1].numpy(), expected)
