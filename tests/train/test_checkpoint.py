"""Atomic checkpoints: a kill at any moment leaves the last good one; keep last K + best; resume checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.model.checkpoint_read import CheckpointError, load_model_weights, read_meta, resolve_checkpoint
from ddp_rank.train.checkpoints.write import CheckpointManager, check_world_size


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
    removed, set_aside = m.cleanup_partial()
    assert [p.name for p in removed] == [".tmp-step-00000006"] and set_aside == []
    assert m.save(6, {}, writer(6)) == m.path_for(6)


def test_a_step_folder_without_meta_is_moved_aside_never_deleted(tmp_path: Path) -> None:
    """The atomic save never leaves a step-* without meta.json: one that has none (a copy cut short) is not the
    writer's to delete. It goes to incomplete-*/ with every file, out of latest()'s sight; another rank only
    meets the barrier."""
    m = CheckpointManager(tmp_path, keep_last=5)
    m.save(5, {}, writer(5))
    copied = tmp_path / "step-00000009"
    copied.mkdir()
    (copied / "model.safetensors").write_bytes(b"weights somebody copied")
    calls: list[str] = []
    other = CheckpointManager(tmp_path, is_main=False, barrier=lambda: calls.append("barrier"))
    assert other.cleanup_partial() == ([], []) and calls == ["barrier"] and copied.is_dir()
    removed, set_aside = m.cleanup_partial()
    assert removed == [] and [p.name for p in set_aside] == ["step-00000009"]
    (moved,) = set_aside
    assert moved.parent.parent == tmp_path and moved.parent.name.startswith("incomplete-")
    assert (moved / "model.safetensors").read_bytes() == b"weights somebody copied"
    assert not copied.exists() and m.latest() == m.path_for(5)
    m.save(9, {}, writer(9))  # the step can be written again; the copy stays where it was put
    assert m.latest() == m.path_for(9) and moved.is_dir()


def test_existing_step_is_not_rewritten(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path)
    m.save(3, {}, writer(3))
    m.save(3, {}, writer(99))
    assert (m.path_for(3) / "state.txt").read_text() == "3"


@pytest.mark.slow
def test_sigkill_during_save_keeps_last_good(tmp_path: Path) -> None:
    """A real SIGKILL while a (slow) checkpoint is being written: the previous one stays complete."""
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ddp_rank.train.checkpoints.write import CheckpointManager
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


def test_replacing_a_step_survives_a_kill_while_the_old_one_is_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step written again (a rewound run) while an older step-* of that number exists: a kill while the old
    files are deleted must leave the new checkpoint whole, not an old one that lost files but kept meta.json."""
    import ddp_rank.train.checkpoints.write as ck

    def files(tag: str):
        def save(directory: Path) -> None:
            for name in ("model.safetensors", "optimizer.bin"):
                (directory / name).write_text(tag)

        return save

    CheckpointManager(tmp_path).save(7, {"tag": "old"}, files("old"))
    real = shutil.rmtree

    def killed(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.endswith("step-00000007"):
            os.unlink(Path(path) / "model.safetensors")  # the deletion got this far when the process died
            raise SystemExit("killed")
        real(path, *args, **kwargs)

    monkeypatch.setattr(ck.shutil, "rmtree", killed)
    with pytest.raises(SystemExit):
        CheckpointManager(tmp_path).save(7, {"tag": "new"}, files("new"))
    monkeypatch.setattr(ck.shutil, "rmtree", real)
    m = CheckpointManager(tmp_path)
    assert [p.name for p in m.cleanup_partial().removed] == [".tmp-trash-step-00000007"]
    assert read_meta(m.latest())["tag"] == "new"
    assert sorted(os.listdir(m.latest())) == ["meta.json", "model.safetensors", "optimizer.bin"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000007"]


def test_abandon_after_moves_the_later_checkpoints_aside(tmp_path: Path) -> None:
    """A run rewound to step 6: steps 7, 8 and a best.json naming 8 move to abandoned-*/, nothing is deleted,
    the resumed checkpoint's own best becomes best.json again; another rank only meets the barriers."""
    calls: list[str] = []
    m = CheckpointManager(tmp_path, keep_last=5, barrier=lambda: calls.append("barrier"))
    for step in (5, 6, 7, 8):
        m.save(step, {}, writer(step))
    m.mark_best(5, "recall@1", 0.3)
    m.mark_best(8, "recall@1", 0.5)
    calls.clear()
    other = CheckpointManager(tmp_path, is_main=False, barrier=lambda: calls.append("barrier"))
    assert other.abandon_after(6) == (None, []) and [s for s, _ in m.complete()] == [5, 6, 7, 8]
    folder, moved = m.abandon_after(6, best=(5, "recall@1", 0.3))
    assert calls == ["barrier"] * 4
    assert folder is not None and folder.parent == tmp_path and folder.name.startswith("abandoned-")
    assert moved == ["step-00000007", "step-00000008", "best.json"]
    assert sorted(os.listdir(folder)) == ["best.json", "step-00000007", "step-00000008"]
    assert (folder / "step-00000008" / "state.txt").read_text() == "8"
    assert [s for s, _ in m.complete()] == [5, 6] and m.latest() == m.path_for(6)
    assert m.best() == {"step": 5, "metric": "recall@1", "value": 0.3, "path": "step-00000005"}
    assert m.abandon_after(6) == (None, [])  # nothing later any more
    assert m.cleanup_partial() == ([], []) and folder.is_dir()
