"""Checkpoints that hold no code: a pickle that would run code, planted in any file that a resume, ``eval``,
``export`` or ``model.init_from`` reads, with the digests of ``meta.json`` rewritten to match (whoever hands over a
run directory can rewrite them too), never runs: the command ends with one line naming the file. The scheduler
and a proxy loss's parameters are written as JSON and safetensors and resume exactly; a checkpoint of the format
before (accelerate's ``custom_checkpoint_*.pkl``) is refused in one line."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.file_checks import digest_files
from ddp_rank.model.checkpoint_read import FILES_KEY, META_NAME, CheckpointError, checkpoint_problem
from ddp_rank.model.safe_pickles import unsafe_pickle_problem
from ddp_rank.train.checkpoints.state_files import LOSS_FILE, SCHEDULER_FILE
from ddp_rank.train.trainer import Trainer, run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

pytestmark = pytest.mark.slow  # training runs of seconds: in make test, out of make test-fast


@pytest.fixture(scope="module", autouse=True)
def _pytorch_metric_learning() -> None:
    """Imported when this file's tests run, not by every worker that collects the suite; without it the file
    is skipped."""
    pytest.importorskip("pytorch_metric_learning")


# A proxy loss: its parameters are part of the checkpoint. No test split and no chunk trial: shorter runs.
PROXY = [
    "loss.name=pml:ProxyAnchorLoss(margin=0.1, alpha=32)",
    "model.freeze_bn=always",
    "loss.params_lr_mult=5",
]
FAST = [
    "data.test_split=",
    "distributed.chunk_size=0",
    "optim.schedule=step",
    "optim.step_milestones=1,3",
    "optim.warmup_steps=1",
]


class RunsCode:
    """Unpickled without restriction, this calls ``os.system`` (``touch`` of a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


def overrides(shards: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, *PROXY, *FAST, f"data.shards={shards}", f"train.output_dir={out}",
            f"train.steps={steps}", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def finished(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step run with a proxy loss and its checkpoint at step 2 (tests change a copy)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_training(load_config(None, overrides(shards, out, 2)))
    return out


@pytest.fixture()
def run(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def ckpt(run: Path) -> Path:
    return run / "checkpoints" / "step-00000002"


def rewrite_digests(checkpoint: Path) -> None:
    """What whoever hands over a directory can do: record the files as they are now."""
    meta = json.loads((checkpoint / META_NAME).read_text())
    meta[FILES_KEY] = digest_files(checkpoint, skip=(META_NAME,))
    (checkpoint / META_NAME).write_text(json.dumps(meta))
    assert checkpoint_problem(checkpoint) is None


def plant(checkpoint: Path, name: str, marker: Path) -> None:
    """Replace ``name`` (a torch file) by one whose pickle runs code; ``pytorch_model.bin`` replaces the weights."""
    if name == "pytorch_model.bin":
        (checkpoint / "model.safetensors").unlink()
    torch.save({"state": RunsCode(marker)}, checkpoint / name)


def one_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_the_planted_pickle_runs_code_when_unpickled_without_restriction(tmp_path: Path) -> None:
    """The check of the checks: what the tests below plant does run code through a plain ``torch.load``."""
    marker = tmp_path / "ran"
    torch.save({"state": RunsCode(marker)}, tmp_path / "f.pkl")
    torch.load(tmp_path / "f.pkl", weights_only=False)
    assert marker.exists()
    assert "names posix.system" in (unsafe_pickle_problem(tmp_path / "f.pkl") or "")


def test_a_checkpoint_holds_json_and_safetensors_for_the_state_the_trainer_owns(finished: Path) -> None:
    names = sorted(p.name for p in ckpt(finished).iterdir())
    assert names == [LOSS_FILE, META_NAME, "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                     SCHEDULER_FILE]  # fmt: skip
    record = json.loads((ckpt(finished) / SCHEDULER_FILE).read_text())
    assert record["class"] == "LambdaLR" and record["state"]["last_epoch"] == 2


# The files a resume reads (weights as a torch file too: accelerate reads pytorch_model.bin when there is no
# model.safetensors), and a file of the format before, which the scan reads before it refuses the format.
RESUME_FILES = ["optimizer.bin", "random_states_0.pkl", "pytorch_model.bin", "custom_checkpoint_0.pkl"]
# Each layer alone: "scan" is everything as shipped; "blind scan": the static scan sees nothing (a global built at
# run time), the weights-only trial load refuses; "loads only": no check before, accelerate's and the project's
# loads are weights-only. accelerate skips random states it cannot read (an info line): that resume goes on, with
# nothing run; the checks before the load are what make it refuse.
CASES = [*((name, "scan") for name in RESUME_FILES), ("optimizer.bin", "blind scan"),
         ("random_states_0.pkl", "blind scan"), ("optimizer.bin", "loads only"), ("pytorch_model.bin", "loads only"),
         ("random_states_0.pkl", "loads only")]  # fmt: skip


@pytest.mark.parametrize(("name", "layer"), CASES)
def test_a_resume_runs_no_planted_code(
    shards: Path, run: Path, tmp_path: Path, name: str, layer: str, capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    marker = tmp_path / "ran"
    plant(ckpt(run), name, marker)
    rewrite_digests(ckpt(run))
    if layer == "blind scan":
        monkeypatch.setattr(torch.serialization, "get_unsafe_globals_in_checkpoint", lambda *a, **k: [])
    elif layer == "loads only":
        import ddp_rank.model.safe_pickles as safe_pickles

        monkeypatch.setattr(safe_pickles, "unsafe_pickle_problem", lambda *a, **k: None)
    before = json.loads((run / "run.json").read_text())
    code = main(["train", *overrides(shards, run, 3)])
    if (name, layer) == ("random_states_0.pkl", "loads only"):
        assert code == 0 and not marker.exists(), "skipped by accelerate, not run"
        return
    assert code == 2
    line = one_line(capsys)
    assert not marker.exists(), "the planted pickle ran"
    assert f"checkpoint {ckpt(run)}" in line and "posix.system" in line, line
    if layer != "loads only":  # accelerate's load_state does not say which file it was reading
        assert f"{name} names posix.system, which no checkpoint needs" in line, line
    assert json.loads((run / "run.json").read_text()) == before, "a refused resume keeps the run's record"


def test_every_file_planted_at_once(
    shards: Path, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The weights as a torch file and every other torch file planted: resume, eval, export and init_from each
    refuse in one line and nothing runs."""
    marker = tmp_path / "ran"
    for name in ("optimizer.bin", "random_states_0.pkl", "pytorch_model.bin"):
        plant(ckpt(run), name, marker)
    rewrite_digests(ckpt(run))
    commands = {
        "resume": ["train", *overrides(shards, run, 3)],
        "eval": ["eval", "--checkpoint", str(ckpt(run)), "--split", "test"],
        "export": [
            "export",
            "--checkpoint",
            str(ckpt(run)),
            "--output",
            str(tmp_path / "export"),
            "--split",
            "test",
        ],
        "init_from": ["train", *overrides(shards, tmp_path / "new", 1, f"model.init_from={run}")],
        "forced resume with another head": [
            "train",
            *overrides(shards, run, 3, "model.embedding_dim=8", "train.force_resume=true"),
        ],
    }
    for command, args in commands.items():
        assert main(args) == 2, command
        line = one_line(capsys)
        assert not marker.exists(), f"{command}: the planted pickle ran"
        assert "names posix.system, which no checkpoint needs" in line, (command, line)
    assert not (tmp_path / "export").exists() and not (tmp_path / "new" / "checkpoints").exists()


def test_weights_only_loads_override_an_explicit_weights_only_false_and_restore_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What accelerate's and DeepSpeed's own loads get inside the block: weights-only even when they ask for
    ``weights_only=False`` (DeepSpeed 0.19 does), the allowed types, and the user's environment back after it."""
    from ddp_rank.model.safe_pickles import RNG_STATE_TYPES, weights_only_loads

    marker = tmp_path / "ran"
    torch.save({"state": RunsCode(marker)}, tmp_path / "f.pkl")
    torch.save({"numpy": np.random.get_state()}, tmp_path / "rng.pkl")  # noqa: NPY002 (what accelerate saves)
    # A user's own setting, which torch refuses to combine with the switch the block sets.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    # What other libraries may have added for good; a set: torch keeps them in one, so the order is a hash's.
    allowed_before = set(torch.serialization.get_safe_globals())
    with weights_only_loads(RNG_STATE_TYPES):
        with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
            torch.load(tmp_path / "f.pkl", weights_only=False)
        assert torch.load(tmp_path / "rng.pkl", weights_only=False)["numpy"][0] == "MT19937"
    assert not marker.exists()
    assert (
        "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
        and os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    )
    assert set(torch.serialization.get_safe_globals()) == allowed_before
    # numpy's state is allowed only when asked for.
    with pytest.raises(pickle.UnpicklingError), weights_only_loads():
        torch.load(tmp_path / "rng.pkl", weights_only=False)
    with pytest.raises(CheckpointError, match="no checkpoint needs"):
        from ddp_rank.model.checkpoint_read import _read_weights_file

        _read_weights_file(tmp_path / "f.pkl")
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- positive
def _resumed(shards: Path, run: Path, steps: int = 4) -> Trainer:
    trainer = Trainer(load_config(None, overrides(shards, run, steps)))
    assert trainer.resume() == ckpt(run) and trainer.step == 2
    return trainer


def test_scheduler_and_proxies_resume_exactly(shards: Path, run: Path) -> None:
    from safetensors.torch import load_file

    saved_proxies = load_file(str(ckpt(run) / LOSS_FILE))["proxies"]
    saved_schedule = json.loads((ckpt(run) / SCHEDULER_FILE).read_text())["state"]
    trainer = _resumed(shards, run)
    try:
        assert torch.equal(trainer.loss_parameters[0].detach().cpu(), saved_proxies)
        state = trainer.scheduler.state_dict()
        assert {k: state[k] for k in saved_schedule} == saved_schedule
        assert state["last_epoch"] == 2 and state["_step_count"] == 3
        assert trainer.train_step().lr == pytest.approx(trainer.scheduler.base_lrs[0] * state["_last_lr"][0]
                                                        / state["base_lrs"][0])  # fmt: skip
    finally:
        trainer.close()


def test_a_checkpoint_of_the_format_before_is_refused_in_one_line(
    shards: Path, run: Path, capsys: pytest.CaptureFixture
) -> None:
    """The version before this one saved the schedule and a loss's parameters through accelerate
    (``custom_checkpoint_*.pkl``): such a run does not resume, and its weights still start a new one."""
    from safetensors.torch import load_file

    state = json.loads((ckpt(run) / SCHEDULER_FILE).read_text())["state"]
    torch.save(state, ckpt(run) / "custom_checkpoint_0.pkl")
    torch.save(OrderedDict(load_file(str(ckpt(run) / LOSS_FILE))), ckpt(run) / "custom_checkpoint_1.pkl")
    (ckpt(run) / SCHEDULER_FILE).unlink()
    (ckpt(run) / LOSS_FILE).unlink()
    rewrite_digests(ckpt(run))
    assert main(["train", *overrides(shards, run, 3)]) == 2
    line = one_line(capsys)
    assert f"checkpoint {ckpt(run)} was written by an earlier version" in line, line
    assert f"model.init_from={ckpt(run)}" in line, line


def test_a_checkpoint_without_a_data_position_is_refused_before_anything_loads(
    shards: Path, run: Path, capsys: pytest.CaptureFixture
) -> None:
    meta = json.loads((ckpt(run) / META_NAME).read_text())
    (ckpt(run) / META_NAME).write_text(json.dumps({**meta, "stream": {"seed": 0}}))
    before = json.loads((run / "run.json").read_text())
    assert main(["train", *overrides(shards, run, 3)]) == 2
    line = one_line(capsys)
    assert f"checkpoint {ckpt(run)}: its meta.json records no data position" in line, line
    assert "and a new train.output_dir" in line, line
    assert json.loads((run / "run.json").read_text()) == before, "a refused resume keeps the run's record"


@pytest.mark.parametrize(
    ("state", "words"),
    [
        ({"last_epoch": float("nan")}, "holds more than plain values: its state.last_epoch is nan"),
        ({"last_epoch": 2, "optimizer_hook": "x"}, "has keys this LambdaLR does not: optimizer_hook"),
        (
            {"last_epoch": 2, "lr_lambdas": [{"__code__": 1}, None, None]},
            "holds another schedule function's state",
        ),
    ],
)
def test_a_scheduler_record_holding_more_is_refused(
    shards: Path, run: Path, state: dict[str, Any], words: str, capsys: pytest.CaptureFixture
) -> None:
    record = json.loads((ckpt(run) / SCHEDULER_FILE).read_text())
    (ckpt(run) / SCHEDULER_FILE).write_text(json.dumps({**record, "state": state}))
    rewrite_digests(ckpt(run))
    assert main(["train", *overrides(shards, run, 3)]) == 2
    line = one_line(capsys)
    assert f"checkpoint {ckpt(run)}: {SCHEDULER_FILE} {words}" in line, line
