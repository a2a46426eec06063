"""timm backbones (ViT, DeiT, DINOv2, ConvNeXt) and the pooling choices; offline, random or local weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from ddp_rank.config import ConfigError, ModelConfig, load_config
from ddp_rank.losses import FastAPLoss
from ddp_rank.model.backbones import Pooling
from ddp_rank.model.net import ModelError, build_model, has_batchnorm
from ddp_rank.train import PlainBackend, forward_backward


@pytest.fixture(scope="module", autouse=True)
def timm() -> Any:
    """timm for every test of the file, imported by the worker that runs it rather than by every worker that
    collects the suite (about 2 s each); the whole file is skipped where timm is missing."""
    return pytest.importorskip("timm")


TIMM_MODELS = [
    ("timm:vit_tiny_patch16_224", 32, 192),
    ("timm:deit_tiny_patch16_224", 32, 192),
    ("timm:vit_small_patch14_dinov2", 28, 384),
    ("timm:convnext_atto", 32, 320),
]


@pytest.mark.parametrize(("backbone", "size", "width"), TIMM_MODELS, ids=lambda v: str(v))
@pytest.mark.parametrize("pooling", ["default", "avg", "max_avg", "gem"])
def test_timm_models_embed_and_every_parameter_learns(
    backbone: str, size: int, width: int, pooling: str
) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=backbone, embedding_dim=8, pooling=pooling), size)
    assert model.head.in_features == width and not has_batchnorm(model), "LayerNorm models: nothing to freeze"
    e = model(torch.rand(3, 3, size, size))
    assert e.shape == (3, 8)
    assert_close(e.norm(dim=1), torch.ones(3))
    e[:, 0].sum().backward()
    # DDP fails on parameters without a gradient: the modules forward_features skips must be gone.
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_timm_input_normalisation_comes_from_the_model() -> None:
    vit = build_model(ModelConfig(backbone="timm:vit_tiny_patch16_224", embedding_dim=4), 32)
    convnext = build_model(ModelConfig(backbone="timm:convnext_atto", embedding_dim=4), 32)
    assert vit.input_mean.flatten().tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert convnext.input_mean.flatten().tolist() == pytest.approx([0.485, 0.456, 0.406])


def test_timm_weights_from_a_local_file(tmp_path: Path, timm: Any) -> None:
    """A timm checkpoint with its classifier (as published) loads into the classifier-less backbone; the
    position embeddings are resampled to the training size (224 -> 32 px: 196 -> 4 patches)."""
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path / "vit_tiny.pth"
    torch.save(source.state_dict(), path)
    model = build_model(
        ModelConfig(backbone="timm:vit_tiny_patch16_224", weights=str(path), embedding_dim=8), 32
    )
    net = model.backbone.net
    assert_close(net.blocks[1].mlp.fc1.weight, source.blocks[1].mlp.fc1.weight, rtol=0, atol=0)
    assert net.pos_embed.shape == (1, 1 + 4, 192) and source.pos_embed.shape == (1, 1 + 196, 192)
    other = tmp_path / "convnext.pth"
    torch.save(timm.create_model("convnext_atto", pretrained=False).state_dict(), other)
    with pytest.raises(ModelError, match=r"could not load the weights .* from the file"):
        build_model(ModelConfig(backbone="timm:vit_tiny_patch16_224", weights=str(other)), 32)


def test_timm_errors_name_the_fix() -> None:
    with pytest.raises(ModelError, match="timm has no model 'vit_tinyy_patch16_224'; similar: vit_"):
        build_model(ModelConfig(backbone="timm:vit_tinyy_patch16_224"), 32)
    with pytest.raises(ModelError, match=r"valid are none, default .* or a local file path"):
        build_model(ModelConfig(backbone="timm:vit_tiny_patch16_224", weights="IMAGENET1K_V1"), 32)
    with pytest.raises(ConfigError, match="names no model"):
        ModelConfig(backbone="timm:")
    with pytest.raises(ConfigError, match=r"or timm:<model name>\. Did you mean 'resnet50'"):
        ModelConfig(backbone="resnet05")


def test_vit_trains_three_steps_direct_and_chunked_alike() -> None:
    """As for the CNNs: the chunked (gradient-cache) step gives the direct step's gradients, step after step."""
    cfg = ModelConfig(backbone="timm:vit_tiny_patch16_224", embedding_dim=16, pooling="gem")
    torch.manual_seed(0)
    direct = build_model(cfg, 32)
    chunked = copy.deepcopy(direct)
    # SGD, not Adam: Adam's normalised update turns rounding-level gradient differences of near-zero
    # gradients into full-size steps, which would hide what this test compares.
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (direct, chunked)]
    g = torch.Generator().manual_seed(1)
    loss_fn = FastAPLoss(num_bins=10)
    for _ in range(3):
        images, labels = torch.rand(12, 3, 32, 32, generator=g), torch.arange(12) % 4
        out_d = forward_backward(PlainBackend(direct), images, labels, loss_fn)
        out_c = forward_backward(PlainBackend(chunked), images, labels, loss_fn, chunk_size=5)
        assert (out_d.chunks, out_c.chunks) == (1, 3)
        assert_close(out_c.loss, out_d.loss, rtol=1e-5, atol=1e-6)
        for (name, p_d), p_c in zip(direct.named_parameters(), chunked.parameters()):
            assert_close(p_c.grad, p_d.grad, rtol=1e-4, atol=1e-6, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p_d), p_c in zip(direct.named_parameters(), chunked.parameters()):
        assert_close(p_c, p_d, rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(direct.backbone.pool.p, torch.tensor(3.0)), "GeM's p is learned"


# ------------------------------------------------------------------------------------------------- pooling
def test_pooling_of_feature_maps_and_tokens() -> None:
    x = torch.rand(2, 5, 3, 4) + 0.1
    assert_close(Pooling("avg")(x), F.adaptive_avg_pool2d(x, 1).flatten(1))
    assert_close(Pooling("max_avg")(x), x.amax((2, 3)) + x.mean((2, 3)))
    gem = Pooling("gem")
    assert_close(gem(x), x.pow(3).mean((2, 3)).pow(1 / 3))
    gem.p.data.fill_(1.0)
    assert_close(gem(x), x.mean((2, 3)))
    tokens = torch.rand(2, 1 + 12, 5)  # a class token, then 12 patch tokens
    assert_close(Pooling("avg", prefix_tokens=1)(tokens), tokens[:, 1:].mean(1))
    assert_close(Pooling("avg", channels_last=True)(x.permute(0, 2, 3, 1)), x.mean((2, 3)))


@pytest.mark.parametrize("backbone", ["tiny_cnn", "resnet18"])
def test_pooling_choice_for_torchvision_and_tiny_cnns(backbone: str) -> None:
    model = build_model(ModelConfig(backbone=backbone, embedding_dim=8, pooling="gem"), 32)
    assert any(name.endswith("pool.p") for name, _ in model.named_parameters())
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 8)
    plain = build_model(ModelConfig(backbone=backbone, embedding_dim=8), 32)
    assert not any(name.endswith(".p") for name, _ in plain.named_parameters())


