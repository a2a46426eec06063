"""The ``eval`` and ``distributed`` sections: the retrieval evaluation, and the global-batch step."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import field_validator, model_validator

from ddp_rank.config.checks import (
    Bool,
    ConfigError,
    Float,
    Int,
    ListOf,
    Positive,
    Rate,
    Text,
    _field,
    _Section,
)


class EvalConfig(_Section):
    """Retrieval evaluation (Recall@k, MAP@R) with the datasets' protocols."""

    protocol: Literal["sop", "inshop", "vehicleid", "verification", "identification"] = _field(
        "sop",
        "'sop': each test image queries all the others (also the demo); 'inshop': query set vs gallery set; "
        "'vehicleid': small / medium / large test lists, one random gallery image per vehicle; 'verification': "
        "every pair of the test split, TPR@FPR, ROC AUC, EER, AP; 'identification': a seeded enrolled / "
        "non-enrolled split of the test identities, CMC and FNIR@FPIR.",
    )
    ks: Annotated[list[Positive], ListOf] = _field(
        [],
        "Recall@k cut-offs; empty = the protocol's (SOP 1,10,100,1000; In-Shop 1,10,20,30,40,50; "
        "VehicleID 1,5).",
    )
    batch_size: Int = _field(128, "Images per rank per forward pass while embedding the test set.", minimum=1)
    search: Literal["auto", "faiss", "torch"] = _field(
        "auto",
        "Exact inner-product search: 'torch' = chunked top-k on the GPU when there is one (else the CPU), "
        "'faiss' = faiss IndexFlatIP on the CPU, 'auto' = torch on a GPU, else faiss if installed, else torch.",
    )
    map_at_r: Bool = _field(
        True,
        "Also report MAP@R (Musgrave et al. 2020); never for VehicleID, where every query has one relevant "
        "image and MAP@R equals Recall@1.",
    )
    vehicleid_sizes: Annotated[list[Literal["small", "medium", "large"]], ListOf] = _field(
        ["small", "medium", "large"],
        "VehicleID test lists to evaluate.",
    )
    vehicleid_repeats: Int = _field(
        1, "VehicleID: gallery draws averaged (one random image per vehicle each).", minimum=1
    )
    metrics: Annotated[list[Literal["verification", "identification"]], ListOf] = _field(
        [],
        "Deployment figures reported beside eval.protocol's (sop, inshop): 'verification' (TPR@FPR, ROC AUC, "
        "EER, AP over every pair of the test split) and/or 'identification' (CMC, FNIR@FPIR); their curves "
        "are drawn as roc.png, det.png, pr.png, cmc.png.",
    )
    fprs: Annotated[list[Rate], ListOf] = _field(
        [1e-2, 1e-3, 1e-4],
        "Verification: the false positive rates of the reported TPR@FPR (exact, no interpolation; a rate "
        "needing more negative pairs than the split has is reported as not measurable).",
    )
    max_positive_pairs: Int = _field(
        1 << 24,
        "Verification: most positive (same-class) pairs kept in memory, about 28 bytes each; the negative pairs "
        "are counted in blocks and never kept. A split with more positive pairs is refused.",
        minimum=1,
    )
    block_mb: Int = _field(
        256, "Verification and identification: MiB of work space for one block of pair scores.", minimum=1
    )
    enrolled_fraction: Float = _field(
        0.5,
        "Identification: share of the test identities enrolled in the gallery (drawn with train.seed); the "
        "others' images are the open-set (non-mated) probes. 1 = closed set only.",
        above=0.0,
        maximum=1.0,
    )
    gallery_per_identity: Int = _field(
        1,
        "Identification: gallery images per enrolled identity, drawn at random (the rest are its probes); "
        "0 = all of its images but one.",
        minimum=0,
    )
    fpirs: Annotated[list[Rate], ListOf] = _field(
        [1e-1, 1e-2],
        "Identification: the false positive identification rates of the reported FNIR@FPIR.",
    )
    grid_queries: Int = _field(
        8,
        "The retrieval picture (a run's retrieval.png at each evaluation; <results>-retrieval-<row>.png beside "
        "the results of ddp-rank eval): this many test queries, one row each, with their grid_k nearest "
        "neighbours framed green (the query's class) or red (another), captioned with the class names; 0 = no "
        "picture. Feature shards hold no image: no picture.",
        minimum=0,
    )
    grid_k: Int = _field(5, "The retrieval picture: neighbours shown per query.", minimum=1)
    grid_seed: Int = _field(
        0,
        "The retrieval picture: seed of the query sample (not train.seed, so runs that differ in their seed show "
        "the same queries and `ddp-rank compare --grid` can set them side by side).",
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.metrics and self.protocol == "vehicleid":
            raise ConfigError(
                f"eval.metrics={','.join(self.metrics)} is not available with eval.protocol=vehicleid (its test "
                "lists are evaluated one by one): use eval.protocol=verification or identification on one list"
            )
        return self


class DistributedConfig(_Section):
    """Global-batch loss and chunked step (the distributed layer)."""

    chunk_size: Text = _field(
        "auto",
        "Images per chunk of the chunked (gradient-cache) step, used whenever the per-rank batch exceeds it; "
        "0 = never chunk; 'auto' = the largest chunk whose activations fit the memory budget, measured at start-up "
        "by forwards + backwards of the real model at the real image size, then confirmed by one real step on "
        "every rank, which backs off together on an out-of-memory error (a batch that fits is not chunked; the "
        "log and `ddp-rank plan` say what was chosen and why).",
    )
    capture_chunk: Literal["none", "compile", "graphs"] = _field(
        "none",
        "Run the chunked step's chunks through torch.compile, one fixed chunk shape (for small chunks, where "
        "launching a chunk's eager operations costs more than running them): 'compile' = inductor's fused kernels; "
        "'graphs' = also CUDA graphs on a GPU (inductor's reduce-overhead); 'none' = eager. A shorter last chunk and, "
        "under DDP, the last chunk run eagerly; the first step includes the compile time (logged). Gradients equal "
        "the eager step's up to the order of sums; DeepSpeed is refused.",
    )
    memory_fraction: Float = _field(
        0.8,
        "chunk_size=auto: the share of the memory budget the step may fill: of the GPU's free memory, less what "
        "the step holds besides activations (weights, gradients, DDP's buckets, NCCL's buffers, optimizer state, "
        "the loss's work space, the input batches, workspaces), on CPU of memory_budget_mb or of the node's "
        "available memory. The rest is the margin for what the probe misses (on CPU a step's resident memory "
        "grows 8-11% more per image than the bytes it counts).",
        above=0,
        maximum=1,
    )
    memory_budget_mb: Int = _field(
        0,
        "chunk_size=auto on CPU: MiB the step's activations may take on each process, of which memory_fraction is "
        "planned for (the margin keeps the chunk inside it); 0 = the node's available memory (MemAvailable, or the "
        "cgroup's limit less its usage where smaller: a SLURM --mem job, a container) shared by its processes, "
        "times memory_fraction.",
        minimum=0,
    )
    grad_reduction: Literal["mean", "sum"] = _field(
        "mean",
        "How the engine reduces parameter gradients over ranks: 'mean' (DDP, DeepSpeed ZeRO) or 'sum'. The "
        "global-batch loss scales its gradient so that the result equals single-process training either way.",
    )
    cpu: Bool = _field(False, "Force CPU (gloo) even when a GPU is visible; with no GPU this is automatic.")
    find_unused_parameters: Bool = _field(
        False, "DDP find_unused_parameters (only for backbones with unused heads)."
    )

    @field_validator("chunk_size")
    @classmethod
    def _chunk(cls, value: str) -> str:
        """``'auto'`` or the canonical digits of a number of images (``'1_024'`` -> ``'1024'``)."""
        text = value.strip().lower()
        if text != "auto" and not (text.isdigit() or text.replace("_", "").isdigit()):
            raise ConfigError(
                f"distributed.chunk_size={value!r} must be 'auto' or a number of images (0 = never chunk)"
            )
        return text if text == "auto" else str(int(text.replace("_", "")))

    @property
    def fixed_chunk(self) -> int | None:
        """The chunk size set by hand (0: never chunk), or None for 'auto'."""
        return None if self.chunk_size == "auto" else int(self.chunk_size)
