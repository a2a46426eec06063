"""The batch layout of a run: the global batch, each rank's share, the chunk of the chunked step and the
BatchNorm mode (which groups of images BatchNorm normalises: every chunk holds them whole).

Decided once, from the config and the number of processes, and passed down: the trainer, DeepSpeed's batch
settings, the start-up report and ``ddp-rank plan`` all read it from here. The data layer checks the same
division for its own callers (``ddp_rank.data.sampling.plan.local_batch_size``); this is where the config's keys are named.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_rank.config import ConfigError
from ddp_rank.data.sampling.plan import local_batch_size
from ddp_rank.train.bn_mode import BatchNormMode
from ddp_rank.train.chunking.step import runs_chunked
from ddp_rank.train.step_settings import StepSettings

__all__ = ["BatchLayout"]


@dataclass(frozen=True)
class BatchLayout:
    """``global_batch`` images per step over ``world_size`` ranks, ``local_batch`` each; ``chunk_size`` is the
    most rows one forward with autograd holds (None: the direct step, the local batch fits); ``batchnorm`` what
    BatchNorm computes in both steps (``ddp_rank.train.bn_mode``)."""

    global_batch: int
    world_size: int
    local_batch: int
    chunk_size: int | None
    batchnorm: BatchNormMode

    @classmethod
    def from_settings(
        cfg_cls, step: StepSettings, world_size: int, chunk_size: int | None = None
    ) -> BatchLayout:
        """The layout of ``step`` on ``world_size`` ranks; ``chunk_size`` is the chunk when it was chosen elsewhere
        (``distributed.chunk_size=auto``: ``ddp_rank.train.chunking.choice``), else the config's. A chunk at least as
        large as the local batch is no chunk (``ddp_rank.train.chunking.step.runs_chunked``). A chosen chunk is rounded
        down to whole BatchNorm groups; a chunk that cannot hold them is a ConfigError."""
        try:
            local = local_batch_size(step.data.global_batch_size, world_size)
        except ValueError as exc:
            raise ConfigError(
                f"data.global_batch_size={step.data.global_batch_size} does not split over {world_size} "
                f"process(es) ({exc}): every rank holds the same number of images; change the batch or "
                "--num_processes"
            ) from None
        batchnorm = BatchNormMode.from_settings(step, local)
        chunk = chunk_size if chunk_size is not None else step.distributed.fixed_chunk
        if chunk_size and step.distributed.fixed_chunk is None:  # chosen by chunk_size=auto: whole groups
            chunk = batchnorm.round_chunk(chunk_size, local)
        return cfg_cls(
            global_batch=step.data.global_batch_size,
            world_size=world_size,
            local_batch=local,
            chunk_size=chunk if chunk and runs_chunked(local, chunk) else None,
            batchnorm=batchnorm,
        )

    @property
    def chunked(self) -> bool:
        return self.chunk_size is not None

    def describe(self) -> str:
        """``128 (64 per rank, chunked step in chunks of 32)`` for logs and summaries."""
        step = f"chunked step in chunks of {self.chunk_size}" if self.chunk_size else "direct step"
        return f"{self.global_batch} ({self.local_batch} per rank, {step})"

    def rounding_note(self, chosen: int | None) -> str:
        """``; 24 to hold whole BatchNorm groups of 8`` when this layout's chunk is ``chosen`` rounded down to
        whole groups (``from_settings``), else nothing: the words after a chunk choice in the logs and the plan."""
        if self.chunk_size is None or self.chunk_size == chosen:
            return ""
        return f"; {self.chunk_size:,} to hold whole BatchNorm groups of {self.batchnorm.group}"
