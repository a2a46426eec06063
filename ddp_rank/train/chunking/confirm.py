"""One real step confirms the chunk ``distributed.chunk_size=auto`` chose, before training starts.

The choice (``ddp_rank.train.chunking.choice``) extrapolates from probe batches and counts the rest of the step from
the parameters; an error in either would show as an out-of-memory error at step 1, or never (a chunk far below
what fits). So, once the model is on its device (wrapped by DDP, its buckets allocated), every rank runs one
forward + backward of the chosen rows (the chunk, or the whole local batch for the direct step) through the bare
module, holding aside what a first step allocates later (optimizer state, the loss's work space, NCCL's buffers:
``FixedCosts.not_yet_allocated``). On ``torch.OutOfMemoryError`` the rank frees what the step held and the
ranks agree (one flag all-reduce, ``ddp_rank.distributed.agreement.agree``): when any rank ran out, every rank
retries with ``BACK_OFF`` of the rows, rounded to whole BatchNorm groups, until all fit.

The trial step leaves the run as it found it: the random streams are forked, BatchNorm buffers and the modules'
train/eval modes restored, no gradient kept, no optimizer update. It runs through the bare module under
``no_sync`` semantics, with no collective inside: a rank that runs out of memory mid-backward must not leave the
others waiting in a gradient all-reduce (DDP's hooks do nothing before its first forward; DeepSpeed's would
reduce, so a DeepSpeed run is not confirmed, and neither is a model whose BatchNorm layers are synchronised
over ranks, which exchange statistics inside the forward).

On CPU nothing limits a process's memory short of the kernel's OOM killer, so the same path runs against the
budget: the step's saved tensors are counted (``chunking.choice.count_saved``) and past the budget raise
``torch.OutOfMemoryError``, as a GPU's allocator would.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ddp_rank.distributed.agreement import agree
from ddp_rank.model import freeze_batchnorm
from ddp_rank.train.chunking.choice import count_saved, example_input

__all__ = ["BACK_OFF", "Confirmation", "confirm_chunk", "trial_step"]

BACK_OFF = 0.75
"""After an out-of-memory error the next try holds this share of the rows (rounded down to whole groups)."""


@dataclass(frozen=True)
class Confirmation:
    """The outcome: the final chunk (None: the direct step), the rows tried in order, whether a step ran at the
    final size (False: not confirmed, ``note`` says why) and the first out-of-memory message met."""

    chunk: int | None
    tried: tuple[int, ...]
    confirmed: bool
    note: str = ""

    @property
    def backed_off(self) -> bool:
        return len(self.tried) > 1

    def describe(self, local_batch: int) -> str:
        final = "the direct step" if self.chunk is None else f"chunks of {self.chunk:,}"
        if not self.confirmed:
            return f"distributed.chunk_size=auto: {final}, not confirmed by a trial step ({self.note})"
        if not self.backed_off:
            return (
                f"distributed.chunk_size=auto: {final} confirmed by a trial step of {self.tried[-1]:,} images"
            )
        steps = " -> ".join(f"{rows:,}" for rows in self.tried)
        note = f"; {self.note}" if self.note else ""
        return (
            f"distributed.chunk_size=auto: backed off to {final} of the local batch of {local_batch:,} after an "
            f"out-of-memory error on some rank in the trial step ({steps} images{note})"
        )


def confirm_chunk(
    try_step: Callable[[int], None],
    local_batch: int,
    chunk: int | None,
    round_chunk: Callable[[int], int] = lambda rows: rows,
) -> Confirmation:
    """Collective (every rank calls it with the same ``chunk``): run ``try_step(rows)`` with the rows of one
    forward + backward of ``chunk`` (the local batch when None); while it raises ``torch.OutOfMemoryError`` on
    any rank, free and retry on every rank with ``BACK_OFF`` of the rows, rounded by ``round_chunk`` (which
    raises, saying why, when no chunk keeps the BatchNorm groups whole). Another error on one rank is raised on
    every rank (``RankFailure``). Raises ValueError when not even one image fits."""
    rows = min(chunk or local_batch, local_batch)
    tried: list[int] = []
    first_error = ""
    while True:
        tried.append(rows)
        ran_out, error = False, None
        try:
            try_step(rows)
        except torch.OutOfMemoryError as exc:
            ran_out = True
            first_error = first_error or str(exc).strip().splitlines()[0]
        except Exception as exc:  # told to every rank, then raised on every rank
            error = f"the trial step of {rows} images failed: {type(exc).__name__}: {exc}"
        release_memory(failed=ran_out or error is not None)
        if not agree(error, stop=ran_out):  # one flag all-reduce: did any rank run out?
            final = None if rows >= local_batch else rows
            note = f"first error: {first_error}" if first_error else ""
            return Confirmation(final, tuple(tried), True, note)
        smaller = int(rows * BACK_OFF)
        if smaller < 1:
            raise ValueError(
                f"a trial step of {rows} image(s) ran out of memory on some rank "
                f"({first_error or 'another rank'}): use a smaller data.image_size or backbone, or free the device"
            )
        rows = round_chunk(smaller)


def release_memory(failed: bool) -> None:
    """Give the device's cache back; after a failed step, first drop what it left (its frames are gone with the
    exception; a collection frees what they held in cycles). A full collection costs a large process up to a
    second: a step that succeeded freed its tensors as it returned."""
    if failed:
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def trial_step(
    module: nn.Module,
    image_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager[object]],
    freeze: bool,
    hold_aside: int = 0,
    saved_limit: int | None = None,
) -> Callable[[int], None]:
    """``try_step`` for :func:`confirm_chunk`: one forward + backward of ``rows`` example inputs through
    ``module`` (the bare module: no engine hooks, no collective) in train mode, BatchNorm frozen when ``freeze``,
    under ``autocast()``; on a GPU ``hold_aside`` bytes are held through it (what the first step allocates later);
    on CPU the saved tensors past ``saved_limit`` bytes raise ``torch.OutOfMemoryError``. Leaves the module, its
    gradients and the random streams as it found them."""

    def run(rows: int) -> None:
        device = next(module.parameters()).device
        with _untouched(module, device):
            module.train()
            if freeze:
                freeze_batchnorm(module)
            held = (
                torch.empty(hold_aside, dtype=torch.uint8, device=device)
                if hold_aside and device.type == "cuda"
                else None
            )
            images = example_input(module, rows, image_size, device)
            limit = count_saved(saved_limit) if saved_limit is not None and device.type != "cuda" else None
            with limit or contextlib.nullcontext(), autocast():
                out = module(images)
            out.float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            del held, images, out

    return run


@contextlib.contextmanager
def _untouched(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore ``module``'s gradients, buffers and train/eval modes, and the random streams, after the block."""
    modes = {m: m.training for m in module.modules()}
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, p.grad) for p in module.parameters()]
    for p, _ in grads:
        p.grad = None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        with torch.no_grad():
            for buffer, kept in buffers:
                buffer.copy_(kept)
        for p, grad in grads:
            p.grad = grad
        for m, training in modes.items():
            m.train(training)
