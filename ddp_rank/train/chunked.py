"""The direct and the chunked (gradient-cache) forward-backward of one step.

A listwise loss needs the embeddings of the whole batch at once, but backpropagating a large batch through a
backbone needs memory for all its activations. The chunked step (the FastAP paper's large-batch heuristic,
section 4.1, and GradCache) keeps only the embeddings:

1. split: cut the local batch into chunks of at most ``chunk_size`` rows (the last may be shorter);
2. forward_no_grad: embed every chunk without a graph, recording the RNG state before each chunk;
3. build_cache: run the loss on the detached float32 embeddings and keep ``G = dL/de`` (for a
   ``GlobalBatchLoss`` this is where the ranks exchange embeddings and gradient rows);
4. forward_backward: re-embed each chunk with the SAME RNG state (so dropout masks and on-device augmentation
   match pass 1, and the cached G belongs to the activations being differentiated) and backpropagate
   ``sum(e_chunk * G_chunk)``, whose gradient w.r.t. the parameters is the chunk's share of ``dL/dtheta``.

Gradients are those of the direct step for a model whose forward is row-independent (no BatchNorm in train
mode); with dropout they are those of the same chunk-by-chunk forwards kept in one graph (the masks are drawn
per chunk, so they are not the masks of one big forward, but they are the same in both passes). BatchNorm is
frozen in the chunked path (see ``frozen_batchnorm``) and its running statistics are averaged over the ranks before
pass 1 (``ddp_rank.train.batchnorm``), so both passes on every rank normalise alike; the direct path leaves it alone.
Gradient reduction (DDP, DeepSpeed) happens once per step: ``no_sync`` wraps the forward AND backward of every
chunk but the last, and DeepSpeed's backwards are coalesced. Mixed precision: the loss and G are float32,
only the chunk objectives go through the engine's loss scaling, so the scale is applied exactly once.
The cost is one extra no-grad forward, roughly a third of a forward + backward (``benchmarks/distributed.py``
measures it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from ddp_rank.train.backends import StepBackend, frozen_batchnorm

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class StepOutput:
    """What one forward-backward returns: the loss value (detached), how many chunks were used (1 = direct
    path) and, when asked for (``return_embeddings=True``), this rank's embeddings ``[n, d]``, detached, for
    the caller's own metrics."""

    loss: Tensor
    chunks: int
    embeddings: Tensor | None = None


@dataclass(frozen=True)
class RngState:
    """The generator states one chunk's forward starts from: CPU always, the CUDA device when on one."""

    cpu: Tensor
    cuda: Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block from this state, then put the global generators back where they were."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def runs_chunked(largest_batch: int, chunk_size: int | None) -> bool:
    """The one rule for direct or chunked: a step is chunked when some rank holds more rows than a chunk (a
    chunk at least as large as every rank's batch is no chunk). The batch layout applies it to the configured
    batch; :func:`forward_backward` to the rows the ranks actually hold."""
    return chunk_size is not None and largest_batch > chunk_size


