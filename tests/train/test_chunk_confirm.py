"""The trial step that confirms ``distributed.chunk_size=auto``'s chunk: it backs off on an out-of-memory error,
on every rank together (one rank's error makes all retry smaller, in real gloo processes), keeps BatchNorm groups
whole, leaves the model, its gradients and the random streams alone, and on CPU holds the step's saved tensors to
the budget; the fixed costs of a step are counted by kind from known parameter counts."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddp_rank.config import ModelConfig, load_config
from ddp_rank.distributed.agreement import RankFailure
from ddp_rank.model import build_model, freeze_batchnorm
from ddp_rank.train.chunking import choice as chunk_choice
from ddp_rank.train.chunking.choice import ActivationProbe, auto_chunk, count_saved
from ddp_rank.train.chunking.confirm import BACK_OFF, Confirmation, confirm_chunk, trial_step
from ddp_rank.train.chunking.step_memory import FixedCosts, collective_reserve, fixed_costs
from ddp_rank.train.settings import step_settings
from tests.helpers.distributed import run_distributed
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


def _fits_up_to(most: int, tried: list[int] | None = None):  # type: ignore[no-untyped-def]
    """A fake device that runs out of memory above ``most`` rows."""

    def step(rows: int) -> None:
        if tried is not None:
            tried.append(rows)
        if rows > most:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows} rows (simulated)")

    return step


@pytest.mark.slow
def test_a_chunk_that_fits_is_confirmed_as_it_is() -> None:
    outcome = confirm_chunk(_fits_up_to(64), local_batch=256, chunk=64)
    assert outcome == Confirmation(64, (64,), True) and not outcome.backed_off
    assert "confirmed by a trial step of 64 images" in outcome.describe(256)
    direct = confirm_chunk(_fits_up_to(256), local_batch=256, chunk=None)
    assert direct.chunk is None and direct.tried == (256,), "the direct step is tried with the whole batch"


@pytest.mark.slow
def test_an_out_of_memory_error_backs_off_until_the_step_fits() -> None:
    tried: list[int] = []
    outcome = confirm_chunk(_fits_up_to(30, tried), local_batch=256, chunk=64)
    assert tried == [64, 48, 36, 27] and outcome.chunk == 27 and outcome.confirmed and outcome.backed_off
    assert all(b == int(a * BACK_OFF) for a, b in itertools.pairwise(tried))
    said = outcome.describe(256)
    assert "backed off to chunks of 27" in said and "64 -> 48 -> 36 -> 27" in said and "(simulated)" in said
    from_direct = confirm_chunk(_fits_up_to(100), local_batch=128, chunk=None)
    assert from_direct.chunk == 96 and from_direct.tried == (128, 96), (
        "a direct step that does not fit is chunked"
    )


@pytest.mark.slow
def test_backing_off_keeps_batchnorm_groups_whole_and_says_when_nothing_fits() -> None:
    tried: list[int] = []
    outcome = confirm_chunk(_fits_up_to(40, tried), 256, 64, round_chunk=lambda rows: rows - rows % 8)
    assert tried == [64, 48, 32] and outcome.chunk == 32
    with pytest.raises(ValueError, match="trial step of 1 image"):
        confirm_chunk(_fits_up_to(0), 256, 2)


def test_an_error_other_than_out_of_memory_is_raised_not_backed_off() -> None:
    def broken(rows: int) -> None:
        raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")

    with pytest.raises(RankFailure, match="trial step of 64 images failed: RuntimeError: cuDNN error"):
        confirm_chunk(broken, 256, 64)


def _one_rank_runs_out(rank: int, world: int) -> tuple[int | None, tuple[int, ...]]:
    """Rank 1's device holds 40 rows, rank 0's all of them: both must end at the same, smaller chunk."""
    outcome = confirm_chunk(_fits_up_to(40 if rank == 1 else 10**6), local_batch=128, chunk=64)
    return outcome.chunk, outcome.tried


@pytest.mark.distributed
def test_one_ranks_out_of_memory_makes_every_rank_back_off_to_the_same_chunk() -> None:
    assert run_distributed(_one_rank_runs_out, world_size=2) == [(36, (64, 48, 36))] * 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=16), 16)


def test_the_trial_step_leaves_the_model_its_gradients_and_the_random_streams_alone() -> None:
    model = _model()
    model.eval()  # a mode to keep: the trial runs in train mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    trial_step(model, 16, contextlib.nullcontext, freeze=False)(8)  # BatchNorm in train mode: buffers move
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert not any(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.slow
def test_on_cpu_the_trial_step_holds_its_saved_tensors_to_the_budget() -> None:
    """The CPU stand-in of a device's memory limit: a chunk whose saved tensors pass the limit raises
    torch.OutOfMemoryError, and the confirmation backs off to a chunk under it."""
    model = _model()

    def saved_by(rows: int) -> int:
        model.train()
        freeze_batchnorm(model)
        with count_saved() as saved:
            model(torch.randint(0, 256, (rows, 3, 16, 16), dtype=torch.uint8)).sum()
        return saved[0]

    limit = (
        saved_by(8) + saved_by(16)
    ) // 2  # more than 8 rows' saved tensors (weights included), less than 16
    step = trial_step(model, 16, contextlib.nullcontext, freeze=True, saved_limit=limit)
    outcome = confirm_chunk(step, local_batch=64, chunk=16)
    assert outcome.tried == (16, 12) and outcome.chunk == 12 and saved_by(12) <= limit
    assert "past the limit" in outcome.note


# ----------------------------------------------------------------------------------------- fixed costs
class _Known(nn.Module):
    """1,010 + 20 parameters (float32), one frozen tensor of 100, BatchNorm buffers 10 + 10 (float32) + 1 (int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(100, 10)
        self.bn = nn.BatchNorm1d(10)
        self.frozen = nn.Parameter(torch.zeros(100), requires_grad=False)


def test_the_fixed_costs_are_counted_from_the_parameters_by_kind() -> None:
    trainable, frozen, buffers = 1_030 * 4, 100 * 4, 20 * 4 + 8
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    alone = fixed_costs(_Known(), "adam", 0.9, world_size=1, device=cpu, loss_work_space=123)
    assert alone == FixedCosts(
        weights=trainable + frozen + buffers,
        gradients=trainable,
        optimizer_state=2 * trainable,
        loss_work_space=123,
    )
    ddp = fixed_costs(_Known(), "sgd", 0.9, world_size=4, device=cuda, loss_work_space=0, extra_parameters=40)
    assert ddp.gradients == ddp.ddp_buckets == trainable + 40 and ddp.optimizer_state == trainable + 40
    assert ddp.collective_buffers == collective_reserve(4, cuda) == 4 * 2**20 * 32 * 2 * 2
    assert ddp.not_yet_allocated == ddp.optimizer_state + ddp.collective_buffers
    assert fixed_costs(_Known(), "sgd", 0.0, 4, cuda, 0, deepspeed=True).ddp_buckets == 0
    assert fixed_costs(_Known(), "sgd", 0.0, 4, cpu, 0).optimizer_state == 0
    assert fixed_costs(_Known(), "adamw", 0.0, 4, cpu, 0).collective_buffers == 0, "gloo: no NCCL buffers"
    assert ddp.describe().startswith("weights ") and "ddp buckets" in ddp.describe()


def test_nccl_settings_change_the_collective_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_BUFFSIZE", str(2**20))
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "4")
    assert collective_reserve(2, torch.device("cuda", 0)) == 2**20 * 4 * 4


