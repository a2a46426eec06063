"""End to end: W gloo processes training with GlobalBatchLoss end with the parameters of one process trained on
the concatenated batches; the chunked step under DDP, accelerate and DeepSpeed ZeRO-1/2 equals the direct one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from ddp_rank.distributed import GlobalBatchLoss
from ddp_rank.losses import FastAPLoss, PNPLoss
from ddp_rank.train import (
    DDPBackend,
    DeepSpeedBackend,
    PlainBackend,
    StepBackend,
    backend_for_accelerator,
    forward_backward,
)
from tests.helpers.distributed import run_distributed

D_IN, STEPS, CHUNK = 6, 3, 3
SPLITS = {2: (6, 10), 3: (7, 0, 9)}  # uneven; W=3 has a rank without samples (it takes the direct path)


def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, 5)).to(dtype)


def step_batch(step: int, n: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    labels = torch.randint(0, max(2, n // 3), (n,), generator=g)
    return torch.randn(n, D_IN, generator=g, dtype=dtype), labels


def local(sizes: tuple[int, ...], rank: int, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    start = sum(sizes[:rank])
    return tuple(t[start : start + sizes[rank]] for t in tensors)


def train(
    backend: StepBackend,
    optimizer_step: Callable[[], None],
    loss_fn: nn.Module,
    sizes: tuple[int, ...],
    rank: int,
    chunk_size: int | None,
    dtype: torch.dtype = torch.float64,
) -> None:
    """STEPS steps on this rank's rows of each global batch: forward_backward, then the optimizer step."""
    for step in range(STEPS):
        inputs, labels = local(sizes, rank, step_batch(step, sum(sizes), dtype))
        forward_backward(backend, inputs, labels, loss_fn, chunk_size=chunk_size)
        optimizer_step()


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """||got - want|| / ||want|| over a list of tensors."""
    num = sum(float((g - w).norm() ** 2) for g, w in zip(got, want))
    return (num / sum(float(w.norm() ** 2) for w in want)) ** 0.5


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def stepper(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """``optimizer.step()`` then ``zero_grad()``, as one callable."""

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return step


def single_process_reference(
    sizes: tuple[int, ...], loss: nn.Module, dtype: torch.dtype = torch.float64, steps: int = STEPS
) -> list[torch.Tensor]:
    model = mlp(dtype)
    optimizer_step = stepper(torch.optim.Adam(model.parameters(), lr=0.01))
    for step in range(steps):
        inputs, labels = step_batch(step, sum(sizes), dtype)
        forward_backward(PlainBackend(model), inputs, labels, loss)
        optimizer_step()
    return params(model)


def _ddp_worker(rank: int, world: int, sizes: tuple[int, ...]) -> dict[str, list[torch.Tensor]]:
    results = {}
    for mode, chunk_size in (("direct", None), ("chunked", CHUNK)):
        model = DistributedDataParallel(mlp())
        optimizer_step = stepper(torch.optim.Adam(model.parameters(), lr=0.01))
        train(
            DDPBackend(model),
            optimizer_step,
            GlobalBatchLoss(PNPLoss("Dq", tau=0.1)),
            sizes,
            rank,
            chunk_size,
        )
        results[mode] = params(model)
    results["accelerate-chunked"] = _train_with_accelerate(rank, sizes)
    return results


def _train_with_accelerate(rank: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The trainer's route: accelerate (MULTI_CPU on the harness's process group) and the chunked step."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    loss = GlobalBatchLoss(PNPLoss("Dq", tau=0.1))
    train(backend_for_accelerator(accelerator, model), stepper(optimizer), loss, sizes, rank, CHUNK)
    return params(model)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SPLITS))
def test_ddp_training_matches_single_process(world: int) -> None:
    sizes = SPLITS[world]
    expected = single_process_reference(sizes, PNPLoss("Dq", tau=0.1))
    assert not torch.allclose(expected[0], mlp()[0].weight), "training must move the parameters"
    for rank, result in enumerate(run_distributed(_ddp_worker, world, args=(sizes,))):
        for mode, final in result.items():
            for got, want in zip(final, expected):
                assert_close(
                    got,
                    want,
                    rtol=1e-9,
                    atol=1e-11,
                    msg=lambda m, mode=mode, rank=rank: f"{mode} path, rank {rank}: {m}",
                )


