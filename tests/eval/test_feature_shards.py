"""`ddp-rank shards features` end to end on tiny image shards: the build (against the backbone run by hand; also
EfficientNet-Lite0 cut at output stride 16 with its map kept whole, against the whole network's block 10), images
embedded through the backbone rebuilt from the record, resume after a kill, the same shards from two ranks,
training a head (against one autograd step by hand), evaluation (against brute force), search of an image file,
and the refusal of shards without a backbone record."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.config import ModelConfig, load_config
from ddp_rank.data.features.records import feature_record
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.model import build_model
from ddp_rank.model.feature_head import FeatureHeadNet, image_features, weights_digest
from ddp_rank.runtime.data_setup import schedule_config
from ddp_rank.train.setup import build_loss
from ddp_rank.train.trainer import run_training
from tests.helpers.training import REPO, TINY_OVERRIDES, build_tiny_shards, cpu_env, final_weights, launch

HEAD = [*TINY_OVERRIDES, "model.backbone=features"]


def features_cmd(src: Path, dst: Path, *extra: str) -> list[str]:
    return ["shards", "features", str(src), str(dst), *TINY_OVERRIDES, "--no-progress", *extra]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("features")
    shards = build_tiny_shards(root)
    assert main(features_cmd(shards, root / "feat")) == 0
    return {"root": root, "images": shards, "feat": root / "feat"}


def stored(shards: Path) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
    """key -> (vector, json) of every sample, read with tarfile and numpy alone."""
    parts: dict[str, dict[str, bytes]] = {}
    for tar in sorted(shards.glob("*/*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                parts.setdefault(key, {})[ext] = tf.extractfile(m).read()  # type: ignore[union-attr]
    return {
        k: (np.frombuffer(p["f16"], dtype="<f2").astype(np.float32), json.loads(p["json"]))
        for k, p in parts.items()
    }


def test_build_mirrors_the_source_and_stores_the_backbone_output(built: dict[str, Path]) -> None:
    src, feat = Manifest.load(built["images"]), Manifest.load(built["feat"])
    assert feat.categories == src.categories and feat.classes == src.classes
    assert sorted(feat.splits) == sorted(src.splits)
    for name, split in src.splits.items():
        assert feat.splits[name].class_counts == split.class_counts
        assert [(s.path, [tuple(c) for c in s.classes]) for s in feat.splits[name].shards] == [
            (s.path, [tuple(c) for c in s.classes]) for s in split.shards
        ]
    # The backbone by hand: tiny_cnn under train.seed, its head's input captured by a hook.
    cfg = load_config(None, TINY_OVERRIDES)
    torch.manual_seed(cfg.train.seed)
    net = build_model(cfg.model, 16).eval()
    record = feature_record(feat)
    assert record is not None and record.backbone == "tiny_cnn" and record.dim == net.head.in_features
    assert record.weights_digest == weights_digest(net.backbone)
    assert record.transform == {"crop": "random_resized", "resize_size": 16, "image_size": 16}
    captured: list[torch.Tensor] = []
    net.head.register_forward_hook(lambda _m, args, _out: captured.append(args[0]))
    samples = stored(built["feat"])
    assert len(samples) == 72
    for vector, meta in samples.values():
        pixels = np.array(Image.open(meta["source"]).convert("RGB"))  # 16 px: the eval crop is the image
        with torch.no_grad():
            net(torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255)
        expected = captured.pop().numpy()[0].astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(vector, expected, rtol=2e-3, atol=2e-3)
    assert main(["shards", "verify", str(built["feat"])]) == 0


GRID = [
    "model.backbone=efficientnet_lite0",
    "model.weights=none",
    "model.output_stride=16",
    "model.pooling=grid",
    "data.image_size=32",  # the 16 px images resized: a 2 x 2 map at stride 16
    "data.resize_size=32",
]
"""A build whose record differs from the default in every new field: Lite0 cut at stride 16, its map flattened."""


@pytest.fixture(scope="module")
def built_grid(built: dict[str, Path]) -> Path:
    pytest.importorskip("efficientnet_lite_pytorch")
    dst = built["root"] / "feat-grid"
    assert main(features_cmd(built["images"], dst, *GRID)) == 0
    return dst


def source_batch(samples: dict[str, tuple[np.ndarray, dict[str, Any]]], data: Any) -> torch.Tensor:
    """Every sample's source image through the evaluation transform of ``data`` (pixels in [0, 1])."""
    from ddp_rank.data.reading.transforms import transform_from_config
    from ddp_rank.eval.sources import pil_batch

    images = [Image.open(meta["source"]) for _, meta in samples.values()]
    return pil_batch(images, transform_from_config(data))


