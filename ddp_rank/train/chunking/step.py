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

Gradients are those of the direct step for a model whose forward is row-independent; with dropout they are those
of the same chunk-by-chunk forwards kept in one graph (the masks are drawn per chunk, so they are not the masks of
one big forward, but they are the same in both passes). BatchNorm is what could make the two paths train
different functions, so the step never changes it behind the caller's back: layers in eval mode (frozen) are
row-independent; ghost batch normalisation (``ddp_rank.train.ghost_batchnorm``) normalises fixed groups of rows,
which chunks that are multiples of the group hold whole (pass 1 updates the running statistics group by group as
the direct step does, pass 2 leaves them as pass 1 left them, whatever DDP broadcasts); any other BatchNorm layer
in train mode normalises over whatever rows it is given, and the chunked path refuses it (ValueError) instead of
silently computing another function. The running statistics are averaged over the ranks before every step
(``ddp_rank.train.batchnorm``), so every rank starts a step from the same ones.
Gradient reduction (DDP, DeepSpeed) happens once per step: ``no_sync`` wraps the forward AND backward of every
chunk but the last, and DeepSpeed's backwards are coalesced. Mixed precision: the loss and G are float32,
only the chunk objectives go through the engine's loss scaling, so the scale is applied exactly once.

Host cost per chunk. With chunks of 32-64 images a GPU runs a chunk in a few milliseconds, so the host must
queue chunk k + 1 while the GPU runs chunk k: nothing in the chunk loops reads a value on the host (no
``item``, no tensor built from host values; ``tests/train/test_chunk_host_cost.py`` counts them), the inputs
are prepared once per batch (a model with ``prepare_batch`` / ``batch_prepared``, as ``EmbeddingNet``:
uint8 to float, normalisation, channels-last) instead of once per chunk and pass, and each pass is one autocast
region, so that autocast casts each weight once per pass, not once per chunk (the backwards run with autocast
off, as PyTorch asks).
The cost is one extra no-grad forward, roughly a third of a forward + backward (``benchmarks/distributed.py``
measures it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddp_rank.autocast_off import outside_autocast
from ddp_rank.train.backends import StepBackend
from ddp_rank.train.batchnorm import batchnorm_buffers
from ddp_rank.train.ghost_batchnorm import GhostBatchNorm

if TYPE_CHECKING:
    from ddp_rank.train.chunking.captured import CapturedChunk

LossFn = Callable[[Tensor, Tensor], Tensor]


@runtime_checkable
class PreparesBatch(Protocol):
    """A model whose forward starts with per-image preparation it can do once for a whole batch
    (``ddp_rank.model.EmbeddingNet``): ``prepare_batch(x)`` returns it done, and inside ``batch_prepared()`` the
    forward takes such a batch (or rows of it) as it is. Any other model is called with the inputs unchanged."""

    def prepare_batch(self, inputs: Tensor) -> Tensor: ...

    def batch_prepared(self) -> AbstractContextManager[Any]: ...


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
    captured: CapturedChunk | None = None,
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
            runs the chunked path (a rank with no rows runs it with one empty chunk). Both compute the same
            function; a model whose BatchNorm would not (a plain BatchNorm layer in train mode, or ghost groups
            that do not divide the chunk) is refused with a ValueError before any forward.
        return_embeddings: also return this rank's embeddings, detached (``StepOutput.embeddings``); the
            chunked path returns those of its no-grad pass, which the second pass reproduces.
        captured: run the chunks of its shape compiled (``ddp_rank.train.chunking.captured``); None: all eager.

    Examples:
        One process, a linear embedding: the step in chunks of 4 rows leaves the gradients of the direct step.

        >>> import torch
        >>> from ddp_rank.distributed import GlobalBatchLoss
        >>> from ddp_rank.losses import FastAPLoss
        >>> from ddp_rank.train import PlainBackend, forward_backward
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = torch.nn.Linear(32, 16), GlobalBatchLoss(FastAPLoss())
        >>> inputs, labels = torch.randn(12, 32), torch.arange(6).repeat_interleave(2)
        >>> forward_backward(PlainBackend(model), inputs, labels, loss_fn, chunk_size=4).chunks
        3
        >>> chunked = model.weight.grad.clone()
        >>> model.zero_grad()
        >>> _ = forward_backward(PlainBackend(model), inputs, labels, loss_fn)
        >>> torch.allclose(chunked, model.weight.grad, atol=1e-6)
        True
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
            output = _chunked(backend, inputs, labels, loss_fn, chunk_size, captured)
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
    backend: StepBackend,
    inputs: Tensor,
    labels: Tensor,
    loss_fn: LossFn,
    chunk_size: int,
    captured: CapturedChunk | None = None,
) -> StepOutput:
    check_batchnorm(backend.bare_module, chunk_size)
    # As in the direct step: every rank starts from the same running statistics (frozen layers normalise with
    # them in both passes; DDP's broadcast of rank 0's buffers before pass 2 then changes nothing).
    backend.sync_batchnorm()
    prepared, takes_prepared = _prepare_once(backend.bare_module, inputs)
    chunks = prepared.split(chunk_size)
    with takes_prepared:
        embeddings, states = _forward_no_grad(backend, chunks, captured)
        loss, cache = _build_cache(embeddings, labels, loss_fn)
        # Pass 1 updated the running statistics of layers in train mode, group by group as a direct forward
        # would; pass 2 must neither update them again nor let DDP replace them with rank 0's.
        after_pass_1 = [b.clone() for b in _live_batchnorm_buffers(backend.bare_module)]
        _forward_backward(backend, chunks, states, cache.split(chunk_size), captured)
    with torch.no_grad():
        for buffer, kept in zip(_live_batchnorm_buffers(backend.bare_module), after_pass_1):
            buffer.copy_(kept)
    return StepOutput(loss, chunks=len(chunks), embeddings=embeddings)


