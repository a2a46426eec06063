"""How one training step talks to its engine: plain PyTorch, DDP, DeepSpeed ZeRO-1/2, or accelerate.

The step (``ddp_rank.train.chunking.step``) needs only a few things from an engine: the module to call with
autograd, the bare module for the no-grad pass, a way to skip gradient synchronisation for one
forward+backward, a context around all the backwards of one step, a backward that applies the engine's loss
scaling exactly once, and the largest local batch over ranks (to pick the path). A backend supplies them;
nothing here knows about images, data or losses.

Use after a backend's step exactly what the engine's own idiom uses after ``backward``:
``optimizer.step()`` (plain, DDP, accelerate, accelerate + DeepSpeed: the latter's optimizer step is a
no-op because the engine already stepped) or ``engine.step()`` (DeepSpeed driven directly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ddp_rank.distributed import max_over_ranks
from ddp_rank.train.batchnorm import sync_batchnorm_buffers


class StepBackend(Protocol):
    """What the direct and chunked steps need from a training engine."""

    @property
    def model(self) -> nn.Module:
        """The module to call for forwards WITH autograd (the engine's wrapper, so its hooks run)."""

    @property
    def bare_module(self) -> nn.Module:
        """The wrapped module itself, for forwards without autograd (no wrapper hooks or buffer broadcast)."""

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Skip gradient reduction for one forward+backward; reduction happens on the next synced one."""

    def accumulate(self) -> contextlib.AbstractContextManager[Any]:
        """Surrounds every backward of one step (DeepSpeed: one gradient reduction for all of them)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context for forwards (a no-op without AMP)."""

    def prepare_inputs(self, inputs: Tensor) -> Tensor:
        """The inputs as the engine's forward expects them (DeepSpeed bf16/fp16: in the parameters' dtype)."""

    def check_chunked(self) -> None:
        """Raise a clear error if the engine cannot run the chunked path (checked before its first forward)."""

    def sync_batchnorm(self) -> None:
        """Collective: make the BatchNorm running statistics equal on every data-parallel rank (their mean)."""

    def backward(self, objective: Tensor) -> None:
        """Back-propagate a scalar, applying the engine's loss scale once."""

    def finish(self) -> None:
        """End of the step's backward work (accelerate + DeepSpeed: the engine step that backward includes)."""

    def largest_batch(self, rows: int) -> int:
        """The largest local batch over the engine's data-parallel ranks (`rows` in one process).

        The step takes the direct or the chunked path on ALL ranks together: the two paths call the wrapper's
        forward and the loss's collectives in a different order, so ranks that chose differently would
        deadlock (DDP's bucket rebuild and buffer broadcast are collectives).
        """


