"""The trainer in one process: steps, state round trip, resume == uninterrupted, clear setup errors."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.model.checkpoint_read import CheckpointError
from ddp_rank.train.trainer import Trainer, TrainError, run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards, check_inputs, final_weights


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


def cfg_for(shards: Path, out: Path, *extra: str):
    return load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}", *extra])


def test_train_step_and_state(shards: Path, tmp_path: Path) -> None:
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "train.steps=3"))
    try:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        result = trainer.train_step()
        assert result.chunks == 1 and 0.0 <= result.loss <= 1.0 and trainer.step == 1
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        state = trainer.state_dict()
        assert state["step"] == 1 and state["world_size"] == 1 and state["global_batch_size"] == 16
        # The data's state is its own: the first batch not trained on, which is the loop's step.
        assert (state["stream"]["epoch"], state["stream"]["step"]) == divmod(1, trainer.steps_per_epoch)
        position = dict(zip(("epoch", "step"), divmod(2, trainer.steps_per_epoch)))
        trainer.load_state_dict(state | {"step": 2, "stream": {**state["stream"], **position}})
        assert trainer.step == 2 and trainer.stream.position == divmod(2, trainer.steps_per_epoch)
    finally:
        trainer.close()


def test_the_feed_reads_ahead_but_positions_are_those_trained(shards: Path, tmp_path: Path) -> None:
    """The device feed holds the next batch; the stream's position (what a checkpoint saves) must not run ahead,
    across an epoch's end too. The stream hands out uint8 pixels (the model scales them on its device)."""
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "train.steps=9"))
    try:
        per_epoch = trainer.steps_per_epoch
        seen = []
        for k in range(per_epoch + 2):
            batch = trainer.batches.next()
            assert batch.images.dtype == torch.uint8
            seen.append((batch.epoch, batch.step))
            assert trainer.stream.position == divmod(k + 1, per_epoch)
        assert seen == [divmod(k, per_epoch) for k in range(per_epoch + 2)]
    finally:
        trainer.close()


def test_resume_refuses_a_changed_data_schedule_unless_forced(shards: Path, tmp_path: Path) -> None:
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "train.steps=3"))
    try:
        state = trainer.state_dict()
        with pytest.raises(CheckpointError, match="seed: 7 -> 0"):
            trainer.load_state_dict(state | {"stream": {**state["stream"], "seed": 7}})
        # The layout is not part of the schedule: another worker count (or world size) continues the sequence.
        trainer.load_state_dict(state | {"stream": {**state["stream"], "step": 1, "num_workers": 3}})
        assert trainer.stream.position == divmod(1, trainer.steps_per_epoch)
        # The trainer reads the train section it was started with (frozen: a forced resume is another section).
        forced = trainer.settings.train.replaced(force_resume=True)
        trainer.settings = dataclasses.replace(trainer.settings, train=forced)
        trainer.load_state_dict(
            state | {"step": 2, "stream": {**state["stream"], "step": 2, "seed": 7, "num_workers": 3}}
        )
        assert trainer.stream.position == divmod(2, trainer.steps_per_epoch)
        # Forced with another epoch length: the position counts the saved epochs' steps, as many are skipped.
        length = trainer.steps_per_epoch
        saved = {**state["stream"], "epoch": 1, "step": 2, "steps_per_epoch": length + 2}
        trainer.load_state_dict(state | {"step": length + 4, "stream": saved})
        assert trainer.stream.position == divmod(length + 4, length)
    finally:
        trainer.close()


