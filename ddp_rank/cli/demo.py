"""The emoji demo, end to end on CPU or GPUs: shards -> baselines -> FastAP training -> Recall table.

    python -m ddp_rank.cli.demo                     # what `make demo` runs; outputs under runs/demo/
    python -m ddp_rank.cli.demo --steps 40          # shorter
    python -m ddp_rank.cli.demo --shards-only       # step 1 alone (`make demo-shards`: a GPU machine's copy)

Steps (each skipped when its output exists, so a second run only retrains):

1. the emoji listing (``ddp-rank shards listing emoji``: npm packages of Google / Twitter / OpenMoji artwork,
   one class per emoji, half the classes held out) and its shards (``ddp-rank shards build``);
2. Recall@k of raw pixels on the held-out classes (``ddp-rank eval --baseline raw-pixels``);
3. FastAP training under ``accelerate launch`` (configs/demo.yaml): one process per GPU found, else 2 gloo
   processes on the CPU; it evaluates the network before the first step and after the last;
4. the table raw pixels / before / after (Recall@k and, with configs/demo.yaml's ``eval.metrics``, the
   verification figures), written with the plots, the ROC curve and the run summary to runs/demo/.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddp_rank.cli.arguments import add_config_arguments

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], what: str) -> float:
    print(f"\n== {what}\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"demo: '{what}' failed (exit {proc.returncode})")
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> int:
    """CUDA devices this process can see (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_parser() -> argparse.ArgumentParser:
    """The demo's options (also what the command-line reference shows for ``python -m ddp_rank.cli.demo``)."""
    p = argparse.ArgumentParser(
        prog="python -m ddp_rank.cli.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", help="demo directory (shards, runs, results)")
    p.add_argument(
        "--cache", default=os.path.expanduser("~/.cache/ddp_rank/emoji"), help="npm download cache"
    )
    p.add_argument("--shards", help="use this shard directory instead of building the emoji shards (tests)")
    p.add_argument(
        "--processes",
        type=int,
        default=0,
        help="training processes (default: one per GPU found, else 2 on CPU)",
    )
    p.add_argument("--steps", type=int, default=None, help="override train.steps of the config")
    p.add_argument("--shards-only", action="store_true", help="build the listing and the shards, then stop")
    add_config_arguments(p, "experiment YAML (default: configs/demo.yaml)")
    p.set_defaults(config=str(REPO / "configs" / "demo.yaml"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    t_start = time.perf_counter()
    gpus = _visible_gpus()
    if not args.processes:
        args.processes = gpus or 2
    where = f"{gpus} GPU(s)" if gpus else "CPU (gloo)"
    print(f"demo: training with {args.processes} process(es) on {where}", flush=True)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    cli = [py, "-m", "ddp_rank.cli"]
    timings: dict[str, float] = {}

    listing, shards = out / "emoji.csv", Path(args.shards).resolve() if args.shards else out / "emoji-shards"
    if not args.shards and not listing.is_file():
        timings["listing"] = _run(
            [*cli, "shards", "listing", "emoji", args.cache, str(listing), "--size", "64"], "emoji listing"
        )
    if not args.shards and not (shards / "manifest.json").is_file():
        timings["shards"] = _run(
            [*cli, "shards", "build", str(listing), str(shards), "--overwrite", "--no-progress"],
            "emoji shards",
        )
    if args.shards_only:
        print(f"demo: shards in {shards}", flush=True)
        return 0

    common = ["--config", args.config, f"data.shards={shards}", *args.overrides]
    results = out / "results.json"
    results.unlink(missing_ok=True)
    timings["raw pixels"] = _run(
        [*cli, "eval", *common, "--baseline", "raw-pixels", "--name", "raw pixels", "--output", str(results)],
        "raw-pixel baseline",
    )

    run_dir = out / "train"
    train_overrides = [f"train.output_dir={run_dir}", "train.eval_at_start=true", "train.resume=never"]
    if args.steps is not None:
        train_overrides.append(f"train.steps={args.steps}")
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    launch = [
        py,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "launch" / "accelerate_cpu_2proc.yaml"),
        "--num_processes",
        str(args.processes),
        "--main_process_port",
        str(_free_port()),
        "-m",
        "ddp_rank.cli",
        "train",
        *common,
        *train_overrides,
    ]
    timings["training (incl. before/after evaluation)"] = _run(
        launch, f"FastAP training, {args.processes} processes"
    )

    from ddp_rank.eval.curves import draw_curve
    from ddp_rank.eval.report import deployment_lines, format_table
    from ddp_rank.train.run_outputs import read_metrics
    from ddp_rank.train.run_report import read_curves

    rows: dict[str, dict[str, float]] = {}
    raw = json.loads(results.read_text())
    rows["raw pixels"] = raw["raw pixels"]["metrics"]
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    if not evals:
        raise SystemExit("demo: the training run logged no evaluation (is data.test_split set?)")
    strip = (
        "kind",
        "step",
        "map@r",
        "num_queries",
        "num_lone_queries",
        "num_positive_pairs",
        "num_negative_pairs",
    )
    rows["network before training"] = {k: v for k, v in evals[0].items() if k not in strip}
    rows[f"network after training ({evals[-1]['step']} steps)"] = {
        k: v for k, v in evals[-1].items() if k not in strip
    }
    rows["raw pixels"] = {k: v for k, v in rows["raw pixels"].items() if k not in strip}
    table = format_table(rows)
    verification = _verification_text(evals[-1], deployment_lines)
    roc = _draw_roc(draw_curve, raw["raw pixels"].get("curves"), read_curves(run_dir), out / "roc.png")
    total = time.perf_counter() - t_start
    timing_lines = "\n".join(f"- {k}: {v:.0f} s" for k, v in timings.items())
    gain = 100 * (evals[-1]["recall@1"] - evals[0]["recall@1"])
    text = (
        "# ddp_rank emoji demo\n\n"
        "Held-out emoji classes, each image querying all the others (SOP protocol), Recall@k in percent.\n\n"
        f"{table}\n\nRecall@1 gain from training: {gain:+.1f} points.\n\n{verification}"
        + ("![ROC](roc.png)\n\n" if roc else "")
        + f"Timings ({args.processes} processes):\n{timing_lines}\n- total: {total:.0f} s\n\n"
        f"Training run: [summary](train/summary.md), ![loss](train/loss.png) ![recall](train/recall.png)\n"
    )
    (out / "demo.md").write_text(text)
    print("\n" + table)
    print(f"\nRecall@1 gain from training: {gain:+.1f} points; total {total:.0f} s")
    if verification:
        print(verification.strip())
    print(
        f"written: {out / 'demo.md'}, {run_dir / 'summary.md'}, {run_dir / 'loss.png'}, {run_dir / 'recall.png'}"
        + (f", {roc}" if roc else "")
    )
    return 0


def _verification_text(after: dict[str, Any], deployment_lines: Any) -> str:
    """The demo.md paragraph on the verification figures of the trained network (eval.metrics=[verification])."""
    line = deployment_lines(after).get("verification")
    if line is None:
        return ""
    return (
        "Verification, every pair of held-out images (a 1:1 deployment: same emoji or not?), TPR at fixed FPR, "
        "ROC AUC, EER and AP in the table above; after training: " + line + ".\n\n"
    )


def _draw_roc(draw_curve: Any, raw: dict[str, Any] | None, run: dict[str, Any], path: Path) -> Path | None:
    """raw pixels, the network before and after training on one ROC figure; None without curves."""
    curves = {"raw pixels": raw or {}}
    if run:
        steps = list(run)
        curves["network before training"] = run[steps[0]]
        curves[f"network after training ({steps[-1]})"] = run[steps[-1]]
    try:
        return draw_curve("roc", curves, path)
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