def test_the_budget_leaves_out_every_fixed_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto_chunk on CPU with the node's memory: the budget is the fraction of the share less every fixed cost
    of the model (weights, gradients, Adam's moments, DDP's buckets on 2 processes, the loss's work space, the
    input batches)."""
    gib = 2**30
    monkeypatch.setattr(chunk_choice, "available_memory", lambda: (8 * gib, "MemAvailable"))
    cfg = load_config(
        None, ["model.embedding_dim=16", "data.image_size=16", "distributed.memory_budget_mb=0"]
    )
    model = _model()
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    choice = auto_chunk(
        model, step_settings(cfg), 64, 128, torch.device("cpu"), None, 1_000, local_processes=2, world_size=2
    )
    database = 2 * 128 * 16 * 4
    expected = FixedCosts(
        weights=params + buffers,
        gradients=params,
        ddp_buckets=params,
        optimizer_state=2 * params,
        loss_work_space=database + 1_000,
        input_batches=2 * 64 * 3 * 16 * 16,  # two local batches of uint8 pixels: the step's and the feed's
        prepared_batch=4 * 64 * 3 * 16 * 16,  # the chunked step's float32 copy of one, prepared for both passes
    )
    assert choice.fixed == expected
    assert choice.budget_bytes == int(cfg.distributed.memory_fraction * 4 * gib) - expected.total
    assert "fixed" in choice.describe() and "optimizer state" in choice.describe()


# ----------------------------------------------------------------------------------------- in the trainer
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("under_count", [1, 4])
def test_the_trainer_confirms_its_chunk_and_backs_off_from_a_probe_that_under_counts(
    shards: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ddp_rank_log: pytest.LogCaptureFixture,
    under_count: int,
) -> None:
    """A probe that reports a quarter of the real bytes per image makes the chosen step (the direct one, here)
    too large for the budget; the trial step on CPU meets the budget as an out-of-memory error and backs off
    before the first step, which then trains in the smaller chunks. A right probe's chunk is confirmed as is."""
    from ddp_rank.train.trainer import Trainer

    measure = chunk_choice.measure_activation_bytes

    def probe(*args: Any, **kwargs: Any) -> ActivationProbe:
        right = measure(*args, **kwargs)
        return dataclasses.replace(right, per_image=right.per_image // under_count)

    monkeypatch.setattr(chunk_choice, "measure_activation_bytes", probe)
    ddp_rank_log.set_level(logging.INFO, logger="ddp_rank")
    overrides = [o for o in TINY_OVERRIDES if not o.startswith(("data.image_size", "data.resize_size"))]
    cfg = load_config(None, [*overrides, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}",
                             "data.image_size=64", "data.resize_size=64", "data.test_split=", "train.steps=1",
                             "distributed.memory_budget_mb=2"])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        said = " | ".join(r.getMessage() for r in ddp_rank_log.records if "chunk_size=auto" in r.getMessage())
        chunk = trainer.layout.chunk_size
        assert chunk is not None and chunk < trainer.local_batch
        if under_count == 1:
            assert f"chunks of {chunk} confirmed by a trial step of {chunk} images" in said
        else:
            assert "direct step" in said and f"backed off to chunks of {chunk}" in said
        result = trainer.train_step()
        assert result.chunks == -(-trainer.local_batch // chunk) and math.isfinite(result.loss)
    finally:
        trainer.close()


def test_the_prepared_batch_is_counted_where_the_chunked_step_holds_one() -> None:
    """uint8 images become float32 (4 bytes a pixel) once for both passes; feature vectors are taken as they are."""
    from ddp_rank.model.feature_head import FeatureHeadNet
    from ddp_rank.train.chunking.choice import input_bytes

    assert input_bytes(_model(), 16) == (3 * 16 * 16, 4 * 3 * 16 * 16)
    assert input_bytes(FeatureHeadNet(32, 8), 16) == (4 * 32, 0)
    assert input_bytes(nn.Linear(3, 2), 16)[1] == 0, "no prepare_batch: each chunk prepares its own"


def test_no_trial_step_where_the_step_holds_a_collective_and_the_log_says_so(
    shards: Path, tmp_path: Path, ddp_rank_log: pytest.LogCaptureFixture
) -> None:
    """With ``model.sync_bn`` the forward exchanges BatchNorm statistics between the ranks: one rank cannot run a
    trial step alone, so none runs, and the log says why (the chunk stays the one chosen from the probe)."""
    from ddp_rank.train.trainer import Trainer

    ddp_rank_log.set_level(logging.INFO, logger="ddp_rank")
    cfg = load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}",
                             "data.test_split=", "train.steps=1", "model.sync_bn=true"])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        said = " | ".join(r.getMessage() for r in ddp_rank_log.records if "chunk_size=auto" in r.getMessage())
        assert trainer.layout.batchnorm.kind == "global" and trainer.layout.chunk_size is None
        assert (
            "the direct step, not confirmed by a trial step (BatchNorm synchronised over the ranks exchanges "
            "statistics inside the forward)" in said
        ), said
        assert "confirmed by a trial step of" not in said
    finally:
        trainer.close()


