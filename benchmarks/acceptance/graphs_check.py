"""The captured chunk's gradients under CUDA graphs against ``compile`` and the eager step: is the H200's failure of
``test_cuda_graphs_accumulate_every_chunk_of_every_step`` a wrong accumulation, or rounding? (issue 50, point 2)

    python -m benchmarks.acceptance.graphs_check --json graphs.json            # CUDA: ResNet-18, inductor
    python -m benchmarks.acceptance.graphs_check --device cpu --backbone tiny_cnn --compiler aot_eager   # the test's

The setup is the failing test's (``tests/train/test_captured_chunk.py``): a freshly initialised ResNet-18 with its
BatchNorm frozen, 64 uint8 images of 32 px in classes of 4, FastAP, chunks of 16, two steps on two batches with
the gradients set to None between them and no optimizer step (the second step only replays the graphs the first
recorded). It runs in float32 with TF32 off (matmuls and cuDNN: cuDNN allows TF32 by default, which would round
to 10 bits) and in bf16 autocast, each from the same weights, five times:

- ``eager``: the chunked step without capture, ``cudnn.benchmark`` off: the reference;
- ``eager, cudnn.benchmark``: the same with cuDNN's autotuner, which picks other convolution algorithms (other
  summation orders);
- ``direct``: the direct step, one forward and one backward of the whole batch (another summation order again);
- ``compile`` and ``graphs``: ``distributed.capture_chunk`` in each mode (the same inductor kernels; ``graphs``
  adds the CUDA graphs and their accumulation into gradients zeroed beforehand).

The second and third runs are correct: how far either lands from the reference, tensor by tensor (the worst
absolute difference), is "the spread"; ``SPREAD_FACTOR`` times it, at least ``FLOOR_RTOL`` of the tensor's largest
entry, is that tensor's tolerance. Each comparison (``graphs - compile``, ``graphs - eager``, ``compile - eager``, and the control, the
reference a quarter too large, which is what one of 4 chunks counted twice adds on average) gives, per tensor and
step, the worst absolute difference and the share of entries beyond the tolerance. A correct variant differs by
rounding of the spread's size, so few of its entries lie beyond; a chunk lost or counted twice moves most of them,
as the control shows. ``benchmarks/acceptance/gpu_targets.py`` (``graphs_verdicts``) judges the record
(``--json``, rewritten after each precision, so a run stopped part way keeps the precisions it finished).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.acceptance.gpu_targets import graphs_line
from benchmarks.common import write_json

RUNS = ("eager", "eager, cudnn.benchmark", "direct", "compile", "graphs")
SPREADS = (("eager, cudnn.benchmark", "eager"), ("direct", "eager"))
"""The correct eager runs whose distance from the reference is the tolerance."""
COMPARISONS = (("graphs", "compile"), ("graphs", "eager"), ("compile", "eager"))
CONTROL = "control"
CONTROL_FACTOR = 1.25
"""The control: the reference times this, a gradient a quarter too large (one of 4 chunks counted twice adds a
quarter on average): the comparison must see it, or the spread is too wide to tell anything."""
SPREAD_FACTOR = 2.0
"""The tolerance is this many times the spread: a third correct run is a third draw of the same rounding, whose
worst entry may pass the first two's by chance (in a tensor of 64 entries, one entry past the spread is 1.6% of
it), but rarely twice theirs; a chunk lost or counted twice is a quarter of the gradient, not a rounding."""
FLOOR_RTOL = 1e-5
"""The least tolerance, relative to the tensor's largest entry: a tensor the eager runs reproduce bit for bit still
differs under fused kernels, which sum float32 terms in another order (``tests/train/test_captured_chunk.py``:
ResNet-18 through inductor on the CPU, 1e-7 on gradients whose largest entry is 0.02, 5e-6 of it; this is twice
that)."""
PRECISIONS = ("fp32", "bf16")


def _model(backbone: str, image_size: int, device: torch.device) -> nn.Module:
    """An ``EmbeddingNet`` as the failing test builds it: fresh weights, BatchNorm frozen, train mode."""
    from ddp_rank.config import ModelConfig
    from ddp_rank.model import freeze_batchnorm
    from ddp_rank.model.net import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=backbone, weights="none", embedding_dim=16), image_size).train()
    freeze_batchnorm(model)
    return model.to(device)


def _batches(args: argparse.Namespace, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(5)
    labels = (torch.arange(args.batch) // 4).to(device)
    shape = (args.batch, 3, args.image_size, args.image_size)
    return [
        (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device), labels) for _ in range(2)
    ]


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool) -> Iterator[None]:
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


def run(
    args: argparse.Namespace, base: nn.Module, batches: list[tuple[Tensor, Tensor]], name: str, precision: str
) -> tuple[list[dict[str, Tensor]], dict[str, float]]:
    """One of ``RUNS`` from ``base``'s weights: each step's parameter gradients, and the captured chunk's compile
    time (its first call of each pass)."""
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.train import PlainBackend, forward_backward
    from ddp_rank.train.chunking.captured import CapturedChunk

    model = copy.deepcopy(base)
    captured = None
    if name in ("compile", "graphs"):
        torch._dynamo.reset()  # each run compiles its own graphs (and stays under dynamo's recompile limit)
        captured = CapturedChunk(model, args.chunk, name, args.compiler)
    backend = PlainBackend(model, autocast_dtype=torch.bfloat16 if precision == "bf16" else None)
    grads = []
    with _cudnn_benchmark(name == "eager, cudnn.benchmark"):
        for inputs, labels in batches:
            model.zero_grad(set_to_none=True)
            chunk = None if name == "direct" else args.chunk
            forward_backward(backend, inputs, labels, FastAPLoss(), chunk_size=chunk, captured=captured)
            grads.append(
                {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            )
    return grads, dict(captured.compile_s) if captured else {}


def differences(
    got: dict[str, Tensor], want: dict[str, Tensor], tolerance: dict[str, float]
) -> dict[str, list[float]]:
    """Per tensor of ``want``: [the worst absolute difference, the tolerance, the share of entries beyond it]. A
    gradient missing on one side counts as zeros (CUDA graphs give unused parameters zeros, eager None)."""
    out = {}
    for name, w in want.items():
        diff = (got.get(name, torch.zeros_like(w)).double() - w.double()).abs()
        tol = tolerance[name]
        out[name] = [float(diff.max()), tol, float((diff > tol).double().mean())]
    return out


def tolerances(reference: dict[str, Tensor], spreads: list[dict[str, Tensor]]) -> dict[str, float]:
    """Per tensor: ``SPREAD_FACTOR`` times the worst absolute difference of any correct run from the reference, at
    least ``FLOOR_RTOL`` of the reference's largest entry."""
    tol = {}
    for name, w in reference.items():
        worst = [float((s.get(name, torch.zeros_like(w)).double() - w.double()).abs().max()) for s in spreads]
        tol[name] = max(SPREAD_FACTOR * max(worst, default=0.0), FLOOR_RTOL * float(w.abs().max()))
    return tol


def compare_precision(
    args: argparse.Namespace, precision: str, device: torch.device
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The rows of one precision (per step: the spreads, the control, each comparison) and each run's seconds."""
    base = _model(args.backbone, args.image_size, device)
    batches = _batches(args, device)
    grads: dict[str, list[dict[str, Tensor]] | str] = {}  # run -> each step's gradients, or why it failed
    compile_s: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {}
    for name in RUNS:
        t0 = time.perf_counter()
        try:
            grads[name], compile_s[name] = run(args, base, batches, name, precision)
        except Exception as exc:  # a capture that fails is a result: its comparisons say so
            grads[name] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
        seconds[f"{precision} {name}"] = time.perf_counter() - t0
    rows = []
    for step in range(len(batches)):
        common = {"precision": precision, "step": step + 1}
        rows += [{**common, **row} for row in _step_rows(grads, compile_s, step)]
    return rows, seconds


def _step_rows(
    grads: dict[str, list[dict[str, Tensor]] | str], compile_s: dict[str, dict[str, float]], step: int
) -> list[dict[str, Any]]:
    """The comparisons of one step: the spreads, the control, then ``COMPARISONS`` (a failed run: its error)."""
    failed = next((n for n in ("eager", *(a for a, _ in SPREADS)) if isinstance(grads[n], str)), None)
    if failed is not None:
        return [{"comparison": "spread", "error": f"{failed}: {grads[failed]}"}]
    at = {n: g[step] for n, g in grads.items() if not isinstance(g, str)}
    tol = tolerances(at["eager"], [at[a] for a, _ in SPREADS])
    control = {n: CONTROL_FACTOR * g for n, g in at["eager"].items()}
    rows = [{"comparison": f"{a} - {b}", "per_tensor": differences(at[a], at[b], tol)} for a, b in SPREADS]
    rows.append({"comparison": f"{CONTROL} - eager", "per_tensor": differences(control, at["eager"], tol)})
    for a, b in COMPARISONS:
        bad = next((n for n in (a, b) if isinstance(grads[n], str)), None)
        if bad is not None:
            rows.append({"comparison": f"{a} - {b}", "error": f"{bad} failed: {grads[bad]}"})
        else:
            rows.append({"comparison": f"{a} - {b}", "per_tensor": differences(at[a], at[b], tol),
                         "compile_s": compile_s.get(a, {})})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--compiler", default="inductor", help="torch.compile backend (tests: aot_eager)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="fp32,bf16 (in this order)")
    parser.add_argument("--json", type=Path, help="the record: setup, rows, each run's seconds")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32: TF32 rounds to 10 bits
    torch.backends.cudnn.allow_tf32 = False
    setup = (
        f"{args.backbone} (frozen BatchNorm), {args.batch} uint8 images of {args.image_size} px, chunks of "
        f"{args.chunk}, FastAP, {args.compiler}, {device.type}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + ", TF32 off"
    )
    record: dict[str, Any] = {"setup": setup, "device": device.type, "rows": [], "run_s": {}}
    for precision in filter(None, (p.strip() for p in args.precisions.split(","))):
        if precision not in PRECISIONS:
            parser.error(f"--precisions: {precision!r} is not one of {', '.join(PRECISIONS)}")
        rows, seconds = compare_precision(args, precision, device)
        record["rows"] += rows
        record["run_s"].update(seconds)
        if args.json:
            write_json(args.json, record)
        for row in rows:
            print(f"{precision}, step {row['step']}: {graphs_line(row)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
