"""Atomic checkpoints: a kill at any moment leaves the last good one; keep last K + best; resume checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ddp_rank.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    atomic_write_text,
    check_world_size,
    load_model_weights,
    read_meta,
    resolve_checkpoint,
)


def writer(value: int):
    def save(directory: Path) -> None:
        (directory / "state.txt").write_text(str(value))

    return save


def test_save_latest_and_rotation(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    assert m.latest() is None
    for step in (10, 20, 30, 40):
        path = m.save(step, {"world_size": 1}, writer(step))
        assert read_meta(path)["step"] == step
    assert [s for s, _ in m.complete()] == [30, 40]
    assert (m.latest() / "state.txt").read_text() == "40"
    assert not [p for p in m.root.iterdir() if p.name.startswith(".tmp")]


def test_best_is_kept_beyond_keep_last(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save(1, {}, writer(1))
    m.mark_best(1, "recall@1", 0.5)
    for step in (2, 3, 4):
        m.save(step, {}, writer(step))
    assert [s for s, _ in m.complete()] == [1, 4]
    assert m.best() == {"step": 1, "metric": "recall@1", "value": 0.5, "path": "step-00000001"}
    assert resolve_checkpoint(tmp_path) == m.path_for(1)  # a run's best is preferred
    assert resolve_checkpoint(tmp_path, prefer="latest") == m.path_for(4)
    assert resolve_checkpoint(m.path_for(4)) == m.path_for(4)


def test_failed_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=3)
    m.save(5, {}, writer(5))

    def crash(directory: Path) -> None:
        (directory / "state.txt").write_text("half")
        raise KeyboardInterrupt  # stands for a kill in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        m.save(6, {}, crash)
    assert m.latest() == m.path_for(5)  # the half-written one does not count
    assert (tmp_path / ".tmp-step-00000006").exists()
    removed = m.cleanup_partial()
    assert [p.name for p in removed] == [".tmp-step-00000006"]
    assert m.save(6, {}, writer(6)) == m.path_for(6)


def test_existing_step_is_not_rewritten(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path)
    m.save(3, {}, writer(3))
    m.save(3, {}, writer(99))
    assert (m.path_for(3) / "state.txt").read_text() == "3"


def test_sigkill_during_save_keeps_last_good(tmp_path: Path) -> None:
    """A real SIGKILL while a (slow) checkpoint is being written: the previous one stays complete."""
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ddp_rank.train.checkpoint import CheckpointManager
        m = CheckpointManager({str(tmp_path)!r}, keep_last=5)
        m.save(1, {{}}, lambda d: (d / "w.bin").write_bytes(b"x" * 1000))
        def slow(d):
            for i in range(200):
                (d / f"part{{i}}.bin").write_bytes(b"y" * 1000)
                time.sleep(0.01)
        print("saving", flush=True)
        m.save(2, {{}}, slow)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    m = CheckpointManager(tmp_path)
    assert m.latest() == m.path_for(1)
    assert [s for s, _ in m.complete()] == [1]


def test_world_size_check() -> None:
    check_world_size({"world_size": 2}, 2, force=False)
    check_world_size({"world_size": 2}, 4, force=True)
    with pytest.raises(
        CheckpointError, match=r"written by 2 process\(es\) but this run has 4.*force_resume=true"
    ):
        check_world_size({"world_size": 2}, 4, force=False)


def test_read_meta_of_incomplete_dir(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        read_meta(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)


def test_atomic_write_text(tmp_path: Path) -> None:
    p = tmp_path / "a" / "b.json"
    atomic_write_text(p, json.dumps({"x": 1}))
    atomic_write_text(p, json.dumps({"x": 2}))
    assert json.loads(p.read_text()) == {"x": 2}
    assert sorted(os.listdir(p.parent)) == ["b.json"]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_write_text_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    """A run's files get the mode a plain write gives them, not mkstemp's owner-only 0600."""
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "config.yaml", "a: 1\n")
    finally:
        os.umask(old)
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == mode


def test_load_model_weights_strips_ddp_prefix(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src, dst = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    save_file({f"module.{k}": v for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    load_model_weights(dst, tmp_path)
    torch.testing.assert_close(dst.weight, src.weight)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_model_weights(torch.nn.Linear(3, 5, bias=False), tmp_path)
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model_weights(dst, tmp_path / "empty")