def test_a_state_of_another_global_batch_or_without_a_data_position_is_refused_in_one_line(
    shards: Path, tmp_path: Path
) -> None:
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "train.steps=3"))
    try:
        state = trainer.state_dict()
        # Another global batch changes the epoch's length too: the refusal names the batch, which no force allows.
        other = state | {"global_batch_size": 8, "stream": {**state["stream"], "steps_per_epoch": 99}}
        with pytest.raises(CheckpointError, match=r"data\.global_batch_size=8, this run uses 16"):
            trainer.load_state_dict(other)
        odd = ({}, {"epoch": None}, {"step": -1}, {"steps_per_epoch": 0})
        for stream in ({**state["stream"], **o} if o else o for o in odd):
            with pytest.raises(CheckpointError, match="records no data position"):
                trainer.load_state_dict(state | {"stream": stream})
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("overrides", "loss_type"),
    [
        (["loss.name=pnp", "loss.pnp_variant=Dq", "loss.alpha=4"], "PNPLoss"),
        (["loss.name=smoothap", "loss.tau=0.01"], "SmoothAPLoss"),
        (
            ["optim.name=sgd", "optim.schedule=cosine", "optim.warmup_steps=1", "optim.grad_clip=0.5"],
            "FastAPLoss",
        ),
    ],
)
def test_losses_and_optimizers_train(
    shards: Path, tmp_path: Path, overrides: list[str], loss_type: str
) -> None:
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "train.steps=2", *overrides))
    try:
        assert type(trainer.loss_fn.loss).__name__ == loss_type
        results = [trainer.train_step() for _ in range(2)]
        assert all(0.0 <= r.loss <= 1.0 for r in results)
        if "optim.grad_clip=0.5" in overrides:
            assert results[0].grad_norm is not None and results[0].lr == pytest.approx(
                1e-3
            )  # warm-up step 1 of 1
    finally:
        trainer.close()


def test_chunked_step_is_used_when_the_batch_exceeds_the_chunk(shards: Path, tmp_path: Path) -> None:
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "distributed.chunk_size=5"))
    try:
        assert trainer.chunk_size == 5
        assert trainer.train_step().chunks == 4  # 16 images in chunks of 5, 5, 5, 1
    finally:
        trainer.close()


@pytest.mark.slow
def test_resume_continues_like_an_uninterrupted_run(shards: Path, tmp_path: Path) -> None:
    full = run_training(cfg_for(shards, tmp_path / "full", "train.steps=5"))
    assert full["steps"] == 5
    part = run_training(
        cfg_for(shards, tmp_path / "part", "train.steps=5", "train.checkpoint_every=2", "train.keep_last=10")
    )
    assert part["steps"] == 5
    # Simulate a kill after step 3: drop every checkpoint after step 2 and the steps logged after it.
    ckpts = tmp_path / "part" / "checkpoints"
    for d in ckpts.glob("step-*"):
        if int(d.name.split("-")[1]) > 2:
            import shutil

            shutil.rmtree(d)
    (ckpts / "best.json").unlink(missing_ok=True)
    resumed = run_training(
        cfg_for(shards, tmp_path / "part", "train.steps=5", "train.checkpoint_every=2", "train.keep_last=10")
    )
    assert resumed["resumed_from"].endswith("step-00000002") and resumed["steps_this_run"] == 3
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "part")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / "part" / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 5  # no step logged twice