def test_a_stride_16_grid_build_stores_the_full_networks_block_10_map(built_grid: Path) -> None:
    record = feature_record(Manifest.load(built_grid))
    assert record is not None
    assert (record.backbone, record.pooling, record.output_stride) == ("efficientnet_lite0", "grid", 16)
    assert record.dim == 112 * 2 * 2 and record.transform["image_size"] == 32
    raw = json.loads((built_grid / "manifest.json").read_text())["build"]["features"]
    assert raw["output_stride"] == 16 and raw["pooling"] == "grid"
    # By hand: the WHOLE Lite0 under train.seed, the output of its last stride-16 block (10) taken by a hook.
    cfg = load_config(None, [*TINY_OVERRIDES, *GRID])
    torch.manual_seed(cfg.train.seed)
    full = build_model(ModelConfig(backbone="efficientnet_lite0", weights="none"), 32).eval()
    captured: list[torch.Tensor] = []
    full.backbone.net._blocks[10].register_forward_hook(lambda _m, _args, out: captured.append(out))
    samples = stored(built_grid)
    assert len(samples) == 72
    with torch.no_grad():
        full.backbone(source_batch(samples, cfg.data) * 2 - 1)  # Lite0 takes inputs in [-1, 1]
    (block10,) = captured
    assert block10.shape == (72, 112, 2, 2)
    expected = block10.permute(0, 2, 3, 1).reshape(72, -1).numpy().astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(np.stack([v for v, _ in samples.values()]), expected, rtol=2e-3, atol=2e-3)
    assert main(["shards", "verify", str(built_grid)]) == 0


@pytest.mark.parametrize("which", ["default", "stride_16_grid"])
def test_an_image_is_embedded_by_the_recorded_backbone_as_the_build_did(
    built: dict[str, Path], which: str, request: pytest.FixtureRequest
) -> None:
    """``image_model`` (search queries, ``export --images``) rebuilds the backbone from the record alone: the
    head's config names none of it (tiny_cnn at 16 px here), yet each source image gives its stored vector."""
    from ddp_rank.eval.features.images import image_data, image_model

    shards = built["feat"] if which == "default" else request.getfixturevalue("built_grid")
    record = feature_record(Manifest.load(shards))
    assert record is not None
    cfg = load_config(None, [*HEAD, f"data.shards={shards}"])
    net = image_model(record, str(shards), FeatureHeadNet(record.dim, 16))
    assert net.backbone.head.in_features == record.dim
    samples = stored(shards)
    with torch.no_grad():
        vectors = image_features(net.backbone, source_batch(samples, image_data(cfg.data, record)))
    rounded = vectors.to(torch.float16).float().numpy()  # as ImageFeatureNet hands them to the head
    np.testing.assert_allclose(rounded, np.stack([v for v, _ in samples.values()]), rtol=2e-3, atol=2e-3)


KILL_AFTER_ONE_SHARD = """
import os, signal, sys
from ddp_rank.config import load_config
from ddp_rank.eval.features.build import FeatureBuildOptions, build_feature_shards
from ddp_rank.runtime import make_accelerator
cfg = load_config(None, sys.argv[3:])
acc = make_accelerator(cfg)
build_feature_shards(cfg.model, cfg.data, cfg.train.seed, sys.argv[1], sys.argv[2], acc,
                     FeatureBuildOptions(progress=False),
                     on_shard=lambda info: os.kill(os.getpid(), signal.SIGKILL))
"""


