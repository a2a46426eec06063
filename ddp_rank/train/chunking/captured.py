"""The captured chunk: the chunked step's per-chunk forwards and backwards through ``torch.compile``.

Why: at 32-64 images a chunk, one chunk of a ResNet is about a thousand eager operations, and launching them takes
the host longer than the GPU needs to run them; the chunked step is then bound by the host (measured on an H100:
chunks of 32 at a quarter of a bare loop's images/s). Compiled, a chunk is a few fused kernels, and with CUDA graphs
(``distributed.capture_chunk=graphs``, inductor's "reduce-overhead") one launch per graph.

What runs compiled: every chunk of exactly ``rows`` images (the configured chunk), in both passes (pass 1 without
autograd, pass 2 with it: two compiled graphs, one shape each, ``dynamic=False``). What runs eagerly, as without
the option: a shorter last chunk (one shape more would be one more compilation, and padding it would change what
ghost BatchNorm groups normalise), and, under a wrapper that reduces gradients (DDP), the last chunk, which must
go through the wrapper's forward so that its backward reduces the step's gradients once; the no_sync chunks
call the bare module compiled, which is what ``no_sync`` does (local accumulation, no reduction). A chunk runs
the same way in both passes, so pass 2 recomputes what pass 1 embedded.

The RNG replay holds: inductor is asked to draw its random numbers with the eager operators
(``fallback_random``), so a chunk's dropout masks follow the generator state the step replays, in both passes.
Gradients are those of the eager step up to the order of floating-point sums (a fused kernel sums in another
order); the tests bound the difference.

CUDA graphs and gradient accumulation: a graph's outputs live in memory its next replay overwrites, and autograd
installs the first chunk's parameter gradients by taking that memory over (pytorch/pytorch#169545: the
accumulated gradient silently keeps a fraction of the chunks). So before the first captured backward of a step
every parameter that will receive a gradient gets one of zeros, and each chunk's gradient is added into it; the
embeddings a graph returns are copied out before the next replay. A parameter that the model never uses then
ends the step with a zero gradient instead of none.

Refused, one line each: a DeepSpeed engine (its backward is the engine's own, which compiles nothing and reduces
on its own schedule). BatchNorm layers that normalise with a chunk's own statistics are refused by the chunked
step already, captured or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ddp_rank.train.backends import DeepSpeedBackend, StepBackend

__all__ = ["CAPTURE_MODES", "CapturedChunk", "captured_chunk_for"]

log = logging.getLogger(__name__)

CAPTURE_MODES = ("none", "compile", "graphs")
"""``distributed.capture_chunk``: none = eager; compile = ``torch.compile`` (inductor, no CUDA graphs);
graphs = inductor with CUDA graphs on a GPU ("reduce-overhead"), plain inductor on the CPU."""
GRAPHS_UNVERIFIED = (
    "distributed.capture_chunk=graphs has not passed its gradient check on a GPU: on the one GPU it ran on "
    "(an H200, benchmarks/results/gpu-2026-11-27.md), the first convolution's accumulated gradient differed from "
    "the eager step's beyond bf16 rounding in a third of its entries "
    "(tests/train/test_captured_chunk.py::test_cuda_graphs_accumulate_every_chunk_of_every_step). Train with "
    "distributed.capture_chunk=compile until it passes"
)
"""Said at the start of a run with CUDA graphs on a GPU: the mode is kept for the GPU check to rerun, not for
training."""


class CapturedChunk:
    """The compiled embedding of one chunk shape, and the rule for which chunks use it.

    Args:
        module: the bare module (not a DDP wrapper): the compiled forward calls it, with its parameters.
        rows: the chunk size; chunks of another size run eagerly.
        mode: ``compile`` or ``graphs`` (see :data:`CAPTURE_MODES`).
        compiler: the ``torch.compile`` backend; default ``inductor``. The tests use ``aot_eager`` (the same
            capture, autograd and RNG machinery without generating code).
    """

    def __init__(
        self, module: nn.Module, rows: int, mode: str = "graphs", compiler: str = "inductor"
    ) -> None:
        if mode not in CAPTURE_MODES[1:]:
            raise ValueError(f"capture mode {mode!r}: use one of {', '.join(CAPTURE_MODES[1:])}")
        if rows < 1:
            raise ValueError(f"a captured chunk needs at least 1 row, got {rows}")
        self.module = module
        self.rows = rows
        self.mode = mode
        device = next(module.parameters()).device
        self.graphs = mode == "graphs" and device.type == "cuda" and compiler == "inductor"
        options: dict[str, str | int | bool | Callable[..., Any]] | None = None
        if compiler == "inductor":
            options = {"fallback_random": True, "triton.cudagraphs": self.graphs}
        self._compiled: Callable[[Tensor], Tensor] = torch.compile(
            module, backend=compiler, dynamic=False, options=options
        )
        self.compile_s: dict[str, float] = {}
        """Seconds of the first call of each compiled graph ('pass 1', 'pass 2'), its compilation included."""
        self.calls = 0
        """Chunks embedded by the compiled module (both passes)."""

    def module_for(
        self, backend: StepBackend, chunk: Tensor, last: bool, grad: bool
    ) -> Callable[[Tensor], Tensor]:
        """What embeds ``chunk`` in pass 1 (``grad=False``) or pass 2 (``grad=True``): the compiled module, or the
        eager one the step would call without capture (``bare_module`` in pass 1, ``model`` in pass 2)."""
        eager = backend.model if grad else backend.bare_module
        if chunk.shape[0] != self.rows or (last and backend.model is not backend.bare_module):
            return eager
        return self._pass_2 if grad else self._pass_1

    def _pass_1(self, chunk: Tensor) -> Tensor:
        return self._call(chunk, "pass 1")

    def _pass_2(self, chunk: Tensor) -> Tensor:
        if self.graphs:
            _zero_missing_grads(self.module)
        return self._call(chunk, "pass 2")

    def _call(self, chunk: Tensor, name: str) -> Tensor:
        first = name not in self.compile_s
        t0 = time.perf_counter() if first else 0.0
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous chunk's outputs are copied out or used
        out = self._compiled(chunk)
        if self.graphs:
            out = out.clone()  # the graph's output memory is the next replay's
        self.calls += 1
        if first:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)  # once, for the compile time only
            self.compile_s[name] = time.perf_counter() - t0
            log.info(
                f"captured chunk ({self.rows} rows, {self.mode}): {name} compiled and run in {self.compile_s[name]:.1f} s"
            )
        return out


def _zero_missing_grads(module: nn.Module) -> None:
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def captured_chunk_for(
    backend: StepBackend, chunk_size: int | None, mode: str, compiler: str = "inductor"
) -> CapturedChunk | None:
    """The captured chunk of a run (``distributed.capture_chunk``), or None when off or the step is not chunked;
    a ValueError, naming the fix, for an engine it cannot capture."""
    if mode not in CAPTURE_MODES:
        raise ValueError(f"distributed.capture_chunk={mode!r}: use one of {', '.join(CAPTURE_MODES)}")
    if mode == "none":
        return None
    if chunk_size is None:
        log.info(f"distributed.capture_chunk={mode} has no effect: the step is not chunked (the batch fits)")
        return None
    if isinstance(backend, DeepSpeedBackend):
        raise ValueError(
            "distributed.capture_chunk cannot capture a DeepSpeed engine's step (its backward is the engine's "
            "own): set distributed.capture_chunk=none, or train with DDP"
        )
    if mode == "graphs" and torch.cuda.is_available():
        log.warning(GRAPHS_UNVERIFIED)
    return CapturedChunk(backend.bare_module, chunk_size, mode, compiler)
