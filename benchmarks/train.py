"""Training-step benchmark: the trainer's images/s against a bare PyTorch loop of the same model, batch and
precision; direct vs chunked, 1 vs 2 processes; the loss's share of the step; the cost of ``train.deterministic``.

    python -m benchmarks.train                       # CPU defaults: tiny_cnn, 32 px, global batch 128
    python -m benchmarks.train --backbone resnet18 --image-size 64 --batch 64 --steps 6
    python -m benchmarks.train --device cuda --backbone resnet50 --image-size 224 --batch 256 --chunk 64,32,128 \
        --precision bf16 --capture compile,graphs --deterministic    # one GPU (the issue's throughput targets)
    python -m benchmarks.train --device cuda ... --plan bare,gradcache:64,chunked:64,compile:64 --budget-s 300 \
        --estimate-s bare=27,gradcache=27,trainer=27,compile=120    # an explicit order within a time budget

Each configuration runs as its own job (1 process: plain python; several: ``accelerate launch``, gloo on the
CPU, one process per GPU on CUDA) on synthetic shards built with the data layer (JPEG-compressed, decoded by the
stream's workers), through the real ``Trainer`` (stream, device feed, model, GlobalBatchLoss, direct or chunked
step, optimizer). The ``bare`` row is the reference: the same model (channels-last on CUDA), the same loss on the
local batch, Adam and autocast in plain PyTorch, on uint8 images already on the device (no data at all). Per
step it records:

- images/s of the step (global batch / step time without the wait for data), the median over ``--steps``
  after ``--warmup`` untimed steps, the fastest of ``--repeats`` jobs (a shared machine's noise only slows a
  job down), and its ratio to the bare loop; the end-to-end images/s (data wait included) beside it;
- loss time: the GlobalBatchLoss forward (all-gather of embeddings and labels, the query-row loss, the
  all-reduce of the normaliser) plus its backward (the reduce-scatter), timed with identity autograd markers
  around the loss so that the backbone's backward is not counted;
- communication: the bytes the loss's collectives send per step (ring convention, ``CommCounter``) and the time
  of the same collectives replayed alone on tensors of the same shapes.

The ``bare gradient cache`` rows are the method alone, written as plainly as the bare loop beside it: the same
model with BatchNorm frozen, channels-last on CUDA, uint8 images on the device, the batch cut in chunks of
``--chunk`` (one row per chunk size): pass 1 embeds every chunk without a graph, the loss on the detached float32
embeddings gives ``G = dL/de``, pass 2 re-embeds each chunk and back-propagates ``sum(e * G)``; no RNG replay (the
backbones here have no dropout), no engine, no checks. The trainer's chunked step against it is the trainer's own
overhead; the gradient cache against the bare loop is the method's (its extra no-grad forward). ``--capture
compile,graphs`` (either, or both) adds trainer rows with ``distributed.capture_chunk`` set, one per mode and
chunk, their compile time beside.

``--deterministic`` adds the 1-process rows with ``train.deterministic=true`` (and a deterministic bare loop) for
the direct step and the first ``--chunk``. ``--plan`` replaces the plan these flags make with an explicit one,
run in its order (one process each): ``bare``, ``direct``, ``gradcache:C``, ``chunked:C``, ``compile:C``,
``graphs:C`` (C: the chunk), each with ``:det`` for a deterministic row.

``--budget-s`` bounds the run (from the script's start, the shards' building included): a configuration whose
estimate does not fit in what is left is not started, and one still running at the end is stopped; either
leaves a row that says so (``not_measured``) instead of a measurement cut halfway. The estimate of a kind of
configuration (``bare``, ``gradcache``, ``trainer``, ``compile``, ``graphs``) is the time this run took for the
last one of that kind, else ``--estimate-s``'s (a kind with neither starts whenever time is left). Each row
records the seconds its configuration took (``wall_s``), start-up and compilation included: the figures the
next estimates come from.

A configuration that fails leaves a row with its ``error`` (and the traceback on stderr); the others still run,
and the script exits 1 at the end. ``--json`` is rewritten after each configuration, so a run stopped part way
keeps the rows it finished (interrupted, it adds a row for the configuration it stopped and each it never
reached, then ends).

The table is printed and written to benchmarks/results/train-<YYYY-MM-DD>.md with the machine named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

STARTED = time.monotonic()
"""The script's start, near enough (before torch is imported, which ``benchmarks.common`` does): ``--budget-s``
counts from here."""

from benchmarks.common import free_port, machine_description, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


class _Mark:
    """Identity autograd functions that record when the backward pass reaches them."""

    @staticmethod
    def make() -> Any:
        import torch

        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, log: dict[str, float], key: str) -> torch.Tensor:  # type: ignore[override]
                ctx.log, ctx.key = log, key
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
                ctx.log[ctx.key] = time.perf_counter()
                return grad, None, None

        return Mark


def _overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"data.shards={args.shards}",
        "data.test_split=",
        f"data.image_size={args.image_size}",
        f"data.resize_size={args.image_size}",
        f"data.global_batch_size={args.batch}",
        "data.sampler=random",
        f"data.num_workers={args.workers}",
        f"model.backbone={args.backbone}",
        "model.weights=none",
        "model.embedding_dim=128",
        f"distributed.chunk_size={args.chunk}",
        f"distributed.capture_chunk={args.capture}",
        f"distributed.cpu={str(args.device == 'cpu').lower()}",
        f"train.mixed_precision={args.precision}",
        f"train.deterministic={str(args.deterministic_run).lower()}",
        f"train.output_dir={args.out}",
        "train.progress=false",
        f"train.steps={args.warmup + args.steps}",
    ]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bare_setup(args: argparse.Namespace) -> dict[str, Any]:
    """What both bare loops share: model (channels-last on CUDA), Adam, loss, uint8 images on the device."""
    import torch

    from ddp_rank.config import load_config
    from ddp_rank.model.net import build_model, is_convolutional
    from ddp_rank.runtime.determinism import set_deterministic
    from ddp_rank.train.optim import build_optimizer
    from ddp_rank.train.setup import build_loss

    cfg = load_config(None, _overrides(args))
    set_deterministic(args.deterministic_run)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data.image_size)
    if device.type == "cuda" and is_convolutional(model):
        model.use_channels_last()
    model.to(device).train()
    optimizer = build_optimizer(
        model.parameter_groups(cfg.optim.lr, cfg.optim.head_lr_mult, cfg.optim.weight_decay), cfg.optim
    )
    n, side = args.batch, args.image_size
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    return {
        "device": device, "model": model, "optimizer": optimizer, "loss_fn": build_loss(cfg.loss), "dtype": dtype,
        "images": torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, device=device),
        "labels": (torch.arange(n, device=device) // 4).long(),  # classes of 4, as the random sampler's default
        "scaler": torch.amp.GradScaler(device.type) if dtype == torch.float16 else None,
        "autocast": lambda: torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None),
    }  # fmt: skip


def _timed_steps(args: argparse.Namespace, device: Any, one_step: Any) -> float:
    """The median time of ``one_step()`` (which ends reading the loss) over ``--steps`` after ``--warmup``."""
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        one_step()
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bare_result(args: argparse.Namespace, mode: str, chunks: int, step: float, device: Any) -> None:
    import torch

    result = {
        "processes": 1, "mode": mode, "chunks": chunks, "chunk": args.chunk, "global_batch": args.batch, "step_s": step,
        "total_s": step, "data_s": 0.0, "loss_s": float("nan"), "comm_s": 0.0, "comm_bytes": 0,
        "deterministic": args.deterministic_run, "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else "cpu",
    }  # fmt: skip
    Path(args.result).write_text(json.dumps(result))


def bare_worker(args: argparse.Namespace) -> None:
    """The reference loop: model, loss and Adam in plain PyTorch on uint8 images already on the device."""
    s = _bare_setup(args)
    model, optimizer, scaler = s["model"], s["optimizer"], s["scaler"]

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with s["autocast"]():
            loss = s["loss_fn"](model(s["images"]), s["labels"])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        float(loss)

    args.chunk = 0
    _bare_result(args, "bare loop", 1, _timed_steps(args, s["device"], one_step), s["device"])


def bare_gradient_cache_worker(args: argparse.Namespace) -> None:
    """The gradient-cache step written plainly (see the module's docstring): frozen BatchNorm, chunks of
    ``--chunk``, pass 1 without a graph, G from the loss on the detached embeddings, pass 2 with it."""
    import torch

    from ddp_rank.model import freeze_batchnorm

    s = _bare_setup(args)
    model, optimizer, scaler = s["model"], s["optimizer"], s["scaler"]
    freeze_batchnorm(model)
    chunks = s["images"].split(args.chunk)

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad(), s["autocast"]():
            embeddings = torch.cat([model(chunk) for chunk in chunks])
        leaf = embeddings.float().requires_grad_()
        loss = s["loss_fn"](leaf, s["labels"])
        loss.backward()
        for chunk, grad in zip(chunks, leaf.grad.split(args.chunk)):
            with s["autocast"]():
                e = model(chunk)
            objective = (e.float() * grad).sum()
            (scaler.scale(objective) if scaler is not None else objective).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        float(loss)

    mode = f"bare gradient cache ({args.chunk})"
    _bare_result(args, mode, len(chunks), _timed_steps(args, s["device"], one_step), s["device"])


def trainer_worker(args: argparse.Namespace) -> None:
    """One trainer configuration in this process (or in each of the processes accelerate started)."""
    import torch

    from ddp_rank.config import load_config
    from ddp_rank.distributed import (
        CommCounter,
        GlobalBatchLoss,
        all_gather_ints,
        end_process_group,
        padded_all_gather,
    )
    from ddp_rank.distributed.collectives import all_reduce_sum, padded_reduce_scatter
    from ddp_rank.distributed.process_group import is_distributed
    from ddp_rank.train.setup import build_loss
    from ddp_rank.train.trainer import Trainer

    trainer = Trainer(load_config(None, _overrides(args)))
    if args.capture != "none" and args.compiler != "inductor":  # the small CPU form in the tests
        from ddp_rank.train.chunking.captured import captured_chunk_for

        trainer.captured = captured_chunk_for(
            trainer.backend, trainer.chunk_size, args.capture, args.compiler
        )
    counter = CommCounter()
    trainer.loss_fn = GlobalBatchLoss(build_loss(trainer.cfg.loss), comm_counter=counter)
    mark = _Mark.make()
    log: dict[str, float] = {}
    base_loss = trainer.loss_fn

    def timed_loss(e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _sync(e.device)
        t0 = time.perf_counter()
        loss = base_loss(mark.apply(e, log, "bwd_end"), y)
        _sync(e.device)
        log["fwd"] = time.perf_counter() - t0
        return mark.apply(loss, log, "bwd_start")

    trainer.loss_fn = timed_loss  # type: ignore[assignment]
    steps, totals, losses, data = [], [], [], []
    try:
        for i in range(args.warmup + args.steps):
            counter.reset()
            log.clear()
            res = trainer.train_step()  # ends with float(loss): the device is synchronised
            if i >= args.warmup:
                steps.append(res.step_time - res.data_time)
                totals.append(res.step_time)
                data.append(res.data_time)
                losses.append(log["fwd"] + max(0.0, log.get("bwd_end", 0) - log.get("bwd_start", 0)))
        bytes_per_step = counter.total
        # The loss's collectives alone, same shapes: sizes, embeddings, labels, normaliser, reduce-scatter.
        comm = 0.0
        if is_distributed():
            n, d = trainer.local_batch, 128
            e = torch.randn(n, d, device=trainer.device)
            y = torch.zeros(n, dtype=torch.int64, device=trainer.device)
            reps = 5
            _sync(trainer.device)
            t0 = time.perf_counter()
            for _ in range(reps):
                sizes = all_gather_ints([n, d, 3, 1, 0])[:, 0].tolist()
                g = padded_all_gather(e, sizes)
                padded_all_gather(y, sizes)
                all_reduce_sum(torch.zeros(2, device=trainer.device))
                padded_reduce_scatter(g, sizes)
            _sync(trainer.device)
            comm = (time.perf_counter() - t0) / reps
        result = {
            "processes": trainer.world_size,
            "mode": _label(
                "captured" if trainer.captured else "trainer", trainer.chunk_size or 0, args.capture
            ),
            "chunks": res.chunks,
            "chunk": trainer.chunk_size or 0,
            "global_batch": args.batch,
            "step_s": statistics.median(steps),
            "total_s": statistics.median(totals),
            "data_s": statistics.median(data),
            "loss_s": statistics.median(losses),
            "comm_s": comm,
            "comm_bytes": bytes_per_step,
            "deterministic": args.deterministic_run,
        }
        if trainer.captured is not None:  # the first call of each compiled graph, its compilation included
            result["compile_s"] = trainer.captured.compile_s
        if trainer.is_main:
            Path(args.result).write_text(json.dumps(result))
    finally:
        trainer.close()
        accelerator = trainer.accelerator
        del trainer  # the DDP model released for end_process_group to collect (ddp_rank.train.trainer.run_training)
        accelerator.free_memory()
        end_process_group()
        accelerator.end_training()


def _label(mode: str, chunk: int, capture: str) -> str:
    """A row's ``mode`` (what gpu_targets.py looks rows up by)."""
    if mode == "bare":
        return "bare loop"
    if mode == "gradcache":
        return f"bare gradient cache ({chunk})"
    if not chunk:
        return "direct"
    return f"chunked ({chunk}), captured ({capture})" if mode == "captured" else f"chunked ({chunk})"


CAPTURES = ("compile", "graphs")
"""``--capture``'s modes (``distributed.capture_chunk`` but ``none``)."""
KINDS = ("bare", "gradcache", "trainer", *CAPTURES)
"""What a configuration's time is estimated by (``--estimate-s``): the bare loops, the trainer eager, each capture
mode (compiling makes a captured configuration several times longer than an eager one)."""


class Config(NamedTuple):
    """One configuration of the plan: ``mode`` (``bare``, ``gradcache``, ``trainer``, ``captured``), its processes,
    its chunk (0: the direct step), deterministic or not, and the captured chunk's mode (``captured`` only)."""

    mode: str
    processes: int
    chunk: int
    deterministic: bool = False
    capture: str = "none"

    @property
    def kind(self) -> str:
        """Its kind of the time estimates (``KINDS``)."""
        return self.capture if self.mode == "captured" else self.mode

    @property
    def label(self) -> str:
        return _label(self.mode, self.chunk, self.capture)


PLAN_ITEMS = {"bare": "bare", "direct": "trainer", "gradcache": "gradcache", "chunked": "trainer",
              "compile": "captured", "graphs": "captured"}  # fmt: skip
"""``--plan``'s words and the mode each runs; all but ``bare`` and ``direct`` take a chunk (``chunked:64``)."""


def _plan(text: str) -> list[Config]:
    """``--plan``: the configurations in the order to run them (one process each), e.g.
    ``bare,gradcache:64,chunked:64,compile:64,graphs:64,direct:det``."""
    plan = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        word, *rest = item.split(":")
        deterministic = rest[-1:] == ["det"]
        rest = rest[:-1] if deterministic else rest
        chunked = word not in ("bare", "direct")
        if (
            word not in PLAN_ITEMS
            or len(rest) != int(chunked)
            or not all(r.isdigit() and int(r) > 0 for r in rest)
        ):
            raise argparse.ArgumentTypeError(
                f"--plan item {item!r}: one of bare, direct, gradcache:C, chunked:C, compile:C, graphs:C (C: a "
                "chunk), each optionally followed by :det"
            )
        capture = word if word in CAPTURES else "none"
        plan.append(Config(PLAN_ITEMS[word], 1, int(rest[0]) if chunked else 0, deterministic, capture))
    if not plan:
        raise argparse.ArgumentTypeError("--plan: no configuration given")
    return plan


def _estimates(text: str) -> dict[str, float]:
    """``--estimate-s``: ``kind=seconds`` pairs, comma-separated (kinds: ``KINDS``)."""
    estimates = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if kind not in KINDS or value <= 0:
            raise argparse.ArgumentTypeError(
                f"--estimate-s item {item!r}: KIND=SECONDS with KIND one of {', '.join(KINDS)} (e.g. trainer=27)"
            )
        estimates[kind] = value
    return estimates


class Budget:
    """The run's time (``--budget-s``): a configuration starts only when its estimate fits in what is left, and
    one still running at the end is stopped. Estimates: this run's own time for the last configuration of the
    same kind, else the given ``estimates`` (per job: ``--repeats`` jobs make a configuration). ``seconds``
    None: no limit. ``clock``: the tests' simulated time."""

    def __init__(
        self,
        seconds: float | None,
        estimates: dict[str, float] | None = None,
        started: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds, self.clock = seconds, clock
        self.end = math.inf if seconds is None else (clock() if started is None else started) + seconds
        self.estimates = dict(estimates or {})
        self.observed: dict[str, float] = {}

    def left(self) -> float:
        return self.end - self.clock()

    def estimate(self, config: Config) -> tuple[float, str] | None:
        """The seconds one job of ``config`` is expected to take, and where that figure comes from."""
        if config.kind in self.observed:
            return self.observed[config.kind], f"the last {config.kind} configuration of this run"
        if config.kind in self.estimates:
            return self.estimates[config.kind], "--estimate-s"
        return None

    def refusal(self, config: Config, repeats: int = 1) -> str | None:
        """Why ``config`` is not started now (its row's ``not_measured``), or None: start it."""
        left = self.left()
        if left <= 0:
            return f"not started: the {self.seconds:.0f} s budget was spent"
        estimate = self.estimate(config)
        if estimate is not None and repeats * estimate[0] > left:
            return (
                f"not started: it needs about {repeats * estimate[0]:.0f} s (estimate: {estimate[1]}), "
                f"{left:.0f} s were left of the {self.seconds:.0f} s budget"
            )
        return None

    def took(self, config: Config, seconds: float) -> None:
        """``config``'s job took ``seconds``: the estimate of the next of its kind."""
        self.observed[config.kind] = seconds


class ConfigFailed(RuntimeError):
    """A configuration's job failed; ``summary``: its exit status and last line of stderr (the row's error)."""

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary


def run_config(
    args: argparse.Namespace, config: Config, shards: Path, tmp: Path, timeout: float | None = None
) -> dict[str, Any]:
    """One job of ``config``: its row. ``timeout``: seconds it may take (``subprocess.TimeoutExpired`` past them,
    the job killed)."""
    mode, processes, chunk, deterministic, capture = config
    name = f"{mode}-{capture}-{processes}-{chunk}-{int(deterministic)}"
    result, out = tmp / f"result-{name}.json", tmp / f"run-{name}"
    worker = {"bare": "bare", "gradcache": "gradcache"}.get(mode, "trainer")
    common = [
        "--worker", worker, "--capture", capture, "--compiler", args.compiler,
        "--shards", str(shards), "--out", str(out), "--result", str(result),
        "--device", args.device, "--precision", args.precision, "--workers", str(args.workers),
        "--backbone", args.backbone, "--image-size", str(args.image_size), "--batch", str(args.batch),
        "--chunk", str(chunk), "--steps", str(args.steps), "--warmup", str(args.warmup),
        *(["--deterministic-run"] if deterministic else []),
    ]  # fmt: skip
    env = dict(os.environ)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // processes))
        env["CUDA_VISIBLE_DEVICES"] = ""
    if processes == 1:
        cmd = [sys.executable, "-m", "benchmarks.train", *common]
    else:
        launch = (
            ["--config_file", str(REPO / "launch" / "accelerate_cpu_2proc.yaml")]
            if args.device == "cpu"
            else ["--multi_gpu"]
        )
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", *launch,
            "--num_processes", str(processes), "--main_process_port", str(free_port()),
            "--module", "benchmarks.train", *common,
        ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message on stderr"])[-1]
        summary = f"exit {proc.returncode}: {last[:300]}"
        raise ConfigFailed(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}", summary)
    return dict(json.loads(result.read_text()))


def _unmeasured(args: argparse.Namespace, config: Config, why: str) -> dict[str, Any]:
    """The row of a configuration that was not started, or stopped before its end: why, no figures."""
    return {"processes": config.processes, "mode": config.label, "deterministic": config.deterministic,
            "global_batch": args.batch, "not_measured": why}  # fmt: skip


def run_plan(
    args: argparse.Namespace,
    plan: list[Config],
    shards: Path,
    tmp: Path,
    budget: Budget | None = None,
) -> list[dict[str, Any]]:
    """One row per configuration of ``plan``, in its order: the fastest of ``--repeats`` jobs (with ``wall_s``,
    the seconds the configuration took), the row with its ``error`` where one failed, or a ``not_measured`` row
    where ``budget`` did not let it start or stopped it; ``--json`` rewritten after each. Interrupted (SIGINT),
    it writes the rows of the configuration stopped and of those not reached, then lets the interrupt go on."""
    budget = budget or Budget(None)
    rows: list[dict[str, Any]] = []
    for i, config in enumerate(plan):
        t0 = budget.clock()
        try:
            rows.append(_measure(args, config, shards, tmp, budget))
        except KeyboardInterrupt:
            rows.append(_unmeasured(args, config, f"stopped (interrupted) after {budget.clock() - t0:.0f} s"))
            rows += [_unmeasured(args, c, "not started: the run was interrupted") for c in plan[i + 1 :]]
            _write_rows(args, rows)
            raise
        _write_rows(args, rows)
        done = rows[-1].get("error") or rows[-1].get("not_measured")
        print(
            f"  {config.label}, {config.processes} process(es){', deterministic' if config.deterministic else ''}: "
            f"{budget.clock() - t0:.0f} s{f' ({done})' if done else ''}",
            flush=True,
        )
    return rows


def _measure(
    args: argparse.Namespace, config: Config, shards: Path, tmp: Path, budget: Budget
) -> dict[str, Any]:
    """``config``'s row: measured, failed, or not measured (the budget's refusal, or stopped at its end)."""
    refusal = budget.refusal(config, args.repeats)
    if refusal is not None:
        return _unmeasured(args, config, refusal)
    t0 = budget.clock()
    try:
        runs = []
        for _ in range(args.repeats):
            left = budget.left()
            runs.append(
                run_config(args, config, shards, tmp, timeout=None if math.isinf(left) else max(left, 1.0))
            )
    except subprocess.TimeoutExpired:
        estimate = budget.estimate(config)
        expected = f" (estimate: about {estimate[0]:.0f} s a job)" if estimate else ""
        return _unmeasured(
            args, config, f"stopped at the end of the budget after {budget.clock() - t0:.0f} s{expected}"
        )
    except (ConfigFailed, OSError, ValueError) as exc:  # the next configurations still run
        print(exc, file=sys.stderr, flush=True)
        error = exc.summary if isinstance(exc, ConfigFailed) else f"{type(exc).__name__}: {exc}"
        return {"processes": config.processes, "mode": config.label, "deterministic": config.deterministic,
                "global_batch": args.batch, "error": error}  # fmt: skip
    wall = budget.clock() - t0
    budget.took(config, wall / args.repeats)
    return {**min(runs, key=lambda r: r["step_s"]), "wall_s": wall}


def _write_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if getattr(args, "json", None):
        write_json(args.json, rows)


def _measured(row: dict[str, Any]) -> bool:
    return "error" not in row and "not_measured" not in row


def table(rows: list[dict[str, Any]]) -> str:
    bare = {r["deterministic"]: r for r in rows if r["mode"] == "bare loop" and _measured(r)}
    cache = {
        (r["deterministic"], r.get("chunk")): r
        for r in rows
        if r["mode"].startswith("bare gradient cache") and _measured(r)
    }
    head = (
        "| processes | step | deterministic | images/s | vs bare loop | vs bare gradient cache | images/s with data "
        "wait | step ms | data wait ms | loss + comm ms (share) | comm alone ms (share) | comm MB/step/rank "
        "| compile s |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if not _measured(r):
            what = f"failed: {r['error']}" if "error" in r else f"not measured: {r['not_measured']}"
            lines.append(
                f"| {r['processes']} | {r['mode']} | {'yes' if r['deterministic'] else 'no'} | {what} |"
            )
            continue
        step, ref = r["step_s"], bare.get(r["deterministic"])
        ratio = f"{100 * ref['step_s'] / step:.0f}%" if ref is not None else "-"
        same = cache.get((r["deterministic"], r.get("chunk")))
        chunked = r["mode"].startswith("chunked") and r["processes"] == 1
        vs_cache = f"{100 * same['step_s'] / step:.0f}%" if same is not None and chunked else "-"
        compile_s = " + ".join(f"{v:.1f}" for v in r.get("compile_s", {}).values()) or "-"
        loss = (
            "-" if math.isnan(r["loss_s"]) else f"{1000 * r['loss_s']:.1f} ({100 * r['loss_s'] / step:.1f}%)"
        )
        lines.append(
            f"| {r['processes']} | {r['mode']} | {'yes' if r['deterministic'] else 'no'} "
            f"| {r['global_batch'] / step:.1f} | {ratio} | {vs_cache} | {r['global_batch'] / r['total_s']:.1f} "
            f"| {1000 * step:.1f} | {1000 * r['data_s']:.1f} | {loss} "
            f"| {1000 * r['comm_s']:.2f} ({100 * r['comm_s'] / step:.1f}%) | {r['comm_bytes'] / 2**20:.3f} "
            f"| {compile_s} |"
        )
    return "\n".join(lines)


def build_plan(args: argparse.Namespace, processes: list[int]) -> list[Config]:
    """The configurations without ``--plan``, in order: the bare loop, the bare gradient cache at each chunk, the
    trainer direct and chunked at each chunk per process count, captured (1 process, each ``--capture`` mode at
    each capture chunk), then the deterministic rows (bare loop, direct, the first chunk). A chunk no smaller than
    the local batch would run the direct step again: no chunked row for it."""

    def fits(chunk: int, procs: int) -> bool:
        return args.batch // procs > chunk

    plan = [Config("bare", 1, 0)] + [Config("gradcache", 1, c) for c in args.chunk if fits(c, 1)]
    plan += [Config("trainer", p, c) for p in processes for c in [0, *args.chunk] if c == 0 or fits(c, p)]
    for mode in args.capture:
        plan += [
            Config("captured", 1, c, capture=mode) for c in args.capture_chunks or args.chunk if fits(c, 1)
        ]
    if args.deterministic:
        first = [c for c in args.chunk[:1] if fits(c, 1)]
        plan += [Config("bare", 1, 0, True)] + [Config("trainer", 1, c, True) for c in [0, *first]]
    return plan


def _captures(text: str) -> list[str]:
    """``--capture``: ``none``, or capture modes, comma-separated (``compile,graphs``), in the order to run."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip() and m.strip() != "none"))
    if any(m not in CAPTURES for m in modes):
        raise argparse.ArgumentTypeError(f"--capture {text!r}: none, or one or more of {', '.join(CAPTURES)}")
    return modes


def _chunks(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: chunk sizes, comma-separated (64,32,128; 0: the direct step)"
        )
    return values


def _command(args: argparse.Namespace, processes: list[int]) -> str:
    """The command line of this run, every default it took written out (the results file's record)."""
    if args.plan:
        what = "--plan " + ",".join(_plan_item(c) for c in args.plan)
    else:
        what = (
            f"--chunk {','.join(map(str, args.chunk))} --capture {','.join(args.capture) or 'none'} "
            + (f"--capture-chunks {','.join(map(str, args.capture_chunks))} " if args.capture_chunks else "")
            + f"--processes {','.join(map(str, processes))}{' --deterministic' if args.deterministic else ''}"
        )
    budget = f" --budget-s {args.budget_s:.0f}" if args.budget_s is not None else ""
    return (
        f"python -m benchmarks.train --device {args.device} --precision {args.precision} --backbone {args.backbone} "
        f"--image-size {args.image_size} --batch {args.batch} {what} --workers {args.workers} --steps {args.steps} "
        f"--warmup {args.warmup} --repeats {args.repeats}{budget}"
    )


def _plan_item(config: Config) -> str:
    """``config`` as a ``--plan`` item."""
    word = {"bare": "bare", "gradcache": "gradcache", "captured": config.capture}.get(config.mode)
    word = word or ("chunked" if config.chunk else "direct")
    return word + (f":{config.chunk}" if config.chunk else "") + (":det" if config.deterministic else "")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    parser.add_argument("--precision", choices=("no", "bf16", "fp16"), default=None,
                        help="train.mixed_precision (default: bf16 on CUDA, no on CPU)")  # fmt: skip
    parser.add_argument("--backbone", default="tiny_cnn")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument(
        "--chunk",
        type=_chunks,
        default=[16],
        help="chunk size(s) of the chunked runs, comma-separated: 64,32,128",
    )
    parser.add_argument(
        "--capture", type=_captures, default=[],
        help="also run the chunked step with distributed.capture_chunk set, each mode given (compile,graphs; "
        "1 process, at --capture-chunks)",
    )  # fmt: skip
    parser.add_argument(
        "--capture-chunks", type=_chunks, default=None,
        help="the chunk sizes of the --capture rows (default: every --chunk); each compiles once",
    )  # fmt: skip
    parser.add_argument(
        "--compiler", default="inductor", help="torch.compile backend of --capture (tests: aot_eager)"
    )
    parser.add_argument(
        "--processes", default=None, help="comma-separated (default: 1,2 on CPU, 1,#GPUs on CUDA)"
    )
    parser.add_argument("--workers", type=int, default=None, help="data.num_workers (default: 0 CPU, 6 CUDA)")
    parser.add_argument("--deterministic", action="store_true", help="add train.deterministic=true rows")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="jobs per configuration; the fastest is kept")
    parser.add_argument("--plan", type=_plan, default=None,
                        help="the configurations in this order instead of those of --chunk, --capture, --deterministic: "
                        "bare, direct, gradcache:C, chunked:C, compile:C, graphs:C, each optionally :det")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds from the start: a configuration whose estimate does not fit is not started")  # fmt: skip
    parser.add_argument("--estimate-s", type=_estimates, default={},
                        help=f"seconds a configuration takes, by kind: {'=S,'.join(KINDS)}=S (default: this run's own)")  # fmt: skip
    parser.add_argument(
        "--output", default=None, help="markdown file (default benchmarks/results/train-DATE.md)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON (gpu_check reads it)")
    parser.add_argument("--worker", choices=("bare", "gradcache", "trainer"), help=argparse.SUPPRESS)
    parser.add_argument("--deterministic-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.chunk, args.capture = args.chunk[0], (args.capture or ["none"])[0]
        workers = {"bare": bare_worker, "gradcache": bare_gradient_cache_worker, "trainer": trainer_worker}
        workers[args.worker](args)
        return 0

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (torch.cuda.is_available() is False)")
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "no")
    args.workers = args.workers if args.workers is not None else (6 if args.device == "cuda" else 0)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    default_processes = sorted({1, gpus}) if args.device == "cuda" and gpus > 1 else ([1] if gpus else [1, 2])
    processes = [int(p) for p in args.processes.split(",")] if args.processes else default_processes
    plan = args.plan or build_plan(args, processes)

    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        # 4 categories of classes of 4 images: every rank's share of the batch for every timed step.
        classes = max(40, (args.warmup + args.steps + 1) * args.batch // 16 + 1)  # one epoch: no restart
        write_image_folder(tmp / "images", [[4] * classes] * 4, image_size=args.image_size, seed=0)
        shards = tmp / "shards"
        build_shards(read_image_folder(tmp / "images"), shards, BuildOptions(progress=False))
        rows = run_plan(args, plan, shards, tmp, Budget(args.budget_s, args.estimate_s, STARTED))
    text = table(rows)
    print(text)
    date = dt.date.today().isoformat()
    out = Path(args.output) if args.output else REPO / "benchmarks" / "results" / f"train-{date}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    section = (
        f"## {args.device}, {args.backbone}, {args.image_size} px, precision {args.precision}, "
        f"global batch {args.batch}, chunk {','.join(map(str, sorted({c.chunk for c in plan if c.chunk})))}\n\n"
        f"Machine: {machine_description()}.\n\nCommand: `{_command(args, processes)}`. Median over "
        f"{args.steps} steps after {args.warmup} warm-up steps; the fastest of {args.repeats} jobs.\n\n{text}\n"
    )
    header = (
        f"# Training step benchmark, {date}\n\n"
        "FastAP loss (10 bins), 128-d embeddings, synthetic JPEG shards, the real Trainer step (stream, device "
        "feed, model, GlobalBatchLoss, direct or chunked step, Adam) beside a bare PyTorch loop of the same model, "
        "loss, optimizer and precision on images already on the device, and a bare gradient-cache loop (the same "
        "chunks, frozen BatchNorm). 'images/s' excludes the trainer's wait "
        "for data (its ratio to the bare loop is the step's overhead); 'with data wait' includes it. 'loss + comm' "
        "is the GlobalBatchLoss forward and backward including its collectives; 'comm alone' replays those "
        "collectives on tensors of the same shapes. On CPU with 2 processes each uses half the cores "
        "(OMP_NUM_THREADS). Each run of the script appends a section.\n\n"
    )
    previous = out.read_text() if out.is_file() else header
    out.write_text(previous.rstrip("\n") + "\n\n" + section)
    print(f"written: {out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
