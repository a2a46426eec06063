"""The captured chunk (``distributed.capture_chunk``): the chunked step through ``torch.compile`` gives the eager
chunked step's loss and gradients.

Tolerances: in float64 and float32 with the ``aot_eager`` compiler (the same capture, autograd and RNG replay as
inductor, the eager kernels) the results are equal to rounding (rtol 1e-6 in float32); inductor fuses and reorders
sums, so float32 gradients agree to rtol 1e-4 / atol 1e-5 of the largest; bf16 autocast to 2e-2 of the largest
(one bf16 rounding of a reordered sum). The multi-rank step (DDP) with a captured chunk is in
tests/distributed/test_ranks_on_one_device.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from ddp_rank.config import ConfigError, ModelConfig, load_config
from ddp_rank.losses import FastAPLoss, PNPLoss
from ddp_rank.model import freeze_batchnorm
from ddp_rank.model.net import build_model
from ddp_rank.train import PlainBackend, convert_to_ghost, forward_backward
from ddp_rank.train.backends import DeepSpeedBackend
from ddp_rank.train.chunking.captured import CapturedChunk, captured_chunk_for


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 5)).double()


def cnn(backbone: str = "tiny_cnn", ghost: int = 0) -> nn.Module:
    """An EmbeddingNet in train mode with BatchNorm frozen (ghost=0) or ghost BatchNorm of ``ghost`` rows."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=backbone, weights="none", embedding_dim=16), 32).train()
    return convert_to_ghost(model, ghost) if ghost else (freeze_batchnorm(model), model)[1]


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def step(model: nn.Module, inputs, labels, loss_fn, chunk: int, captured: CapturedChunk | None, dtype=None):
    backend = PlainBackend(model, autocast_dtype=dtype)
    return forward_backward(backend, inputs, labels, loss_fn, chunk_size=chunk, captured=captured)


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float, atol: float) -> None:
    """Each gradient within rtol of itself plus atol times the largest gradient entry (bf16 rounds per tensor)."""
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=rtol, atol=atol * scale)


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.long)])
def test_dropout_masks_of_both_passes_are_replayed_through_the_compiled_chunk(compiler: str) -> None:
    """11 rows in chunks of 4: two compiled chunks and an eager last one of 3 rows. Same masks as the eager step
    (the gradients agree to rounding; inductor's own random numbers, without ``fallback_random``, differ from the
    eager ones by up to 0.96 in this model's output); a different seed changes them (the control: the masks
    matter)."""
    g = torch.Generator().manual_seed(1)
    inputs, labels = torch.randn(11, 6, generator=g, dtype=torch.float64), torch.arange(11) % 4
    loss_fn = PNPLoss(variant="O", tau=0.1)

    def run(seed: int, capture: bool) -> tuple[torch.Tensor, list[torch.Tensor], CapturedChunk | None]:
        model = mlp(dropout=0.5)
        captured = CapturedChunk(model, 4, "compile", compiler=compiler) if capture else None
        torch.manual_seed(seed)
        out = step(model, inputs, labels, loss_fn, 4, captured)
        return out.loss, grads(model), captured

    loss, got, captured = run(7, capture=True)
    eager_loss, want, _ = run(7, capture=False)
    assert (
        captured is not None and captured.calls == 4
    )  # 2 full chunks x 2 passes; the last chunk ran eagerly
    assert set(captured.compile_s) == {"pass 1", "pass 2"} and all(s > 0 for s in captured.compile_s.values())
    assert_close(loss, eager_loss, rtol=1e-12, atol=1e-14)
    assert_grads_close(got, want, rtol=1e-10 if compiler == "aot_eager" else 1e-6, atol=1e-12)
    assert not torch.allclose(run(8, capture=False)[1][0], want[0]), "dropout must change the gradient"