def _deepspeed_worker(rank: int, world: int, sizes: tuple[int, ...]) -> dict[str, list[torch.Tensor]]:
    """DDP with the direct step, then DeepSpeed ZeRO-1 and ZeRO-2 with the chunked step, from one init."""
    import deepspeed

    loss = GlobalBatchLoss(FastAPLoss(num_bins=10))
    model = DistributedDataParallel(mlp(torch.float32))
    train(
        DDPBackend(model),
        stepper(torch.optim.SGD(model.parameters(), lr=0.5)),
        loss,
        sizes,
        rank,
        None,
        torch.float32,
    )
    results = {"ddp": params(model)}
    for stage in (1, 2):
        model = mlp(torch.float32)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
        }  # explicit: DeepSpeed would clip the norm to 1 here otherwise
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config
        )
        train(DeepSpeedBackend(engine), engine.step, loss, sizes, rank, CHUNK, torch.float32)
        results[f"zero{stage}"] = params(engine.module)
    # bf16: DeepSpeed casts the module, not the inputs; the backend casts the float32 inputs. One SGD step
    # (lr 1) from the same weights, in fp32 and bf16, direct and chunked: the parameter updates.
    for precision in ("fp32", "bf16"):
        for mode, chunk in (("direct", None), ("chunked", CHUNK)):
            model = mlp(torch.float32)
            start = params(model)
            engine, *_ = deepspeed.initialize(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                config={**config, "bf16": {"enabled": precision == "bf16"}},
            )
            inputs, labels = local(sizes, rank, step_batch(0, sum(sizes), torch.float32))
            forward_backward(DeepSpeedBackend(engine), inputs, labels, loss, chunk_size=chunk)
            engine.step()
            results[f"update-{precision}-{mode}"] = [
                p.detach().float() - w for p, w in zip(engine.module.parameters(), start)
            ]
    # Refused set-ups, with the reason: accumulation across steps, DDP's static graph in the chunked path.
    model = mlp(torch.float32)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        config={**config, "gradient_accumulation_steps": 2},
    )
    errors = []
    try:
        DeepSpeedBackend(engine)
    except ValueError as exc:
        errors.append(str(exc))
    static = DistributedDataParallel(mlp(torch.float32), static_graph=True)
    inputs, labels = local(sizes, rank, step_batch(0, sum(sizes), torch.float32))
    try:
        forward_backward(DDPBackend(static), inputs, labels, loss, chunk_size=CHUNK)
    except ValueError as exc:
        errors.append(str(exc))
    results["errors"] = errors  # type: ignore[assignment]
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_zero_chunked_step_matches_ddp() -> None:
    """Needs DeepSpeed's CPU comm op: the first run on a machine JIT-compiles it (about 100 s of CPU)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional [deepspeed] extra")
    sizes = SPLITS[2]
    for rank, result in enumerate(run_distributed(_deepspeed_worker, 2, args=(sizes,), timeout=600)):
        assert not torch.allclose(result["ddp"][0], mlp(torch.float32)[0].weight)
        for stage in ("zero1", "zero2"):
            for got, want in zip(result[stage], result["ddp"]):
                assert_close(
                    got, want, rtol=1e-4, atol=2e-5, msg=lambda m, s=stage, r=rank: f"{s}, rank {r}: {m}"
                )
        # bf16 forwards keep about 3 significant digits, which moves FastAP's soft histograms a little: the
        # bf16 update is within a few percent of the fp32 one (a lost chunk would be tens of percent off).
        reference = result["update-fp32-direct"]
        for name in ("update-fp32-chunked", "update-bf16-direct", "update-bf16-chunked"):
            error = relative_error(result[name], reference)
            assert error < (1e-5 if "fp32" in name else 0.06), f"{name}, rank {rank}: {error:.4f}"
        assert relative_error(result["update-bf16-chunked"], result["update-bf16-direct"]) < 0.02
        accumulation, static = result["errors"]
        assert "gradient_accumulation_steps = 1, got 2" in accumulation
        assert "static_graph=True cannot run the chunked step" in static
