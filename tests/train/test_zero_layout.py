"""Channels-last and DeepSpeed ZeRO: what the optimizer updates must be what the model computes with.

ZeRO-1/2 flattens the weights into one buffer per parameter group and makes every weight a view of it, in the
standard (contiguous) layout. Channels-last set before ``deepspeed.initialize`` fails there (DeepSpeed 0.19
broadcasts each weight viewed as bytes, which a channels-last weight cannot be) or would be lost in the buffer's
views; set after it, it gives the weights storage of their own, apart from the buffer the optimizer updates
(DeepSpeed 0.19 then fails in the backward; otherwise the model would keep computing with the old weights). The
trainer keeps channels-last off under DeepSpeed (``wants_channels_last``); these tests show both hazards on
DeepSpeed's CPU accelerator (1 gloo process) and that the trainer's layout keeps the weights inside the buffer
the optimizer steps.
"""

from __future__ import annotations

import pytest
import torch

from ddp_rank.config import ModelConfig
from ddp_rank.model import build_model
from ddp_rank.train.setup import wants_channels_last
from tests.helpers.distributed import run_distributed


def _tiny_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(backbone="tiny_cnn", weights="none", embedding_dim=8), 16)


def test_channels_last_is_for_convolutions_on_cuda_without_deepspeed() -> None:
    model, cuda, cpu = _tiny_cnn(), torch.device("cuda"), torch.device("cpu")
    assert wants_channels_last(model, cuda, deepspeed=False)
    assert not wants_channels_last(model, cuda, deepspeed=True)
    assert not wants_channels_last(model, cpu, deepspeed=False)


def _zero_worker(rank: int, world: int, stage: int) -> dict[str, object]:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    images = torch.rand(4, 3, 16, 16)
    outcome: dict[str, object] = {}
    for layout in ("trainer", "before", "after"):
        model = _tiny_cnn()
        if layout == "before":
            model.use_channels_last()
        try:
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
            )
        except RuntimeError as exc:
            outcome[layout] = str(exc)
            continue
        if layout == "after":
            engine.module.use_channels_last()
        flat = {t.untyped_storage().data_ptr() for t in engine.optimizer.bit16_groups_flat}
        weights = list(engine.module.parameters())
        convs = [m.weight for m in engine.module.modules() if isinstance(m, torch.nn.Conv2d)]
        seen: dict[str, object] = {
            "in_buffer": all(w.untyped_storage().data_ptr() in flat for w in weights),
            "channels_last": all(w.is_contiguous(memory_format=torch.channels_last) for w in convs),
        }
        before = engine.module(images).detach().clone()
        try:
            engine.backward(engine.module(images).square().sum())
            engine.step()
            seen["moved"] = not torch.equal(engine.module(images).detach(), before)
        except RuntimeError as exc:
            seen["step"] = str(exc)
        outcome[layout] = seen
    return outcome


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_under_zero_the_model_computes_with_the_weights_the_optimizer_steps(stage: int) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional [deepspeed] extra")
    (outcome,) = run_distributed(_zero_worker, 1, args=(stage,), timeout=600)
    # The trainer's layout: every weight a view of ZeRO's buffer, and a step changes what the model computes.
    assert outcome["trainer"] == {"in_buffer": True, "channels_last": False, "moved": True}
    # Channels-last before initialize: DeepSpeed 0.19 cannot even broadcast the weights (it views each as bytes,
    # which needs a unit last stride); where it could, the flat buffer's views would drop the layout anyway.
    before = outcome["before"]
    assert isinstance(before, str) and "stride" in before, before
    # Channels-last after initialize: the weights leave the buffer the optimizer steps; DeepSpeed 0.19 then fails
    # in the backward (it views each gradient flat); where it did not, the step would not reach the model.
    after = outcome["after"]
    assert isinstance(after, dict) and not after["in_buffer"] and after["channels_last"], after
    assert after.get("moved") is False or "view size is not compatible" in str(after.get("step")), after


def _bf16_worker(rank: int, world: int) -> dict[str, object]:
    """A BatchNorm network under DeepSpeed's bf16 mode, as DeepSpeed leaves it and as the trainer prepares it."""
    import deepspeed

    from ddp_rank.model.net import freeze_batchnorm
    from ddp_rank.train.batchnorm import match_batchnorm_buffers_to_weights

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
    }
    images = torch.rand(4, 3, 16, 16).bfloat16()
    outcome: dict[str, object] = {}
    for prepared in (False, True):
        model = _tiny_cnn()
        stats = {n: b.clone() for n, b in model.named_buffers() if "running" in n}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
        )
        seen: dict[str, object] = {"buffer_dtypes": sorted({str(b.dtype) for n, b in engine.module.named_buffers()
                                                            if "running" in n})}  # fmt: skip
        if prepared:
            seen["layers"] = match_batchnorm_buffers_to_weights(engine.module)
            seen["stats_kept"] = all(
                torch.allclose(dict(engine.module.named_buffers())[n].float(), v, rtol=1e-2, atol=1e-3)
                for n, v in stats.items()
            )
        for mode in ("frozen", "train"):
            engine.module.train()
            if mode == "frozen":
                freeze_batchnorm(engine.module)
            try:
                engine.backward(engine.module(images).float().square().sum())
                engine.step()
                seen[mode] = "ok"
            except RuntimeError as exc:
                seen[mode] = str(exc)
        outcome["prepared" if prepared else "as_deepspeed_leaves_it"] = seen
    return outcome


@pytest.mark.distributed
@pytest.mark.slow
def test_batchnorm_trains_under_deepspeed_bf16_once_its_statistics_match_its_weights() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional [deepspeed] extra")
    (outcome,) = run_distributed(_bf16_worker, 1, timeout=600)
    # DeepSpeed casts the weights to bf16 and keeps the running statistics in float32: torch's batch_norm refuses
    # the mix in train and eval mode alike (the chunked step's frozen BatchNorm is eval mode).
    raw = outcome["as_deepspeed_leaves_it"]
    assert isinstance(raw, dict) and raw["buffer_dtypes"] == ["torch.float32"], raw
    assert "expected scalar type" in str(raw["frozen"]) and "expected scalar type" in str(raw["train"]), raw
    # The trainer's preparation: the four layers' statistics in bf16, their values kept, both modes train.
    assert outcome["prepared"] == {
        "buffer_dtypes": ["torch.float32"], "layers": 4, "stats_kept": True, "frozen": "ok", "train": "ok"
    }  # fmt: skip