def forward_backward(
    backend: StepBackend,
    inputs: Tensor,
    labels: Tensor,
    loss_fn: LossFn,
    chunk_size: int | None = None,
    return_embeddings: bool = False,
) -> StepOutput:
    """One step's forward and backward; gradients end up where the engine's optimizer step expects them.

    It calls backward itself (the caller only steps the optimizer afterwards) and returns the detached loss.
    Parameters of ``loss_fn`` itself (a proxy loss's proxies) receive their gradient too, on both paths.

    Args:
        backend: the engine (``PlainBackend``, ``DDPBackend``, ``DeepSpeedBackend``, ``backend_for_accelerator``).
        inputs: the local batch ``[n, ...]`` already on the model's device; ``n`` may be 0 on some rank.
        labels: ``[n]`` labels handed to ``loss_fn`` untouched.
        loss_fn: ``(embeddings [n, d], labels [n]) -> 0-d loss``, e.g. a ``GlobalBatchLoss``. The model must map
            ``[c, ...]`` inputs to ``[c, d]`` embeddings.
        chunk_size: the most rows one forward with autograd may hold. ``None``, or a step whose largest local
            batch over all ranks fits, runs the direct path (one forward, one backward); otherwise every rank
            runs the chunked path (a rank with no rows runs it with one empty chunk).
        return_embeddings: also return this rank's embeddings, detached (``StepOutput.embeddings``); the
            chunked path returns those of its no-grad pass, which the second pass reproduces.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or None, got {chunk_size}")
    if inputs.shape[0] != labels.shape[0]:
        raise ValueError(f"inputs have {inputs.shape[0]} rows but labels have {labels.shape[0]}")
    inputs = backend.prepare_inputs(inputs)
    with backend.accumulate():
        if chunk_size is None or not runs_chunked(backend.largest_batch(inputs.shape[0]), chunk_size):
            output = _direct(backend, inputs, labels, loss_fn)
        else:
            backend.check_chunked()
            output = _chunked(backend, inputs, labels, loss_fn, chunk_size)
    backend.finish()
    return output if return_embeddings else StepOutput(output.loss, output.chunks)


def _direct(backend: StepBackend, inputs: Tensor, labels: Tensor, loss_fn: LossFn) -> StepOutput:
    # As at every checkpoint and evaluation: then the averaging a checkpoint does is the one this step would have
    # done, and a run stopped and resumed at any step keeps the running statistics of an uninterrupted one.
    backend.sync_batchnorm()
    with backend.autocast():
        embeddings = backend.model(inputs)
    loss = _scalar(loss_fn(embeddings, labels))
    backend.backward(loss)
    return StepOutput(loss.detach(), chunks=1, embeddings=embeddings.detach())


def _chunked(
    backend: StepBackend, inputs: Tensor, labels: Tensor, loss_fn: LossFn, chunk_size: int
) -> StepOutput:
    chunks = inputs.split(chunk_size)
    # Both passes normalise with the running statistics, so they must be the same on every rank (a direct step
    # or DDP's broadcast of rank 0's buffers before pass 2 would otherwise make the passes disagree).
    backend.sync_batchnorm()
    with frozen_batchnorm(backend.bare_module):
        embeddings, states = _forward_no_grad(backend, chunks)
        loss, cache = _build_cache(embeddings, labels, loss_fn)
        _forward_backward(backend, chunks, states, cache.split(chunk_size))
    return StepOutput(loss, chunks=len(chunks), embeddings=embeddings)


def _forward_no_grad(backend: StepBackend, chunks: tuple[Tensor, ...]) -> tuple[Tensor, list[RngState]]:
    """Pass 1: embeddings of every chunk without a graph, and the RNG state each chunk started from."""
    states, outputs = [], []
    with torch.no_grad(), backend.autocast():
        for chunk in chunks:
            states.append(RngState.capture(chunk.device))
            outputs.append(backend.bare_module(chunk))
    return torch.cat(outputs), states


def _build_cache(embeddings: Tensor, labels: Tensor, loss_fn: LossFn) -> tuple[Tensor, Tensor]:
    """The loss on the detached embeddings, in float32 at least, and ``G = dL/de`` in that dtype.

    A full ``backward`` rather than ``autograd.grad`` of the leaf alone: parameters of the loss itself (a proxy
    loss's proxies) get their gradient here, once, as in the direct path."""
    leaf = embeddings.detach().to(torch.promote_types(embeddings.dtype, torch.float32)).requires_grad_()
    loss = _scalar(loss_fn(leaf, labels))
    loss.backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return loss.detach(), grad


def _forward_backward(
    backend: StepBackend, chunks: tuple[Tensor, ...], states: list[RngState], grads: tuple[Tensor, ...]
) -> None:
    """Pass 2: re-embed each chunk from its recorded RNG state and backpropagate its slice of G.

    Gradient reduction is skipped for every chunk but the last, forward included (DDP decides at forward
    time whether the coming backward reduces), so each step reduces once.
    """
    last = len(chunks) - 1
    for i, (chunk, state, grad) in enumerate(zip(chunks, states, grads)):
        sync = backend.no_sync() if i < last else nullcontext()
        with sync, state.replay():
            with backend.autocast():
                embeddings = backend.model(chunk)
            backend.backward((embeddings.to(grad.dtype) * grad).sum())


def _scalar(loss: Tensor) -> Tensor:
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a 0-d tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss
