"""What the chunked step costs the host per chunk: no value read on the host inside its loops, the inputs
prepared once per batch, the weights cast once per pass; and the same numbers as before these savings.

On a GPU each host read makes the CPU wait for the stream, so the CPU cannot queue chunk k + 1 while the GPU runs
chunk k; the counts here are what such a wait would be (``benchmarks/acceptance/host_syncs.py``), measured on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.acceptance.host_syncs import HostSyncs, count_host_syncs
from ddp_rank.config import load_config
from ddp_rank.data.reading.transforms import TransformConfig, normalize_batch, uint8_to_unit
from ddp_rank.model.net import EmbeddingNet, TinyCNN, freeze_batchnorm
from ddp_rank.train import PlainBackend, forward_backward
from ddp_rank.train.chunking.step import RngState
from ddp_rank.train.trainer import Trainer
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

ROWS = 16
CHUNKS = (2, 4, 8)


def tiny_net(dropout: float = 0.0) -> EmbeddingNet:
    """Convolutions, frozen BatchNorm, channels-last, a head and L2 normalisation: the trainer's model, small."""
    torch.manual_seed(0)
    backbone = TinyCNN((4, 8))
    if dropout:
        backbone.pool = nn.Sequential(backbone.pool, nn.Dropout(dropout))
    net = EmbeddingNet(backbone, 8, 6).use_channels_last()
    freeze_batchnorm(net)
    return net


