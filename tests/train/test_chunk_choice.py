"""``distributed.chunk_size=auto``: the chosen chunk is the largest that fits the budget, never more; a batch that
fits is not chunked; the probe measures the real model without touching it; a global batch of 4,096 on one
process starts without the user choosing anything."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddp_rank.config import ModelConfig, load_config
from ddp_rank.model import build_model
from ddp_rank.train.chunk_choice import choose_chunk, measure_activation_bytes, memory_budget
from tests.helpers.training import TINY_OVERRIDES


@given(
    local=st.integers(1, 100_000),
    per_image=st.integers(1, 10**8),
    budget=st.integers(0, 10**12),
)
def test_the_chunk_is_the_largest_that_fits_and_a_batch_that_fits_is_not_chunked(
    local: int, per_image: int, budget: int
) -> None:
    """A fake memory model (activations = chunk x bytes per image) against the choice."""
    if per_image > budget:
        if local * per_image > budget:
            with pytest.raises(ValueError, match="exceed the memory budget"):
                choose_chunk(local, per_image, budget)
        return
    chunk = choose_chunk(local, per_image, budget)
    if local * per_image <= budget:
        assert chunk is None
        return
    assert chunk is not None and 1 <= chunk < local
    assert chunk * per_image <= budget < (chunk + 1) * per_image


def test_the_probe_measures_activations_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=16), 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    small, _ = measure_activation_bytes(model, 16, torch.device("cpu"))
    large, how = measure_activation_bytes(model, 32, torch.device("cpu"))
    assert "saved for backward" in how
    assert 3.0 < large / small < 5.0, "activations grow with the image area"
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_cpu_budget_is_the_setting_or_a_share_of_available_memory() -> None:
    budget, how = memory_budget(torch.device("cpu"), 0.8, 64, fixed_bytes=123)
    assert budget == 64 * 2**20 and "memory_budget_mb=64" in how
    shared, how = memory_budget(torch.device("cpu"), 0.5, 0, fixed_bytes=0, local_processes=2)
    alone, _ = memory_budget(torch.device("cpu"), 0.5, 0, fixed_bytes=0, local_processes=1)
    assert 0 < shared <= alone // 2 + 2**20 and "2 process(es)" in how


def test_chunk_size_accepts_auto_or_a_number() -> None:
    from ddp_rank.config import ConfigError

    assert load_config(None, []).distributed.chunk_size == "auto"
    assert load_config(None, ["distributed.chunk_size=96"]).distributed.fixed_chunk == 96
    assert load_config(None, ["distributed.chunk_size=AUTO"]).distributed.fixed_chunk is None
    with pytest.raises(ConfigError, match="must be 'auto' or a number of images"):
        load_config(None, ["distributed.chunk_size=big"])


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 categories x 540 classes x 4 images of 16 px: enough for a hard-sampled global batch of 4,096."""
    from ddp_rank.data.build import BuildOptions, build_shards
    from ddp_rank.data.listing import read_image_folder
    from ddp_rank.data.synthetic import write_image_folder

    root = tmp_path_factory.mktemp("big")
    write_image_folder(root / "images", [[4] * 540] * 2, image_size=16, seed=0)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


@pytest.mark.slow
@pytest.mark.parametrize(("budget_mb", "chunked"), [(0, False), (16, True)])
def test_a_global_batch_of_4096_on_one_process_starts_with_nothing_chosen(
    big_shards: Path, tmp_path: Path, ddp_rank_log: pytest.LogCaptureFixture, budget_mb: int, chunked: bool
) -> None:
    from ddp_rank.train.trainer import Trainer

    overrides = [o for o in TINY_OVERRIDES if not o.startswith("data.global_batch_size")]
    cfg = load_config(None, [*overrides, f"data.shards={big_shards}", f"train.output_dir={tmp_path / 'run'}",
                             "data.global_batch_size=4096", "data.test_split=", "train.steps=1",
                             f"distributed.memory_budget_mb={budget_mb}"])  # fmt: skip
    ddp_rank_log.set_level(logging.INFO, logger="ddp_rank")
    trainer = Trainer(cfg)
    try:
        assert trainer.layout.chunked is chunked
        said = [r.getMessage() for r in ddp_rank_log.records if "chunk_size=auto" in r.getMessage()]
        assert said and ("runs in chunks of" in said[0]) is chunked and ("direct step" in said[0]) is not chunked
        if chunked:
            assert trainer.layout.chunk_size is not None and trainer.layout.chunk_size < 4096
        result = trainer.train_step()
        assert result.chunks == (-(-4096 // trainer.layout.chunk_size) if chunked else 1)
        assert torch.isfinite(torch.tensor(result.loss))
    finally:
        trainer.close()