def _prepare_once(module: nn.Module, inputs: Tensor) -> tuple[Tensor, AbstractContextManager[Any]]:
    """The batch prepared once for both passes, and the context in which the model takes it so; a model
    without :class:`PreparesBatch` gets its inputs unchanged (and prepares each chunk in its forward)."""
    if isinstance(module, PreparesBatch):
        return module.prepare_batch(inputs), module.batch_prepared()
    return inputs, nullcontext()


def check_batchnorm(module: nn.Module, chunk_size: int) -> None:
    """Refuse a chunked step whose BatchNorm would compute another function than the direct step (ValueError,
    saying what to change): a BatchNorm layer in train mode that is not ghost batch normalisation normalises each
    chunk by its own statistics, and ghost groups that do not divide the chunk would be cut across chunks."""
    for name, layer in module.named_modules():
        if not isinstance(layer, _BatchNorm) or not _uses_batch_statistics(layer):
            continue
        if not isinstance(layer, GhostBatchNorm):
            raise ValueError(
                f"the chunked step (chunk_size={chunk_size}) cannot compute the batch statistics of the BatchNorm "
                f"layer {name or type(layer).__name__} in train mode (each chunk would be normalised by itself): "
                "freeze BatchNorm (ddp_rank.model.freeze_batchnorm(model) after model.train()), use ghost batch "
                "normalisation with a group that divides the chunk (ddp_rank.train.convert_to_ghost(model, "
                "group_size)), or a chunk_size that holds the whole batch"
            )
        if chunk_size % layer.group_size:
            raise ValueError(
                f"chunk_size={chunk_size} cuts the BatchNorm groups of {layer.group_size} rows of {name} across "
                f"chunks: use a chunk_size that is a multiple of {layer.group_size}"
            )


def _uses_batch_statistics(layer: _BatchNorm) -> bool:
    """Train mode, or a layer without running statistics, which normalises with its input's even in eval mode."""
    return layer.training or layer.running_mean is None


def _live_batchnorm_buffers(module: nn.Module) -> list[Tensor]:
    """The running statistics of the BatchNorm layers that a train-mode forward updates."""
    return [
        b for m in module.modules() if isinstance(m, _BatchNorm) and m.training for b in batchnorm_buffers(m)
    ]


def _forward_no_grad(
    backend: StepBackend, chunks: tuple[Tensor, ...], captured: CapturedChunk | None = None
) -> tuple[Tensor, list[RngState]]:
    """Pass 1: embeddings of every chunk without a graph, and the RNG state each chunk started from."""
    states, outputs = [], []
    with torch.no_grad(), backend.autocast():
        for i, chunk in enumerate(chunks):
            states.append(RngState.capture(chunk.device))
            embed: Callable[[Tensor], Tensor] = backend.bare_module
            if captured is not None:
                embed = captured.module_for(backend, chunk, last=i == len(chunks) - 1, grad=False)
            outputs.append(embed(chunk))
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
    backend: StepBackend,
    chunks: tuple[Tensor, ...],
    states: list[RngState],
    grads: tuple[Tensor, ...],
    captured: CapturedChunk | None = None,
) -> None:
    """Pass 2: re-embed each chunk from its recorded RNG state and backpropagate its slice of G.

    Gradient reduction is skipped for every chunk but the last, forward included (DDP decides at forward
    time whether the coming backward reduces), so each step reduces once.

    One autocast region for the whole pass: autocast keeps the low-precision copy of each weight until its
    outermost region ends, so the weights are cast once per pass instead of once per chunk (the copies carry
    their cast in the graph, so every chunk's backward still reaches the float32 weights). The backwards run
    with autocast off, as PyTorch asks; turning it off inside the region keeps the cached copies.
    """
    last = len(chunks) - 1
    with backend.autocast():
        for i, (chunk, state, grad) in enumerate(zip(chunks, states, grads)):
            sync = backend.no_sync() if i < last else nullcontext()
            embed: Callable[[Tensor], Tensor] = backend.model
            if captured is not None:
                embed = captured.module_for(backend, chunk, last=i == last, grad=True)
            with sync, state.replay():
                embeddings = embed(chunk)
                with outside_autocast(chunk.device):
                    backend.backward((embeddings.to(grad.dtype) * grad).sum())


def _scalar(loss: Tensor) -> Tensor:
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a 0-d tensor, got {getattr(loss, 'shape', type(loss))}")
    return loss