@pytest.mark.slow
@pytest.mark.parametrize("ghost", [0, 4], ids=["frozen-batchnorm", "ghost-batchnorm"])
def test_a_cnn_with_frozen_or_ghost_batchnorm_gives_the_eager_gradients(ghost: int) -> None:
    """uint8 images, as the trainer feeds them; ghost BatchNorm updates its running statistics in pass 1 as the
    eager step does, and pass 2 leaves them so, compiled or not."""
    g = torch.Generator().manual_seed(2)
    inputs = torch.randint(0, 256, (12, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.arange(12) // 3
    model, eager = cnn(ghost=ghost), cnn(ghost=ghost)
    captured = CapturedChunk(model, 4, "graphs", compiler="aot_eager")
    out = step(model, inputs, labels, FastAPLoss(), 4, captured)
    want = step(eager, inputs, labels, FastAPLoss(), 4, None)
    assert captured.calls == 6 and out.chunks == 3
    assert_close(out.loss, want.loss, rtol=1e-6, atol=1e-7)
    assert_grads_close(grads(model), grads(eager), rtol=1e-5, atol=1e-6)
    assert_close(dict(model.named_buffers()), dict(eager.named_buffers()), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_bf16_autocast_gives_the_eager_gradients_within_bf16_rounding() -> None:
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.arange(8) // 2
    model, eager = cnn(), cnn()
    captured = CapturedChunk(model, 4, "graphs", compiler="aot_eager")
    out = step(model, inputs, labels, FastAPLoss(), 4, captured, dtype=torch.bfloat16)
    want = step(eager, inputs, labels, FastAPLoss(), 4, None, dtype=torch.bfloat16)
    assert captured.calls == 4
    assert_close(out.loss, want.loss, rtol=2e-2, atol=1e-3)
    assert_grads_close(grads(model), grads(eager), rtol=2e-2, atol=2e-2)


@pytest.mark.long
def test_resnet18_through_inductor_on_the_cpu_gives_the_eager_gradients() -> None:
    """The real compiler (inductor, C++ on the CPU: 10 minutes on a cold cache of a 2-core machine) on the common
    backbone with frozen BatchNorm; its fused kernels sum in another order than the eager ones (measured: 1e-7 on
    gradients whose largest entry is 0.02)."""
    g = torch.Generator().manual_seed(4)
    inputs = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.arange(8) // 2
    model, eager = cnn("resnet18"), cnn("resnet18")
    captured = CapturedChunk(model, 4, "graphs")
    out = step(model, inputs, labels, FastAPLoss(), 4, captured)
    want = step(eager, inputs, labels, FastAPLoss(), 4, None)
    assert captured.calls == 4 and not captured.graphs  # CUDA graphs only on a GPU
    assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads(model), grads(eager), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_cuda_graphs_accumulate_every_chunk_of_every_step() -> None:
    """ResNet-18, bf16 autocast, frozen BatchNorm, CUDA graphs, 4 chunks a step and two steps with the gradients
    set to None between them (as the trainer's zero_grad does): each step's gradient is the sum over its chunks.
    A graph's output that became a .grad would be overwritten by the next chunk's replay (pytorch#169545); this
    fails then with a gradient of a fraction of the chunks."""
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    labels = (torch.arange(64) // 4).to(device)
    model, eager = cnn("resnet18").to(device), cnn("resnet18").to(device)
    captured = CapturedChunk(model, 16, "graphs")
    assert captured.graphs
    for _ in range(2):
        inputs = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=g).to(device)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        out = step(model, inputs, labels, FastAPLoss(), 16, captured, dtype=torch.bfloat16)
        want = step(eager, inputs, labels, FastAPLoss(), 16, None, dtype=torch.bfloat16)
        assert_close(out.loss, want.loss, rtol=2e-2, atol=1e-3)
        assert_grads_close(grads(model), grads(eager), rtol=5e-2, atol=2e-2)
    assert captured.calls == 16
    print(f"compile time (first call of each graph): {captured.compile_s}")


def test_refusals_and_the_config_key() -> None:
    backend = PlainBackend(mlp())
    assert captured_chunk_for(backend, 4, "none") is None
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ddp_rank.train.chunking.captured")
    logger.addHandler(handler)
    # setLevel, not an assignment to .level: it clears the loggers' isEnabledFor cache, which an earlier test of
    # the same process filled while INFO was off; and a logging.config call may have disabled the logger
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.INFO)
    logger.disabled = False
    try:
        assert captured_chunk_for(backend, 4, "none") is None and said == []
        assert (
            captured_chunk_for(backend, None, "graphs") is None
        )  # the step is not chunked: nothing to capture
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    assert said == [
        "distributed.capture_chunk=graphs has no effect: the step is not chunked (the batch fits)"
    ]
    assert isinstance(captured_chunk_for(backend, 4, "compile", compiler="aot_eager"), CapturedChunk)
    with pytest.raises(ValueError, match=r"cannot capture a DeepSpeed engine.*capture_chunk=none"):
        captured_chunk_for(object.__new__(DeepSpeedBackend), 4, "graphs")
    with pytest.raises(ValueError, match="capture_chunk='fast'"):
        captured_chunk_for(backend, 4, "fast")
    assert load_config(None, ["distributed.capture_chunk=graphs"]).distributed.capture_chunk == "graphs"
    assert load_config(None, []).distributed.capture_chunk == "none"
    with pytest.raises(ConfigError, match="capture_chunk='fast' is not a valid choice"):
        load_config(None, ["distributed.capture_chunk=fast"])


def test_live_batchnorm_is_refused_before_any_compilation() -> None:
    """A plain BatchNorm in train mode cannot be captured (nor chunked): the step's own refusal, first."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_cnn", weights="none", embedding_dim=16), 32).train()
    captured = CapturedChunk(model, 4, "compile", compiler="aot_eager")
    inputs = torch.zeros(8, 3, 32, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"BatchNorm layer .* in train mode"):
        step(model, inputs, torch.arange(8) // 2, FastAPLoss(), 4, captured)
    assert captured.calls == 0
