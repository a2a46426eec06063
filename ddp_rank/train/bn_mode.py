"""What BatchNorm computes during training, decided from the config alone (never from the memory of the machine).

The rule: the direct and the chunked step must train the same function, whichever of the two
``distributed.chunk_size=auto`` picks on a given device. So BatchNorm either normalises groups of images that the
config fixes, which every chunk holds whole, or uses its running statistics (frozen), or the combination is
refused at start-up. The modes:

========== ================================================================== ==============================
mode       statistics in train mode                                            chunks
========== ================================================================== ==============================
frozen     none: running statistics (eval mode), never updated                 any size
groups     each group of ``group`` consecutive local images                   multiples of ``group``
           (ghost batch normalisation, ``model.bn_group_size``)
batch      the whole local batch (plain BatchNorm)                             none: the direct step only
global     the global batch over all ranks (``model.sync_bn``)                 none: the direct step only
========== ================================================================== ==============================

``model.freeze_bn=auto`` (the default) resolves from the config: ``global`` with ``model.sync_bn``, ``groups`` of
``model.bn_group_size`` when that is set, plain batch statistics when the config pins the direct step
(``distributed.chunk_size=0``, or a chunk at least the local batch), and ``frozen`` when the step may be chunked
(``chunk_size=auto`` or a smaller chunk) with no group size given: the FastAP authors' large-batch mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_rank.config import ConfigError
from ddp_rank.train.step_settings import StepSettings

__all__ = ["BatchNormMode"]


@dataclass(frozen=True)
class BatchNormMode:
    """The BatchNorm mode of a run (``kind``: frozen | groups | batch | global) and its group of local images."""

    kind: str
    # groups: images per group; batch and global: the local batch (a chunk must hold all of it)
    group: int = 0

    @property
    def frozen(self) -> bool:
        return self.kind == "frozen"

    @property
    def chunk_multiple(self) -> int:
        """Every chunk of the chunked step is a multiple of this many images (1: any chunk)."""
        return 1 if self.frozen else self.group

    @classmethod
    def from_settings(cls, step: StepSettings, local_batch: int) -> BatchNormMode:
        """The mode of ``step`` for ``local_batch`` images per rank; ConfigError for a combination that would make
        the chunked step train another function than the direct one (the message names the settings)."""
        chunk, group = step.distributed.fixed_chunk, step.model.bn_group_size
        if step.model.freeze_bn == "always":
            return cls("frozen")
        if step.model.sync_bn and group:
            raise ConfigError(
                f"model.sync_bn=true normalises BatchNorm over the global batch and model.bn_group_size={group} "
                "over groups of local images: set one of them (model.bn_group_size=0, or model.sync_bn=false)"
            )
        if group:
            if group > local_batch or local_batch % group:
                raise ConfigError(
                    f"model.bn_group_size={group} does not divide the local batch of {local_batch} images "
                    "(data.global_batch_size / processes): choose a divisor of it, so that every BatchNorm group "
                    "is whole"
                )
            mode = cls("groups", group)
        elif step.model.sync_bn:
            mode = cls("global", local_batch)
        elif step.model.freeze_bn == "never" or chunk == 0 or (chunk is not None and chunk >= local_batch):
            mode = cls("batch", local_batch)
        else:
            return cls("frozen")  # auto, a step that may be chunked and no group size: frozen in both paths
        if chunk and chunk < local_batch and chunk % mode.chunk_multiple:
            raise ConfigError(mode.refusal(f"distributed.chunk_size={chunk}"))
        return mode

    def round_chunk(self, chunk: int, local_batch: int) -> int:
        """The largest chunk of at most ``chunk`` images that keeps every BatchNorm group whole
        (``distributed.chunk_size=auto``); ConfigError when not even one group fits."""
        if chunk >= local_batch:
            return chunk
        rounded = chunk - chunk % self.chunk_multiple
        if rounded < 1:
            raise ConfigError(
                self.refusal(f"distributed.chunk_size=auto (at most {chunk} images fit the memory budget)")
            )
        return rounded

    def refusal(self, chunking: str) -> str:
        """Why ``chunking`` cannot run in this mode, and what to change."""
        if self.kind == "global":
            what = "model.sync_bn=true normalises BatchNorm over the whole global batch, which a chunked step"
            return (
                f"{what} cannot compute ({chunking}): set distributed.chunk_size=0 (and a batch that fits), "
                "model.bn_group_size to a divisor of the chunk (ghost batch normalisation) with "
                "model.sync_bn=false, or model.freeze_bn=always"
            )
        if self.kind == "batch":
            return (
                f"BatchNorm normalises the whole local batch of {self.group} images (model.freeze_bn="
                f"never, or a config that pins the direct step), which a chunked step cannot compute ({chunking}): "
                "set model.bn_group_size to a divisor of the chunk (ghost batch normalisation), "
                "model.freeze_bn=always, or distributed.chunk_size=0 with a batch that fits"
            )
        return (
            f"BatchNorm normalises groups of {self.group} local images (model.bn_group_size={self.group}), which "
            f"every chunk must hold whole, and {chunking} does not: set model.bn_group_size to a divisor of the "
            "chunk, a chunk that is a multiple of the group, or model.freeze_bn=always"
        )

    def describe(self, local_batch: int) -> str:
        """One line for the log and ``ddp-rank plan``."""
        if self.frozen:
            return "frozen: running statistics in every step, never updated (model.freeze_bn)"
        if self.kind == "global":
            return "train mode, statistics of the global batch (model.sync_bn); the direct step only"
        if self.kind == "batch":
            return f"train mode, statistics of the whole local batch of {local_batch} images; the direct step only"
        return (
            f"train mode, statistics of each group of {self.group} local images (ghost batch normalisation, "
            f"model.bn_group_size), in the direct and the chunked step alike; chunks are multiples of {self.group}"
        )
