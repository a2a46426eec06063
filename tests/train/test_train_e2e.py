"""End-to-end on CPU: 2 gloo processes under `accelerate launch` with launch/accelerate_cpu_2proc.yaml.

A direct and a chunked run write checkpoints, metrics, plots and the summary; a run killed with SIGKILL in the
middle resumes from its last complete checkpoint and ends with exactly the parameters of an uninterrupted run. The
chunked run is the direct run's checkpoint continued with the chunked step on 2 processes, which the same
continuation on 1 process must match.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.training import (
    REPO,
    TINY_OVERRIDES,
    accelerate_cmd,
    build_tiny_shards,
    cpu_env,
    final_weights,
    launch,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# Long enough that the killed run is still going when it is killed, after its step 5 (15 steps of margin, each
# with its checkpoint, on a loaded machine); not more: every step of the uninterrupted and the resumed run is paid.
STEPS = 20
RUN = [*TINY_OVERRIDES, f"train.steps={STEPS}", "train.checkpoint_every=1", "train.keep_last=2",
       "train.eval_every=10", "train.eval_at_start=true"]  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny-e2e"))


@pytest.fixture(scope="module")
def uninterrupted(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "uninterrupted"
    proc = launch("train", f"data.shards={shards}", f"train.output_dir={out}", *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_direct_run_writes_everything(uninterrupted: Path) -> None:
    run = uninterrupted
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "recall.png", "summary.md"):
        assert (run / name).is_file(), name
    recs = records(run)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["chunks"] == 1 for r in train)
    assert [r["step"] for r in evals] == [0, STEPS // 2, STEPS]
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert {f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"} <= set(ckpts) and best["path"] in ckpts
    meta = json.loads((run / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == STEPS
    summary = (run / "summary.md").read_text()
    assert "2 (MULTI_CPU" in summary and "16 (8 per rank)" in summary and "![loss](loss.png)" in summary
    assert (
        "0 class(es) replaced, 0 decode error(s), 0 cache fallback(s), 0 read retr(ies), bad shards: none"
        in summary
    )
    data = [r for r in recs if r["kind"] == "data"]
    assert data and data[0]["steps_per_epoch"] == 3 and data[0]["categories_left_out"] == []
    assert all(r["data_replaced_classes"] == 0 and r["data_bad_shards"] == [] for r in train)


def test_killed_run_resumes_to_the_same_parameters(shards: Path, uninterrupted: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    args = ["train", f"data.shards={shards}", f"train.output_dir={out}", *RUN]
    env = cpu_env()
    proc = subprocess.Popen(accelerate_cmd(*args), cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    marker = out / "checkpoints" / "step-00000005" / "meta.json"
    deadline = time.time() + 240
    while not marker.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, wherever they are
    proc.wait()
    killed_at = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    assert killed_at < STEPS, "the run finished before the kill; the test needs a slower run"

    resumed = launch(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in (out / "summary.md").read_text()
    train_steps = [r["step"] for r in records(out) if r["kind"] == "train"]
    assert train_steps == list(range(1, STEPS + 1))  # the killed run's extra lines were dropped
    a, b = final_weights(uninterrupted, STEPS), final_weights(out, STEPS)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)


@pytest.fixture(scope="module")
def continued(shards: Path, uninterrupted: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 2-process checkpoint continued for 2 more steps by 1 process (in this one) and by 2 processes (under
    accelerate launch), both with the chunked step, chunks of 3: two copies of the uninterrupted run, ``one`` and
    ``two``. ``two`` loses its plots and summary first, so that the chunked run writes its own."""
    import shutil

    from ddp_rank.cli import main

    where = tmp_path_factory.mktemp("continued")
    one, two = where / "one", where / "two"
    for copy in (one, two):
        shutil.copytree(uninterrupted, copy)
    for name in ("loss.png", "summary.md"):
        (two / name).unlink()
    # Chunked on both layouts (BatchNorm frozen): batch statistics of 16 vs 2 x 8 images would differ otherwise.
    more = [
        f"data.shards={shards}",
        *RUN,
        f"train.steps={STEPS + 2}",
        "train.eval_every=1000",
        "distributed.chunk_size=3",
    ]
    assert main(["train", f"train.output_dir={one}", *more]) == 0
    proc = launch("train", f"train.output_dir={two}", *more)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"one": one, "two": two}


def test_chunked_run(continued: dict[str, Path]) -> None:
    out = continued["two"]
    train = [r for r in records(out) if r["kind"] == "train"][STEPS:]
    assert [r["step"] for r in train] == [STEPS + 1, STEPS + 2]
    assert [r["chunks"] for r in train] == [3, 3]  # 8 images per rank in chunks of 3, 3, 2
    assert (out / "checkpoints" / f"step-{STEPS + 2:08d}" / "meta.json").is_file()
    assert (out / "loss.png").is_file() and "chunked, chunk 3" in (out / "summary.md").read_text()


def test_a_resume_on_another_world_size_continues_the_same_batches(
    uninterrupted: Path, continued: dict[str, Path]
) -> None:
    """The 2-process checkpoint continued by 1 process and by 2 processes for 2 more steps: the same global
    batches (the data plan does not depend on the world size), so the same weights up to float rounding."""
    one, two = continued["one"], continued["two"]
    meta = json.loads((one / "checkpoints" / f"step-{STEPS + 2:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["step"] == STEPS + 2
    a, b = final_weights(one, STEPS + 2), final_weights(two, STEPS + 2)
    start = final_weights(uninterrupted, STEPS)
    assert any(not torch.equal(a[k], start[k]) for k in a), "the resumed steps changed nothing"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_unreadable_data_stops_every_rank_with_one_message(shards: Path, tmp_path: Path) -> None:
    """Every class of one category corrupt: no replacement left, so both processes exit with the same error
    (not one dying while the other waits in a collective)."""
    import shutil

    from ddp_rank.data.format.manifest import Manifest

    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    for shard in Manifest.load(bad).split("train").shards:
        if shard.category == 0:
            data = bytearray((bad / shard.path).read_bytes())
            for span in shard.classes:
                data[span.offset + 520] ^= 0xFF
            (bad / shard.path).write_bytes(bytes(data))
    t0 = time.monotonic()
    proc = launch("train", f"data.shards={bad}", f"train.output_dir={tmp_path / 'run'}", *RUN, timeout=240)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "ddp-rank train: error: data: rank" in line]
    # Every rank raises the same message (the launcher may stop the second before it prints it).
    assert errors and all(e == errors[0] for e in errors), proc.stderr[-3000:]
    assert "no readable replacement" in errors[0] and "train/train-c0000" in errors[0]
    assert time.monotonic() - t0 < 200
