"""The ``loss`` section: the listwise ranking loss, or any pytorch-metric-learning loss, and its hyper-parameters."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from ddp_rank.config.call_spec import PML_PREFIX, parse_call
from ddp_rank.config.checks import Bool, ConfigError, Float, Int, Text, _field, _Section, _suggest

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
        "inputs included, when Triton imports; on CPU float32 blocks the passes compiled for the CPU on first "
        "use where a C compiler is found; the torch path elsewhere; logged once), 'torch' (plain tensor "
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
