"""``ddp-rank train`` refuses shards whose held-out classes are in its training split, before anything is
built, unless the manifest records a protocol that shares classes (``shared_classes``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.train import setup
from tests.helpers.training import TINY_OVERRIDES, check_inputs


def _shards(tmp_path: Path, reason: str | None) -> Path:
    """Two classes of 4 images; class ``cls0_0`` has images in ``train`` and in ``test``: an image-level split.
    With ``reason`` None the manifest is as an earlier version wrote it (no ``shared_classes``)."""
    write_image_folder(tmp_path / "images", [[4, 4]], image_size=8)
    records = read_image_folder(tmp_path / "images")
    records = [replace(r, split="test" if r.path.endswith(("2.png", "3.png")) else "train") for r in records]
    out = tmp_path / "shards"
    build_shards(records, out, BuildOptions(progress=False, shared_classes="closed-set identification"))
    if reason is None:
        data = json.loads((out / "manifest.json").read_text())
        del data["shared_classes"]
        (out / "manifest.json").write_text(json.dumps(data))
    return out


def test_train_refuses_a_leaking_manifest_before_building_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built for shards that leak classes")

    monkeypatch.setattr(setup, "build_model", no_model)
    shards = _shards(tmp_path, None)
    code = main(["train", *TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    line = next(line for line in err.splitlines() if "also in split" in line)
    assert (
        f"data.shards='{shards}': {shards / 'manifest.json'}: 2 classes of split 'train' are also in split 'test' (2)"
        in line
    )
    assert "--test-fraction" in line and "--shared-classes REASON" in line
    assert not (tmp_path / "run").exists()


def test_a_recorded_protocol_lets_the_run_start(tmp_path: Path) -> None:
    shards = _shards(tmp_path, "closed-set identification")
    cfg = load_config(
        None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}"]
    )
    assert check_inputs(cfg).shared_classes == "closed-set identification"