def _ranks_measure_apart(rank: int, world: int) -> tuple[int | None, int | None, str]:
    """Rank 1's probe finds twice the bytes per image of rank 0's: every rank takes rank 1's smaller chunk, and
    rank 0's log says it is the smallest over the ranks."""
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.train.chunking import auto
    from ddp_rank.train.chunking.layout import BatchLayout

    measure = chunk_choice.measure_activation_bytes

    def probe(*args: Any, **kwargs: Any) -> ActivationProbe:
        right = measure(*args, **kwargs)
        return dataclasses.replace(right, per_image=right.per_image * (1 + rank))

    chunk_choice.measure_activation_bytes = probe
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    auto.log.addHandler(handler)
    auto.log.setLevel(logging.INFO)
    cfg = load_config(None, [*TINY_OVERRIDES, "data.global_batch_size=64", "distributed.memory_budget_mb=1"])
    step = step_settings(cfg)
    layout, choice = auto.choose_chunk_for_run(
        step, BatchLayout.from_settings(step, world), _model(), FastAPLoss(), torch.device("cpu"), None,
        largest_class=4, loss_parameters=[], deepspeed=False, is_main=rank == 0,
    )  # fmt: skip
    return layout.chunk_size, choice.chunk, " | ".join(said)


@pytest.mark.distributed
def test_every_rank_takes_the_smallest_chunk_and_rank_0_says_so() -> None:
    (agreed_0, own_0, said_0), (agreed_1, own_1, said_1) = run_distributed(_ranks_measure_apart, world_size=2)
    assert own_1 is not None and agreed_0 == agreed_1 == own_1, (own_0, own_1, agreed_0)
    assert own_0 is None or own_0 > own_1
    assert f"the smallest over the ranks: {own_1:,}" in said_0, said_0
    assert said_1 == "", "only rank 0 logs the choice"
