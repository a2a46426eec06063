"""Multi-node, simulated on one machine: two ``accelerate launch`` calls with ``--num_machines 2`` (machine ranks 0
and 1 on 127.0.0.1), 2 gloo processes each, train, checkpoint, resume and evaluate exactly like 4 processes on
one node; the run's files are written once, by the global rank 0, and what is node-local (the shard cache, each
machine its own directory) is filled once per node: the shards come over HTTP and the server counts the
downloads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from ddp_rank.data.reading.serve import RangeRequestHandler, serve_directory
from tests.helpers.distributed import run_distributed
from tests.helpers.training import REPO, TINY_OVERRIDES, build_tiny_shards, cpu_env, final_weights, free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 6
# BatchNorm in train mode (as the default was before it became frozen wherever the step may be chunked): with
# frozen, never-updated statistics of a random network, a near-zero gradient (the last BatchNorm's bias) turns the
# all-reduce's rounding, which differs between one node and two, into Adam steps of either sign.
RUN = [*TINY_OVERRIDES, f"train.steps={STEPS}", "train.checkpoint_every=1", "train.keep_last=10",
       "train.eval_every=3", "data.global_batch_size=16", "model.freeze_bn=never"]  # fmt: skip


def launcher(*options: str) -> list[str]:
    """``accelerate launch`` of 4 CPU processes in all with the repository's CPU launcher file."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "launch" / "accelerate_cpu_2proc.yaml"), "--num_processes", "4", *options]  # fmt: skip


def launch_two_machines(*args: str, node_dirs: Path) -> list[subprocess.CompletedProcess[str]]:
    """Both machines' launchers at once (each blocks until the other joins the rendezvous); machine m caches
    shards in ``node_dirs / f"node{m}"``, as on its own local disk."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            launcher(
                *("--num_machines", "2", "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1"),
                *("--main_process_port", port, "-m", "ddp_rank.cli", *args),
                f"data.cache_dir={node_dirs / f'node{machine}'}",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cpu_env(),
            cwd=REPO,
        )
        for machine in (0, 1)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the whole-file GETs the shard server answers (ranged reads and the manifest left out)."""
    seen: list[str] = []

    def log(handler: RangeRequestHandler, format: str, *args: object) -> None:
        if handler.command == "GET" and "Range" not in handler.headers and handler.path.endswith(".tar"):
            seen.append(handler.path)

    monkeypatch.setattr(RangeRequestHandler, "log_message", log)
    return seen


def _train_on_one_node(rank: int, world: int, overrides: list[str]) -> None:
    """One of the reference's 4 ranks: the trainer on the gloo process group of tests.helpers.distributed."""
    from ddp_rank.config import load_config
    from ddp_rank.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()


def test_two_machines_train_resume_and_evaluate_like_one(tmp_path: Path, downloads: list[str]) -> None:
    shards = build_tiny_shards(tmp_path / "data")
    one_node = tmp_path / "one-node"
    # The reference, 4 processes on one node: the trainer in ranks forked from a server that has imported torch
    # (a launcher and 4 torch imports less); the launcher is the two machines' runs' to test.
    run_distributed(
        _train_on_one_node,
        4,
        args=([f"data.shards={shards}", f"train.output_dir={one_node}", *RUN],),
        timeout=400,
    )

    two_nodes = tmp_path / "two-nodes"
    with serve_directory(shards) as url:
        args = ("train", f"data.shards={url}", f"train.output_dir={two_nodes}", *RUN)
        machines = launch_two_machines(*args, node_dirs=tmp_path)
        assert [m.returncode for m in machines] == [0, 0], (
            machines[0].stderr[-2000:] + machines[1].stderr[-2000:]
        )
        # Printed once, by the global rank 0 (on machine 0).
        assert "done: 6 steps" in machines[0].stdout and "done" not in machines[1].stdout
        # A node downloads the shards its ranks read (not the same on both nodes), each once, whichever of its
        # 2 ranks needs it first: as many downloads as shards in the two caches, none fetched thrice.
        cached = [list((tmp_path / node).glob("*.tar")) for node in ("node0", "node1")]
        assert cached[0] and cached[1] and not list(tmp_path.glob("node*/.*.partial"))
        assert len(downloads) == len(cached[0]) + len(cached[1]), downloads
        assert max(Counter(downloads).values()) <= 2, downloads

        # Kill-and-resume, as after a crash at step 3: the later checkpoints are gone; both machines continue
        # from their node caches (no download this time).
        for step in range(4, STEPS + 1):
            shutil.rmtree(two_nodes / "checkpoints" / f"step-{step:08d}")
        (two_nodes / "checkpoints" / "best.json").unlink(missing_ok=True)
        downloads.clear()
        machines = launch_two_machines(*args, node_dirs=tmp_path)
        assert [m.returncode for m in machines] == [0, 0], (
            machines[0].stderr[-2000:] + machines[1].stderr[-2000:]
        )
        assert downloads == []

    a, b = final_weights(one_node), final_weights(two_nodes)
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    meta = json.loads((two_nodes / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 4 and meta["step"] == STEPS

    # One record per step (written by one process), the resumed run's records after step 3 replacing the first's.
    recs = records(two_nodes)
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(1, STEPS + 1))
    evals = {r["step"]: r for r in recs if r["kind"] == "eval"}
    one_evals = {r["step"]: r for r in records(one_node) if r["kind"] == "eval"}
    assert sorted(evals) == sorted(one_evals) == [3, 6]
    for step, metrics in one_evals.items():
        for name, value in metrics.items():
            if name not in ("kind", "step"):
                assert evals[step][name] == pytest.approx(value, abs=1e-6), (step, name)
    assert "4 (MULTI_CPU" in (two_nodes / "summary.md").read_text()
    assert len(list((two_nodes / "config-history").glob("start-*.yaml"))) == 2
