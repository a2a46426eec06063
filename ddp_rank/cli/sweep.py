"""``ddp-rank sweep --config C key=v1,v2 ...``: a grid of runs, one after another, then their comparison
(``ddp_rank.experiments``).

Examples::

    ddp-rank sweep --config configs/demo.yaml --processes 2 --equal images \\
        data.global_batch_size=32,128,512,2048
    ddp-rank sweep --config configs/demo.yaml data.sampler=hard,random --replicates 3   # seeds 0, 1, 2
    ddp-rank sweep --config c.yaml loss.name=fastap,pnp data.sampler=hard,random --print > commands.txt
    # a SLURM array: sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" commands.txt | bash
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ddp_rank.cli.arguments import add_config_arguments
from ddp_rank.cli.command import EXIT_USAGE, Command

__all__ = ["COMMAND", "run"]


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, "experiment YAML the points start from")
    p.add_argument(
        "--equal",
        choices=("steps", "images"),
        default="steps",
        help="hold steps (default) or images seen equal across data.global_batch_size values",
    )
    p.add_argument(
        "--replicates",
        type=int,
        default=0,
        metavar="K",
        help="train each point K times with train.seed = the config's seed, +1, ... +K-1; compare "
        "gives each point's mean and spread (an axis train.seed=0,1,2 or data.seed=0,1,2 does the same)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes per run under accelerate launch (one per GPU with CUDA, gloo on the CPU)",
    )
    p.add_argument(
        "--launch",
        default="",
        metavar="CMD",
        help="launch each run with CMD -m ddp_rank.cli train ... (e.g. 'torchrun --nproc-per-node 8')",
    )
    p.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="print one launch command per point (for SLURM arrays, other schedulers) and exit; with "
        "--processes N each is 'accelerate launch --multi_gpu --num_processes N' with no port, so the "
        "machine that runs it decides: one process per GPU, or gloo processes without one",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="train the (one-process) points in this process, one after another: the imports and "
        "set-up are paid once, and each point trains exactly as in a process of its own",
    )
    p.add_argument("--metric", default="recall@1", help="the metric of the comparison and its plot")


def run(args: argparse.Namespace) -> int:
    from ddp_rank.config import ConfigError
    from ddp_rank.experiments.compare import compare_runs
    from ddp_rank.experiments.grid import REPLICATE_KEYS, expand_grid, split_axes
    from ddp_rank.experiments.plot import plot_comparison
    from ddp_rank.experiments.runs import read_run
    from ddp_rank.experiments.sweep import Launcher, in_process_runner, point_command, point_dir, run_sweep

    try:
        fixed, axes = split_axes(args.overrides)
        base, points = expand_grid(args.config, args.overrides, args.equal, args.replicates)
    except ConfigError as exc:
        print(f"ddp-rank sweep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    import torch

    # Printed commands run on another machine (a SLURM array's nodes): let the launcher decide there.
    cpu = None if args.print_only else not torch.cuda.is_available()
    launcher = Launcher(args.processes, args.launch, cpu=cpu)
    out = Path(base.train.output_dir)
    fixed = [f for f in fixed if not f.startswith("train.output_dir=")]
    commands = [(p, point_dir(out, p), point_command(launcher, args.config, fixed, p, out)) for p in points]
    if args.print_only:
        for _, _, command in commands:
            print(shlex.join(command))
        return 0
    print(f"sweep: {len(points)} runs into {out}/", flush=True)
    try:
        runner = in_process_runner(launcher) if args.in_process else None
    except ValueError as exc:
        print(f"ddp-rank sweep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    outcome = run_sweep(commands, runner, say=lambda line: print(line, flush=True))
    runs = [read_run(folder) for _, folder, _ in commands]
    table = compare_runs(runs, args.metric)
    text = table.markdown()
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(text)
    print("\n" + text, end="")
    try:
        settings = [key for key, _ in axes if key not in REPLICATE_KEYS]
        x_key = settings[0] if len(settings) == 1 else None
        drawn = plot_comparison(runs, args.metric, out / "compare.png", x_key)
        if drawn:
            print(f"written: {out / 'compare.md'}, {drawn}")
    except ImportError as exc:
        print(f"sweep: no plot: {exc}", file=sys.stderr)
    if outcome.running_elsewhere:
        print(
            f"sweep: {len(outcome.running_elsewhere)} run(s) left alone, another process still trains them: "
            f"{', '.join(map(str, outcome.running_elsewhere))}; run the sweep again once they have ended",
            file=sys.stderr,
        )
    if outcome.stopped:
        from ddp_rank.train.preemption import EXIT_REQUEUE

        return EXIT_REQUEUE
    if outcome.failed:
        print(
            f"sweep: {len(outcome.failed)} run(s) failed: {', '.join(map(str, outcome.failed))}",
            file=sys.stderr,
        )
        return 1
    return 0


COMMAND = Command(
    "sweep",
    help="train a grid of config values (key=v1,v2,...) one run per point, then compare them",
    description="Expand key=v1,v2,... overrides into a grid, train each point into "
    "<train.output_dir>/<key=value,...>/ (skipping points already finished, continuing interrupted ones), "
    "and end with the comparison table (compare.md, compare.png in the sweep's folder).",
    arguments=_arguments,
    run=run,
)