def test_grid_pooling_keeps_every_position_in_place() -> None:
    """``grid`` is no pooling: output element ``(h * W + w) * C + c`` is ``x[n, c, h, w]``, checked one by one."""
    n, c, h, w = 2, 5, 3, 4
    x = torch.arange(n * c * h * w, dtype=torch.float32).reshape(n, c, h, w)
    expected = torch.tensor(
        [[float(x[i, ch, r, col]) for r in range(h) for col in range(w) for ch in range(c)] for i in range(n)]
    )
    out = Pooling("grid")(x)
    assert out.shape == (n, h * w * c)
    assert torch.equal(out, expected)
    assert torch.equal(out, x.permute(0, 2, 3, 1).reshape(n, -1))
    # timm's NHWC maps hold the same positions in another memory order: the same vector.
    assert torch.equal(Pooling("grid", channels_last=True)(x.permute(0, 2, 3, 1)), expected)
    tokens = torch.rand(2, 1 + 12, 5)  # a class token, then 12 patch tokens
    grid = Pooling("grid", prefix_tokens=1)(tokens)
    assert grid.shape == (2, 12 * 5)
    assert torch.equal(grid, torch.cat([tokens[:, t] for t in range(1, 13)], dim=1))
    assert not any(True for _ in Pooling("grid").parameters())


def test_grid_pooling_is_a_config_choice_and_widens_the_head() -> None:
    cfg = load_config(None, ["model.pooling=grid", "model.output_stride=16"])
    assert (cfg.model.pooling, cfg.model.output_stride) == ("grid", 16)
    with pytest.raises(
        ConfigError, match=r"model.output_stride=8 is not a valid choice; valid choices: 32, 16"
    ):
        load_config(None, ["model.output_stride=8"])
    # tiny_cnn: four stride-2 stages, 128 channels; a 32 px image leaves a 2 x 2 map.
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8, pooling="grid"), 32)
    assert model.head.in_features == 128 * 2 * 2
    assert model(torch.rand(3, 3, 32, 32)).shape == (3, 8)


@pytest.mark.parametrize(
    ("backbone", "size", "width"),
    [
        ("timm:vit_tiny_patch16_224", 32, (32 // 16) ** 2 * 192),
        ("timm:convnext_atto", 64, (64 // 32) ** 2 * 320),
    ],
    ids=["vit", "convnext"],
)
def test_timm_grid_pooling_flattens_the_features_and_every_parameter_learns(
    backbone: str, size: int, width: int
) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=backbone, embedding_dim=8, pooling="grid"), size)
    assert model.backbone.out_features == model.head.in_features == width
    x = torch.rand(2, 3, size, size)
    model.eval()
    with torch.no_grad():
        features = model.backbone.net.forward_features(x)
        # ViT: [n, 1 + T, C] with the class token first; ConvNeXt: [n, C, H, W].
        expected = (
            features[:, 1:].flatten(1) if features.ndim == 3 else features.permute(0, 2, 3, 1).flatten(1)
        )
        assert_close(model.backbone(x), expected, rtol=0, atol=0)
    model.train()
    model(x)[:, 0].sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