def images() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (ROWS, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(ROWS) % 4


def plain_loss(embeddings: Tensor, labels: Tensor) -> Tensor:
    """A loss that reads nothing on the host, so that what is counted is the step's own."""
    similarity = embeddings @ embeddings.T
    same = (labels[:, None] == labels[None, :]).float()
    return ((similarity - same) ** 2).mean()


def step(net: nn.Module, chunks: int, autocast: torch.dtype | None = torch.bfloat16) -> None:
    inputs, labels = images()
    out = forward_backward(
        PlainBackend(net, autocast_dtype=autocast), inputs, labels, plain_loss, ROWS // chunks
    )
    assert out.chunks == chunks


class OpLog(TorchDispatchMode):
    """Every ATen operation dispatched in this thread (forward and backward), with its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[Tensor]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        tensors = [a for a in args if isinstance(a, Tensor)]
        self.ops.append((func.overloadpacket.__name__, tensors))
        return func(*args, **(kwargs or {}))


@contextmanager
def logged_ops() -> Iterator[OpLog]:
    with OpLog() as log:
        yield log


# ---------------------------------------------------------------------------------------- host synchronisations
def test_the_chunked_step_reads_nothing_on_the_host_whatever_its_chunks() -> None:
    """It used to build ``torch.tensor(1/255, device=...)`` in every forward: two host waits per chunk on a GPU
    (4, 8 and 16 for 2, 4 and 8 chunks here)."""
    net = tiny_net(dropout=0.2)  # the RNG replay runs too
    for chunks in CHUNKS:
        with count_host_syncs() as syncs:
            step(net, chunks)
        assert syncs.total == 0, f"{chunks} chunks: {syncs.report()}"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


@pytest.mark.usefixtures("fresh_accelerator_state")  # bf16: accelerate's state is a per-process singleton
def test_the_trainer_step_reads_on_the_host_as_often_for_any_number_of_chunks(
    shards: Path, tmp_path: Path
) -> None:
    """The trainer's whole step (the global-batch loss's checks, the loss value for the log) reads a few values
    on the host once per step; their number does not grow with the chunks (before: 4 more per 2 chunks)."""
    counts = {}
    for chunks in CHUNKS:
        cfg = load_config(
            None,
            [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / str(chunks)}",
             f"distributed.chunk_size={16 // chunks}", "train.mixed_precision=bf16"],
        )  # fmt: skip
        trainer = Trainer(cfg)
        try:
            batch = trainer.batches.next()  # read outside the count: the data path is not the step's
            with count_host_syncs() as syncs:
                assert trainer.train_step(batch).chunks == chunks
        finally:
            trainer.close()
        counts[chunks] = syncs
    totals = {chunks: syncs.total for chunks, syncs in counts.items()}
    assert len(set(totals.values())) == 1, "\n".join(f"{c} chunks: {s.report()}" for c, s in counts.items())
    in_loops = [e for e in counts[8].events if {"_forward_no_grad", "_forward_backward"} & e.functions()]
    assert not in_loops, HostSyncs(in_loops).report()


def test_uint8_to_unit_is_the_float_path_for_every_byte() -> None:
    """The Python-scalar multiply gives the float path's float32 values for all 256 bytes (it replaced a
    multiply by a float32 tensor built on the device)."""
    every_byte = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    unit = TransformConfig(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    assert torch.equal(uint8_to_unit(every_byte), normalize_batch([every_byte[0]], unit))
    with count_host_syncs() as syncs:
        uint8_to_unit(every_byte)
    assert syncs.total == 0, syncs.report()


# ------------------------------------------------------------------------------------------ one preparation
def _input_preparations(log: OpLog) -> int:
    """Operations on a uint8 image tensor (its conversion to float; the layout copy before it)."""
    return sum(1 for _, tensors in log.ops if tensors and tensors[0].dtype == torch.uint8)


def test_images_are_converted_and_laid_out_once_per_batch() -> None:
    """Before, every chunk converted, normalised and laid out its images in each pass: 2 x chunks times."""
    net = tiny_net()
    counts = {}
    for chunks in CHUNKS:
        with logged_ops() as log:
            step(net, chunks)
        counts[chunks] = _input_preparations(log)
    assert counts[2] == counts[4] == counts[8] <= 2, counts


def test_a_slice_of_the_prepared_batch_is_the_prepared_slice_and_gives_the_same_embeddings() -> None:
    net = tiny_net()
    inputs, _ = images()
    prepared = net.prepare_batch(inputs)
    assert prepared.is_contiguous(memory_format=torch.channels_last) and prepared.dtype == torch.float32
    for rows in inputs.split(5):
        assert torch.equal(net.prepare_batch(rows), prepared[: len(rows)])
        prepared = prepared[len(rows) :]
    with torch.no_grad():
        raw = net(inputs)
        with net.batch_prepared():
            assert net._takes_prepared
            again = net(net.prepare_batch(inputs))
    assert not net._takes_prepared, "the mode ends with its block"
    assert torch.equal(raw, again)


# ------------------------------------------------------------------------------------- one cast per pass
def _weight_casts(net: nn.Module, log: OpLog) -> int:
    weights = {p.data_ptr() for p in net.parameters()}
    return sum(
        1
        for name, tensors in log.ops
        if name == "_to_copy"
        and tensors
        and tensors[0].data_ptr() in weights
        and tensors[0].dtype == torch.float32
    )


def test_autocast_casts_each_weight_once_per_pass_not_once_per_chunk() -> None:
    """Pass 2 entered autocast for each chunk, which cast the weights again for every chunk (4 casts per chunk
    here: 12, 20 and 36 for 2, 4 and 8 chunks)."""
    net = tiny_net()
    counts = {}
    for chunks in CHUNKS:
        with logged_ops() as log:
            step(net, chunks)
        counts[chunks] = _weight_casts(net, log)
    assert counts[2] == counts[4] == counts[8], counts
    assert counts[2] <= 2 * sum(1 for p in net.parameters() if p.dim() > 1 or p is net.head.bias), counts


def test_operations_per_chunk_stay_few() -> None:
    """The operations a chunk adds (both passes, forward and backward) against a bound from the model: the
    convolutions' and head's forward and backward and the step's own few, nothing per weight beyond that."""
    net = tiny_net()
    totals = {}
    for chunks in (2, 8):
        with logged_ops() as log:
            step(net, chunks)
        totals[chunks] = len(log.ops)
    per_chunk = (totals[8] - totals[2]) / 6
    assert per_chunk <= 105, totals  # torch 2.14: 115 before, 99 after (one preparation, 5 weight casts less)


# ------------------------------------------------------------------------------ exactness of the savings
def _reference_chunked(net: nn.Module, inputs: Tensor, labels: Tensor, chunk: int) -> None:
    """The chunked step as it was written before: every chunk prepares its own images in its forward, and
    every chunk of pass 2 enters autocast on its own (so casts the weights again)."""

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    chunks = inputs.split(chunk)
    states, outputs = [], []
    with torch.no_grad(), autocast():
        for c in chunks:
            states.append(RngState.capture(c.device))
            outputs.append(net(c))
    leaf = torch.cat(outputs).float().requires_grad_()
    plain_loss(leaf, labels).backward()
    for c, state, grad in zip(chunks, states, leaf.grad.split(chunk)):
        with state.replay():
            with autocast():
                embeddings = net(c)
            (embeddings.float() * grad).sum().backward()