def test_a_run_without_deepspeed_never_imports_it(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing DeepSpeed costs a run about 1.5 s of CPU and a start-up warning; only a DeepSpeed run needs it
    (accelerate's ``unwrap_model`` imports it whenever it is installed)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "deepspeed"]:
        monkeypatch.delitem(sys.modules, name)
    overrides = ("train.steps=2", "train.checkpoint_every=1", "train.eval_every=1", "train.eval_at_start=true")
    assert run_training(cfg_for(shards, tmp_path / "run", *overrides))["steps"] == 2
    assert "deepspeed" not in sys.modules


@pytest.mark.slow
def test_eval_cli_baselines_and_checkpoint(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    run_training(cfg_for(shards, out, "train.steps=2"))
    common = [
        f"data.shards={shards}",
        "data.image_size=16",
        "data.resize_size=16",
        "model.backbone=tiny_cnn",
        "model.embedding_dim=16",
        "data.num_workers=0",
        f"train.output_dir={out}",
    ]
    results = tmp_path / "results.json"
    assert main(["eval", "--baseline", "raw-pixels", "--output", str(results), *common]) == 0
    assert main(["eval", "--baseline", "untrained", "--output", str(results), *common]) == 0
    assert main(["eval", "--checkpoint", str(out), "--name", "after", "--output", str(results), *common]) == 0
    data = json.loads(results.read_text())
    assert list(data) == ["raw pixels", "tiny_cnn before training", "after"]
    assert 0.0 <= data["after"]["metrics"]["recall@1"] <= 1.0
    assert "R@1" in capsys.readouterr().out


def test_missing_shards_and_bad_config_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", f"data.shards={tmp_path / 'nowhere'}", "model.backbone=tiny_cnn"]) == 2
    err = capsys.readouterr().err
    assert "data.shards=" in err and "manifest.json" in err and "ddp-rank shards build" in err
    assert main(["train", "model.backbone=resnet9000"]) == 2
    assert "valid choices: resnet18" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "Did you mean 'steps'" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "data.shards is empty" in capsys.readouterr().err


def test_missing_split_and_shard_file(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainError, match=r"data\.test_split='val' is not a split"):
        check_inputs(cfg_for(shards, tmp_path, "data.test_split=val"))
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    next((copy / "train").glob("*.tar")).unlink()
    with pytest.raises(TrainError, match=r"shard file\(s\) of .* are missing"):
        check_inputs(cfg_for(copy, tmp_path))


def test_one_source_of_truth_for_the_precision(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_rank.config import ConfigError
    from ddp_rank.runtime import resolve_mixed_precision

    assert resolve_mixed_precision("auto", "bf16") == "bf16"
    assert resolve_mixed_precision("auto", "no") == "no"
    assert resolve_mixed_precision("fp16", "no") == "fp16"  # a launcher that asks nothing exports "no"
    with pytest.raises(
        ConfigError, match=r"launcher asks for mixed precision bf16 but train\.mixed_precision=no"
    ):
        resolve_mixed_precision("no", "bf16")
    # Under a bf16 launcher, 'auto' trains in bf16 autocast (on CPU here), the loss still in float32. The
    # accelerate state is a per-process singleton that earlier tests set to 'no': start from a fresh one.
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    AcceleratorState._reset_state(True)
    trainer = Trainer(cfg_for(shards, tmp_path / "run", "train.steps=1"))
    try:
        assert str(trainer.accelerator.mixed_precision) == "bf16"
        assert 0.0 <= trainer.train_step().loss <= 1.0
    finally:
        trainer.close()
        AcceleratorState._reset_state(True)


@pytest.mark.slow
def test_deterministic_mode_trains_and_is_switched_on(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.deterministic`` turns on deterministic algorithms (every loss kernel has one: none raises) and
    gives the weights of the default mode on CPU, where the kernels are deterministic anyway."""
    import os

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored after the test
    was = torch.are_deterministic_algorithms_enabled()
    results = []
    try:
        for flag in ("false", "true"):
            trainer = Trainer(cfg_for(shards, tmp_path / flag, "train.steps=2", f"train.deterministic={flag}"))
            try:
                trainer.train_step()
                trainer.train_step()
                results.append([p.detach().clone() for p in trainer.model.parameters()])
                assert torch.are_deterministic_algorithms_enabled() == (flag == "true")
            finally:
                trainer.close()
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        # Fresh memory is not filled with NaN unless asked (a write per allocation, NaN losses from scratch
        # space read before it is written).
        assert not torch.utils.deterministic.fill_uninitialized_memory
        trainer = Trainer(cfg_for(shards, tmp_path / "fill", "train.deterministic=true",
                                  "train.deterministic_fill=true"))  # fmt: skip
        trainer.close()
        assert torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = True  # torch's default
        torch.backends.cudnn.deterministic = False
    for a, b in zip(*results):
        assert torch.equal(a, b)
