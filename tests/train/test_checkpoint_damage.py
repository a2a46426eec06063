"""Damaged checkpoints: every file is checked against the record in ``meta.json`` before a parser sees it; a
resume continues from the newest intact checkpoint, ``eval`` / ``export`` name the damaged file, and ``run.json``
keeps the finished run's record."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.model.checkpoint_read import (
    FILES_KEY,
    META_NAME,
    CheckpointError,
    checkpoint_problem,
    newest_intact_checkpoint,
    verify_checkpoint,
)
from ddp_rank.train.trainer import run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

# Tests of seconds (training runs, damaged and resumed): in make test, out of make test-fast.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


def overrides(shards: Path, out: Path, steps: int) -> list[str]:
    # BatchNorm in train mode, as these runs were written for: the tests rely on the run's best being step 4.
    return [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}", f"train.steps={steps}",
            "train.checkpoint_every=2", "train.keep_last=3", "model.freeze_bn=never"]  # fmt: skip


@pytest.fixture(scope="module")
def finished(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2, 3 (the epoch's end) and 4 (tests damage a copy)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_training(load_config(None, overrides(shards, out, 4)))
    return out


@pytest.fixture()
def run(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


PREVIOUS = 3  # the checkpoint before the latest (step 4)


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_meta_json_records_every_file_of_the_checkpoint(finished: Path) -> None:
    from ddp_rank.file_checks import file_digest

    latest = ckpt(finished, 4)
    files = json.loads((latest / META_NAME).read_text())[FILES_KEY]
    on_disk = sorted(p.name for p in latest.iterdir() if p.name != META_NAME)
    assert sorted(files) == on_disk and "model.safetensors" in files and "optimizer.bin" in files
    for name, record in files.items():
        assert record == file_digest(latest / name), name
    assert checkpoint_problem(latest) is None


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("truncate model.safetensors", "model.safetensors has"),
        ("truncate optimizer.bin", "optimizer.bin has"),
        ("delete optimizer.bin", "optimizer.bin is missing"),
        ("flip model.safetensors", "model.safetensors does not match the SHA-256"),
    ],
)
def test_resume_skips_a_damaged_latest_checkpoint(
    shards: Path, run: Path, damage: str, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    action, name = damage.split()
    target = ckpt(run, 4) / name
    if action == "truncate":
        truncate(target)
    elif action == "delete":
        target.unlink()
    else:  # flipped bits in the last tensor's data: only the digest tells
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
    assert problem in (checkpoint_problem(ckpt(run, 4)) or "")
    summary = run_training(load_config(None, overrides(shards, run, 6)))
    assert summary["resumed_from"] == str(ckpt(run, PREVIOUS)) and summary["steps"] == 6
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and problem in said[0] and f"continuing from {ckpt(run, PREVIOUS)}" in said[0]
    assert "\n" not in said[0]
    # The damaged checkpoint went aside with the rewind; the new timeline's checkpoints are intact.
    assert [p.name for p in (run / "checkpoints").glob("abandoned-*/step-00000004")] == ["step-00000004"]
    assert newest_intact_checkpoint(run / "checkpoints") == (ckpt(run, 6), [])
    assert json.loads((run / "run.json").read_text())["steps"] == 6


def test_resume_with_no_intact_checkpoint_is_refused_and_keeps_run_json(
    shards: Path, run: Path, capsys: pytest.CaptureFixture
) -> None:
    before = json.loads((run / "run.json").read_text())
    assert before["status"] == "finished" and before["steps"] == 4
    truncate(ckpt(run, 4) / "model.safetensors")
    for step in (2, 3):
        (ckpt(run, step) / "optimizer.bin").unlink()
    assert main(["train", *overrides(shards, run, 6)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-00000004 is damaged (model.safetensors has" in err[0], err
    assert "no earlier checkpoint of the run is intact" in err[0] and "Traceback" not in err[0]
    assert json.loads((run / "run.json").read_text()) == before, "a refused resume keeps the finished record"


@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_name_the_damaged_file(
    run: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture
) -> None:
    truncate(ckpt(run, 4) / "model.safetensors", keep=0.9)
    args = ["--checkpoint", str(ckpt(run, 4))]
    if command == "export":
        args += ["--output", str(tmp_path / "export")]
    assert main([command, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpoint {ckpt(run, 4)} is damaged: model.safetensors has" in err[0]
    assert f"the newest intact checkpoint of the run is {ckpt(run, PREVIOUS)}" in err[0]
    assert "SafetensorError" not in err[0] and not (tmp_path / "export").exists()


def test_init_from_a_damaged_checkpoint_names_it(run: Path) -> None:
    from ddp_rank.model.init_weights import init_from
    from ddp_rank.model.net import build_model

    cfg = load_config(None, TINY_OVERRIDES)
    (ckpt(run, 4) / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError) as caught:
        init_from(build_model(cfg.model, 16), run)  # the run's best is step 4
    message = str(caught.value)
    assert message.startswith(
        f"model.init_from='{run}': checkpoint {ckpt(run, 4)} is damaged: model.safetensors"
    )
    assert "\n" not in message and f"is {ckpt(run, PREVIOUS)}" in message
    assert init_from(build_model(cfg.model, 16), ckpt(run, PREVIOUS)).loaded


def test_checkpoints_without_a_record_are_checked_by_structure(run: Path) -> None:
    """A checkpoint of an older version (no ``files`` in meta.json): safetensors header against the size, the
    zip directory and CRC-32s of torch files."""
    for step in (2, 3, 4):
        meta = json.loads((ckpt(run, step) / META_NAME).read_text())
        del meta[FILES_KEY]
        (ckpt(run, step) / META_NAME).write_text(json.dumps(meta))
    assert checkpoint_problem(ckpt(run, 4)) is None
    truncate(ckpt(run, 4) / "model.safetensors", keep=0.99)
    assert "where its header describes" in (checkpoint_problem(ckpt(run, 4)) or "")
    for step in (2, 3):
        opt = ckpt(run, step) / "optimizer.bin"
        data = bytearray(opt.read_bytes())
        data[100] ^= 0xFF  # inside the first member's data: the CRC catches it
        opt.write_bytes(bytes(data))
        assert "optimizer.bin is damaged" in (checkpoint_problem(ckpt(run, step)) or "")
    with pytest.raises(CheckpointError, match="no older checkpoint of the run is intact"):
        verify_checkpoint(ckpt(run, 4))


def test_every_file_of_a_run_follows_the_umask(shards: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        run_training(load_config(None, overrides(shards, out, 2)))
    finally:
        os.umask(old)
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert "checkpoints/step-00000002/model.safetensors" in modes
    assert {k: m for k, m in modes.items() if m != 0o644} == {}


def test_a_start_that_fails_before_training_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """No arguments (the default output_dir runs/default, relative to the working directory) or a shard error:
    no run began, so no "crashed" run.json, and nothing else either."""
    monkeypatch.chdir(tmp_path)
    assert main(["train"]) == 2
    assert main(["train", f"data.shards={tmp_path / 'nowhere'}", "model.backbone=tiny_cnn"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 2
    assert list(tmp_path.iterdir()) == []