@pytest.mark.parametrize("chunks", [2, 8])
def test_the_savings_leave_every_gradient_bit_for_bit(chunks: int) -> None:
    """bfloat16 autocast, dropout replayed: the step's gradients equal, bitwise, those of the chunked step written
    plainly with one preparation per chunk and pass and one autocast region per chunk."""
    inputs, labels = images()
    ours, reference = tiny_net(dropout=0.3), tiny_net(dropout=0.3)
    torch.manual_seed(5)
    step(ours, chunks)
    torch.manual_seed(5)
    _reference_chunked(reference, inputs, labels, ROWS // chunks)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_float_inputs_and_a_model_without_preparation_still_work() -> None:
    """Float images in [0, 1] are prepared once too; a model with no ``prepare_batch`` gets its inputs as they
    are (its forward prepares them)."""
    inputs, labels = images()
    net, reference = tiny_net(), tiny_net()
    floats = uint8_to_unit(inputs)
    forward_backward(PlainBackend(net), floats, labels, plain_loss, chunk_size=4)
    forward_backward(PlainBackend(reference), inputs, labels, plain_loss, chunk_size=4)
    for a, b in zip(net.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)

    class Plain(nn.Module):
        def __init__(self, inner: EmbeddingNet) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x)

    wrapped, direct = Plain(tiny_net()), tiny_net()
    forward_backward(PlainBackend(wrapped), inputs, labels, plain_loss, chunk_size=4)
    forward_backward(PlainBackend(direct), inputs, labels, plain_loss, chunk_size=4)
    for a, b in zip(wrapped.parameters(), direct.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.cuda
def test_the_chunked_step_on_cuda_never_waits_for_the_gpu() -> None:
    """The judge on a GPU: a whole chunked step (bf16 autocast, dropout replayed, uint8 images, channels-last)
    with a loss that reads nothing on the host, under ``set_sync_debug_mode("error")``, where any synchronising
    call raises (``benchmarks/acceptance/gpu_check.py --part syncs`` lists them for the trainer's real step)."""
    cuda = torch.device("cuda")
    net = tiny_net(dropout=0.2).to(cuda)
    inputs, labels = (t.to(cuda) for t in images())
    backend = PlainBackend(net, autocast_dtype=torch.bfloat16)
    forward_backward(backend, inputs, labels, plain_loss, chunk_size=4)  # lazy initialisations, cuDNN's choice
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert forward_backward(backend, inputs, labels, plain_loss, chunk_size=4).chunks == ROWS // 4
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _ddp_bf16_worker(rank: int, world: int) -> tuple[list[Tensor], list[Tensor]]:
    """This rank's half of the batch: DDP's chunked bf16 step, and the plain per-chunk loop averaged by hand."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddp_rank.train import DDPBackend

    inputs, labels = images()
    mine = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    ddp = DistributedDataParallel(tiny_net(dropout=0.3))
    torch.manual_seed(5 + rank)
    forward_backward(DDPBackend(ddp, autocast_dtype=torch.bfloat16), inputs[mine], labels[mine], plain_loss, 2)
    reference = tiny_net(dropout=0.3)
    torch.manual_seed(5 + rank)
    _reference_chunked(reference, inputs[mine], labels[mine], 2)
    averaged = []
    for p in reference.parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        averaged.append(grad / world)
    return [p.grad for p in ddp.module.parameters()], averaged


@pytest.mark.distributed
def test_ddp_with_one_autocast_region_per_pass_averages_the_plain_loops_gradients() -> None:
    """2 gloo ranks, bf16 autocast, dropout: ``no_sync`` on all chunks but the last, the weights' casts kept
    across the chunks of pass 2 and the backwards outside autocast give every rank the mean of the gradients
    of the plain loop (one autocast region per chunk) on each rank's rows."""
    from tests.helpers.distributed import run_distributed

    for rank, (ddp, reference) in enumerate(run_distributed(_ddp_bf16_worker, 2)):
        for a, b in zip(ddp, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m, rank=rank: f"rank {rank}: {m}")