class PlainBackend:
    """One process, plain PyTorch; optional AMP (``autocast_dtype``) and ``torch.amp.GradScaler``."""

    def __init__(
        self,
        model: nn.Module,
        scaler: torch.amp.GradScaler | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self._model = model
        self.scaler = scaler
        self.autocast_dtype = autocast_dtype

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def bare_module(self) -> nn.Module:
        return self._model

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def accumulate(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(self._model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=self.autocast_dtype)

    def prepare_inputs(self, inputs: Tensor) -> Tensor:
        return inputs  # autocast casts inside the forward

    def check_chunked(self) -> None:
        return None

    def sync_batchnorm(self) -> None:
        return None  # one process

    def backward(self, objective: Tensor) -> None:
        (self.scaler.scale(objective) if self.scaler is not None else objective).backward()

    def finish(self) -> None:
        return None

    def largest_batch(self, rows: int) -> int:
        return rows


class DDPBackend(PlainBackend):
    """``DistributedDataParallel``: ``no_sync`` skips the all-reduce; the bare module skips buffer broadcast."""

    def __init__(
        self,
        model: DistributedDataParallel,
        scaler: torch.amp.GradScaler | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"DDPBackend needs a DistributedDataParallel model, got {type(model).__name__}")
        super().__init__(model, scaler, autocast_dtype)
        self._ddp = model

    @property
    def bare_module(self) -> nn.Module:
        return self._ddp.module

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._ddp.no_sync()

    def check_chunked(self) -> None:
        _refuse_static_graph(self._ddp)

    def sync_batchnorm(self) -> None:
        sync_batchnorm_buffers(self._ddp.module, self._ddp.process_group)

    def largest_batch(self, rows: int) -> int:
        return max_over_ranks(rows, self._ddp.process_group)


class DeepSpeedBackend:
    """A DeepSpeed engine with ZeRO stage 1 or 2.

    Why ``coalesce_grad_reduction``: with ``gradient_accumulation_steps=1`` every ``engine.backward`` is a
    reduction boundary, and in ZeRO-1/2 two backwards before one ``step`` keep only the LAST backward's
    gradient (silently). Inside ``coalesce_grad_reduction`` the backwards accumulate locally and one reduction
    runs on exit. ``engine.no_sync`` cannot be used instead: it refuses ZeRO-2. Loss scaling (fp16) and the
    engine's own ``1/gradient_accumulation_steps`` are applied by ``engine.backward``. Note that DeepSpeed
    clips the gradient norm to 1.0 when the config does not set ``gradient_clipping`` (0.19.8: the default
    is 1.0); set it explicitly (0 disables) to get the update DDP gives.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine``.
        step_in_backward: call ``engine.step()`` in ``finish`` (accelerate's DeepSpeed wrapper does so inside
            ``accelerator.backward``, and its ``optimizer.step()`` is then a no-op).
    """

    def __init__(self, engine: Any, step_in_backward: bool = False) -> None:
        stage = int(engine.zero_optimization_stage())
        if stage not in (1, 2):
            raise NotImplementedError(
                f"the step supports DeepSpeed ZeRO stages 1 and 2, got stage {stage} (stage 3 partitions the "
                "parameters, which the no-grad forward pass does not gather)"
            )
        accumulation = int(engine.gradient_accumulation_steps())
        if accumulation != 1:
            # Each step's coalesced reduction overwrites the partitioned gradient of the previous micro-batch
            # (checked on ZeRO-1 and 2): accumulating over steps would silently keep only the last one.
            raise ValueError(
                f"DeepSpeedBackend needs gradient_accumulation_steps = 1, got {accumulation}: a step already "
                "holds the whole global batch (make it larger, or chunk it with chunk_size, instead)"
            )
        self.engine = engine
        self.step_in_backward = step_in_backward
        self.dtype = (
            torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
        )

    @property
    def model(self) -> nn.Module:
        return self.engine

    @property
    def bare_module(self) -> nn.Module:
        return self.engine.module

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # accumulate() already defers every reduction to its exit

    def accumulate(self) -> contextlib.AbstractContextManager[Any]:
        return self.engine.coalesce_grad_reduction()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # DeepSpeed fp16/bf16 casts the module itself

    def prepare_inputs(self, inputs: Tensor) -> Tensor:
        # DeepSpeed casts the parameters to bf16/fp16 but not the inputs (and uses no autocast): float32
        # images into a bf16 convolution fail with "Input type ... and weight type ... should be the same".
        # uint8 images (the trainer's) pass as they are: EmbeddingNet converts them to its weights' dtype.
        if self.dtype is not None and inputs.is_floating_point():
            return inputs.to(self.dtype)
        return inputs

    def check_chunked(self) -> None:
        return None

    def sync_batchnorm(self) -> None:
        sync_batchnorm_buffers(self.engine.module, self.engine.data_parallel_group)

    def backward(self, objective: Tensor) -> None:
        self.engine.backward(objective)

    def finish(self) -> None:
        if self.step_in_backward:
            self.engine.step()

    def largest_batch(self, rows: int) -> int:
        return max_over_ranks(rows, self.engine.data_parallel_group)


class AccelerateBackend(PlainBackend):
    """``accelerate.Accelerator`` without DeepSpeed (DDP, AMP, gradient accumulation handled by accelerate).

    ``accelerator.backward`` divides by the accumulation steps and applies the GradScaler once.
    Build it with ``backend_for_accelerator``, which picks ``DeepSpeedBackend`` under DeepSpeed.
    """

    def __init__(self, accelerator: Any, model: nn.Module) -> None:
        super().__init__(model)
        self.accelerator = accelerator

    @property
    def bare_module(self) -> nn.Module:
        return self._model.module if isinstance(self._model, DistributedDataParallel) else self._model

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.accelerator.no_sync(self._model)

    def check_chunked(self) -> None:
        if isinstance(self._model, DistributedDataParallel):
            _refuse_static_graph(self._model)

    def sync_batchnorm(self) -> None:
        if isinstance(self._model, DistributedDataParallel):
            sync_batchnorm_buffers(self._model.module, self._model.process_group)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self.accelerator.autocast()

    def backward(self, objective: Tensor) -> None:
        self.accelerator.backward(objective)

    def largest_batch(self, rows: int) -> int:
        if isinstance(self._model, DistributedDataParallel):
            return max_over_ranks(rows, self._model.process_group)
        return rows


def backend_for_accelerator(accelerator: Any, model: nn.Module) -> StepBackend:
    """The backend for a model returned by ``accelerator.prepare``."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return DeepSpeedBackend(accelerator.deepspeed_engine_wrapped.engine, step_in_backward=True)
    return AccelerateBackend(accelerator, model)


def _refuse_static_graph(model: DistributedDataParallel) -> None:
    if getattr(model, "static_graph", False):
        raise ValueError(
            "DDP with static_graph=True cannot run the chunked step: its no_sync chunks and its last, synced "
            "chunk are different graphs to DDP (an internal assert fails on the first step). Build DDP without "
            "static_graph, or set a chunk_size at least as large as the local batch"
        )


@contextlib.contextmanager
def frozen_batchnorm(module: nn.Module) -> Iterator[None]:
    """Put every BatchNorm layer of `module` in eval mode for the duration, then restore its mode.

    For a loop of one's own around ``forward_backward``: in train mode a plain BatchNorm layer normalises with
    the statistics of the rows it is given, a chunk's in the chunked step, which that step therefore refuses.
    Frozen in both steps it uses the running statistics (those of the pretrained backbone), as FastAP's own
    large-batch ("staged") mode does, and the direct and the chunked step train the same function.
    """
    layers = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    modes = [m.training for m in layers]
    try:
        for m in layers:
            m.eval()
        yield
    finally:
        for m, mode in zip(layers, modes):
            m.train(mode)