@pytest.mark.slow
def test_a_killed_build_resumes_and_keeps_what_it_wrote(built: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "feat"
    cmd = [sys.executable, "-c", KILL_AFTER_ONE_SHARD, str(built["images"]), str(dst), *TINY_OVERRIDES]
    proc = subprocess.run(cmd, env={**cpu_env(), "PYTHONPATH": str(REPO)}, capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (dst / "manifest.json").exists()
    records = list((dst / ".features-build").glob("*.tar.json"))
    assert len(records) == 1
    first = dst / records[0].name.removesuffix(".json").replace("__", "/")
    before = first.stat().st_mtime_ns, first.stat().st_ino
    # Another transform into the unfinished build is refused; the same config finishes it.
    assert main(features_cmd(built["images"], dst, "data.image_size=12")) == 2
    assert main(features_cmd(built["images"], dst)) == 0
    assert (first.stat().st_mtime_ns, first.stat().st_ino) == before  # kept, not written again
    assert not (dst / ".features-build").exists()
    whole = Manifest.load(built["feat"]).splits
    resumed = Manifest.load(dst).splits
    assert {n: s.shards for n, s in resumed.items()} == {n: s.shards for n, s in whole.items()}
    assert main(features_cmd(built["images"], dst)) == 2  # finished: not built twice without --overwrite


def test_an_unfinished_build_from_before_output_stride_resumes(
    built: dict[str, Path], tmp_path: Path
) -> None:
    """Its build.json holds no output_stride: the whole network (32), as this config's, so the build goes on."""
    from ddp_rank.eval.features.build import PROGRESS_DIR

    older = json.loads((built["feat"] / "manifest.json").read_text())["build"]["features"]
    del older["output_stride"]
    dst = tmp_path / "feat"
    (dst / PROGRESS_DIR).mkdir(parents=True)
    (dst / PROGRESS_DIR / "build.json").write_text(json.dumps(older))
    assert main(features_cmd(built["images"], dst)) == 0
    assert feature_record(Manifest.load(dst)) == feature_record(Manifest.load(built["feat"]))
    assert Manifest.load(dst).splits == Manifest.load(built["feat"]).splits


@pytest.mark.slow
def test_two_ranks_share_the_build_and_write_the_same_shards(built: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "feat2"
    proc = launch(*features_cmd(built["images"], dst))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Manifest.load(dst).splits == Manifest.load(built["feat"]).splits  # byte for byte (sha256, spans)


@pytest.mark.slow
def test_one_training_step_of_the_head_matches_autograd_by_hand(
    built: dict[str, Path], tmp_path: Path
) -> None:
    overrides = [*HEAD, f"data.shards={built['feat']}", f"train.output_dir={tmp_path / 'run'}", "train.steps=1",
                 "model.head_hidden=8", "optim.name=sgd", "optim.momentum=0", "optim.lr=0.5",
                 "optim.head_lr_mult=1", "optim.grad_clip=0", "optim.warmup_steps=0", "train.log_every=1"]  # fmt: skip
    cfg = load_config(None, overrides)
    run_training(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [r for r in records if r["kind"] == "train"]
    assert logged["lr_head"] == 0.5 and "lr_backbone" not in logged  # a head alone: no backbone's rate to log
    torch.manual_seed(cfg.train.seed)
    net = FeatureHeadNet(128, 16, hidden=8)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    schedule = schedule_config(cfg.data, Manifest.load(built["feat"]), cfg.data_seed)
    stream = ShardStream(built["feat"], 16, schedule=schedule, rank=0, world_size=1)
    batch = stream.batch(0, 0)
    build_loss(cfg.loss)(net(batch.images), batch.labels).backward()
    after = final_weights(tmp_path / "run")
    assert set(after) == {f"head.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")}
    moved = 0.0
    for name, p in net.named_parameters():
        expected = before[name] - 0.5 * p.grad
        torch.testing.assert_close(after[name], expected, rtol=1e-4, atol=1e-6)
        moved += float((expected - before[name]).abs().max())
    assert moved > 1e-4  # the step did something


def test_raw_feature_recall_matches_brute_force(built: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    args = ["eval", *HEAD, f"data.shards={built['feat']}", "--baseline", "raw-pixels", "--output", str(out)]
    assert main(args) == 0
    metrics = json.loads(out.read_text())["raw features"]["metrics"]
    test = Manifest.load(built["feat"]).splits["test"].class_counts
    rows = [(v, int(k[1:8])) for k, (v, _) in sorted(stored(built["feat"]).items()) if int(k[1:8]) in test]
    e = np.stack([v / np.linalg.norm(v) for v, _ in rows])
    labels = np.array([c for _, c in rows])
    s = e @ e.T
    np.fill_diagonal(s, -np.inf)
    assert metrics["recall@1"] == pytest.approx(float(np.mean(labels[s.argmax(1)] == labels)))


@pytest.mark.slow
def test_search_of_an_image_file_runs_the_recorded_backbone_then_the_head(
    built: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("faiss")
    from ddp_rank.eval.export import load_export
    from ddp_rank.eval.search import Searcher

    run = tmp_path / "run"
    run_training(
        load_config(None, [*HEAD, f"data.shards={built['feat']}", f"train.output_dir={run}", "train.steps=2"])
    )
    assert main(["export", "--checkpoint", str(run), "--output", str(tmp_path / "export")]) == 0
    assert main(["index", str(tmp_path / "export"), "--output", str(tmp_path / "index")]) == 0
    export = load_export(tmp_path / "export")
    key = str(export.keys[5])
    image = stored(built["feat"])[key][1]["source"]
    searcher = Searcher.from_index(tmp_path / "index", device="cpu")
    query = searcher.embed([Image.open(image).convert("RGB")])[0]
    np.testing.assert_allclose(query, export.embeddings[5], atol=2e-3)
    capsys.readouterr()
    assert main(["search", str(tmp_path / "index"), image, "-k", "1"]) == 0
    assert key in capsys.readouterr().out.splitlines()[1]
    # export --images: the image folder through the recorded backbone and the head, row for row as the split
    folder = tmp_path / "export-images"
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(run),
                "--images",
                str(built["root"] / "images"),
                "--output",
                str(folder),
            ]
        )
        == 0
    )
    by_path = {
        str(built["root"] / "images" / k): row
        for k, row in zip(load_export(folder).keys, load_export(folder).embeddings)
    }
    samples = stored(built["feat"])
    for k, row in zip(export.keys, export.embeddings):
        np.testing.assert_allclose(by_path[samples[str(k)][1]["source"]], row, atol=2e-3)


def test_image_shards_are_refused_for_a_feature_head(
    built: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    shards = f"data.shards={built['images']}"
    for command in (["train", *HEAD, shards, f"train.output_dir={tmp_path}"], ["plan", *HEAD, shards]):
        capsys.readouterr()
        assert main(command) != 0
        err = capsys.readouterr().err.strip()
        assert "manifest.json has no build.features record" in err + capsys.readouterr().out
        assert "Traceback" not in err


def test_a_malformed_record_and_bad_build_input_get_one_line(
    built: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(built["feat"], broken)
    raw = json.loads((broken / "manifest.json").read_text())
    del raw["build"]["features"]["weights_digest"]
    (broken / "manifest.json").write_text(json.dumps(raw))
    commands = [
        (["plan", *HEAD, f"data.shards={broken}"], "build.features.weights_digest is missing"),
        (features_cmd(tmp_path / "nope", tmp_path / "out"), "manifest.json not found"),
        (features_cmd(built["feat"], tmp_path / "out"), "holds feature vectors already"),
        ([*features_cmd(built["images"], tmp_path / "out"), "model.backbone=features"], "no image backbone"),
    ]
    for command, message in commands:
        capsys.readouterr()
        assert main(command) != 0
        captured = capsys.readouterr()
        assert message in captured.err + captured.out
        assert "Traceback" not in captured.err


def test_an_image_that_does_not_decode_stops_the_build_by_name(tmp_path: Path, capsys: Any) -> None:
    """A feature shard holds every sample of its source: a bomb among the images stops the build, in one line
    that names the sample, before any pixel of it is decoded."""
    import io

    import webdataset as wds
    from PIL import Image

    from ddp_rank.data.building.shard_index import IndexOptions, find_splits, index_shards
    from tests.helpers.image_fuzz import png_bomb

    src = tmp_path / "src"
    src.mkdir()
    with wds.TarWriter(str(src / "part-00000.tar")) as sink:
        for c in range(3):
            for n in range(3):
                buf = io.BytesIO()
                Image.new("RGB", (16, 16), (40 * c, 90, 30 * n)).save(buf, format="PNG")
                image = png_bomb(20000, 20000) if (c, n) == (1, 2) else buf.getvalue()
                sink.write({"__key__": f"k{c}_{n}", "png": image})
    index_shards(src, find_splits(src, []), IndexOptions(class_from_key="_")).manifest.save(src)
    assert main(features_cmd(src, tmp_path / "feat")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "image k1_2.png does not decode: 20000 x 20000 = 400,000,000 pixels is over the limit" in err[0]
    assert "ddp-rank shards verify" in err[0]
