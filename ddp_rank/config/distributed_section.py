"""The ``distributed`` section: the global-batch loss across ranks and the chunked step."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from ddp_rank.config.checks import (
    Bool,
    ConfigError,
    Float,
    Int,
    Text,
    _field,
    _Section,
)


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
