"""``ddp-rank compare RUN...``: runs side by side (``ddp_rank.experiments.compare``).

Examples::

    ddp-rank compare runs/sweep                    # every run of a sweep's folder
    ddp-rank compare 'runs/bs*' runs/pnp --plot compare.png
    ddp-rank compare runs/* --csv > runs.csv       # or --json
    ddp-rank compare runs/a runs/b --curve roc     # both runs' ROC curves on one figure: compare-roc.png
    ddp-rank compare runs/a runs/b --grid grid.png # their retrieval pictures side by side, same queries
    ddp-rank compare runs/sweep --csv --points     # replicates (runs differing only in seeds): one row per point

Files and folders without a run among the arguments (``runs/sweep/*`` also names the sweep's ``compare.md``) are
passed over with a note on stderr; no run at all is an error. A run that ``--plot`` or ``--curve`` leaves out
(unfinished, without the metric, without that curve) is named on stderr with why; counts (``gallery_size``) are
printed as integers, rates in percent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ddp_rank.cli.command import EXIT_USAGE, Command

__all__ = ["COMMAND", "run"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories or globs")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="CSV instead of markdown")
    form.add_argument("--json", action="store_true", help="JSON instead of markdown")
    p.add_argument(
        "--metric",
        help="the metric whose best value is shown (default: the runs' train.best_metric, else recall@1)",
    )
    p.add_argument(
        "--points",
        action="store_true",
        help="with --csv: one row per point (runs that differ only in train.seed / data.seed pooled: mean, std, "
        "min, max, count of each metric) instead of one per run",
    )
    p.add_argument("--plot", metavar="PNG", help="also draw the finished runs' metric into this file")
    p.add_argument(
        "--x", metavar="KEY", help="the plot's x axis: this config key (default: the one that differs)"
    )
    p.add_argument(
        "--curve",
        choices=("roc", "det", "cmc", "pr"),
        help="also draw this curve of every run's last evaluation on one figure (eval.protocol=verification or "
        "identification, or eval.metrics), operating points marked",
    )
    p.add_argument(
        "--curve-output", metavar="PNG", help="where --curve draws (default compare-<curve>.png here)"
    )
    p.add_argument(
        "--grid",
        metavar="PNG",
        help="also draw the runs' retrieval pictures side by side into this file: the same sampled queries, "
        "each run's top-k framed green (the query's class) or red, captioned with the class names, a legend "
        "under them, from each run's retrieval.json (written by ddp-rank eval and by a run's evaluations); runs "
        "without one are named and left out",
    )


def run(args: argparse.Namespace) -> int:
    from ddp_rank.experiments.compare import compare_runs
    from ddp_rank.experiments.plot import plot_comparison
    from ddp_rank.experiments.runs import expand_run_paths, metric_keys, read_run

    def note(line: str) -> None:
        print(f"ddp-rank compare: {line}", file=sys.stderr)

    lone = _option_without_its_partner(args)
    if lone:
        print(f"ddp-rank compare: error: {lone}", file=sys.stderr)
        return EXIT_USAGE
    try:
        paths = expand_run_paths(args.runs, note)
    except FileNotFoundError as exc:
        print(f"ddp-rank compare: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    runs = [read_run(path) for path in paths]
    args.metric = args.metric or _default_metric(runs, metric_keys(runs))
    table = compare_runs(runs, args.metric)
    if args.metric not in table.metrics and any(run.evals for run in runs):
        print(
            f"ddp-rank compare: error: no run logged {args.metric!r}; logged: {', '.join(table.metrics)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.points and not args.csv:
        print(
            "ddp-rank compare: error: --points goes with --csv (markdown and JSON hold the points already)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    axes = table.replicates.keys if table.replicates else table.keys  # replicates: pooled over their seeds
    if args.x and args.x not in axes:
        differ = ", ".join(axes) or "nothing"
        print(
            f"ddp-rank compare: error: --x {args.x}: the {'points' if table.replicates else 'runs'} do not "
            f"differ in it; they differ in: {differ}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.points and table.replicates is None:
        note("--points: no runs differ only in their seeds (train.seed, data.seed): one row per run")
    csv = table.points_csv() if args.points else table.csv()
    print(csv if args.csv else table.json() if args.json else table.markdown(), end="")
    if args.plot:
        from ddp_rank.experiments.plot import plot_left_out

        for line in plot_left_out(runs, args.metric):
            note(f"left out of the plot: {line}")
        try:
            drawn = plot_comparison(runs, args.metric, args.plot, args.x)
        except ImportError as exc:
            print(f"ddp-rank compare: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(
            f"plot: {drawn}" if drawn else "plot: no finished run with an evaluation to draw", file=sys.stderr
        )
    status = 0
    if args.curve:
        status = _draw_curve(runs, args.curve, args.curve_output or f"compare-{args.curve}.png")
    if args.grid and status == 0:
        status = _draw_grid([run.path for run in runs], args.grid)
    return status


def _default_metric(runs: list[Any], logged: list[str]) -> str:
    """The ``train.best_metric`` the runs share (``roc_auc`` for verification runs) where they logged it, else
    ``recall@1``, else the first metric they logged."""
    chosen = {run.config.get("train.best_metric") for run in runs if run.config} - {None}
    shared = list(chosen) if len(chosen) == 1 else []
    return next((str(m) for m in [*shared, "recall@1", *logged] if m in logged), "recall@1")


def _option_without_its_partner(args: argparse.Namespace) -> str:
    """The line refusing an option given without the one it qualifies (it would change nothing), or ""."""
    for option, needs, value, partner in (
        ("--x", "--plot", args.x, args.plot),
        ("--curve-output", "--curve", args.curve_output, args.curve),
    ):
        if value and not partner:
            return f"{option} goes with {needs} (it says where or how {needs} draws): add {needs} or leave it out"
    return ""


def _draw_curve(runs: list[Any], kind: str, path: str) -> int:
    from ddp_rank.experiments.curves import curve_left_out, plot_run_curves

    try:
        drawn = plot_run_curves(runs, kind, path)
    except ImportError as exc:
        print(f"ddp-rank compare: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if drawn is None:
        print(
            f"ddp-rank compare: error: no run has a {kind} curve (curves.json); evaluate with "
            f"eval.protocol={'identification' if kind == 'cmc' else 'verification'} or "
            f"eval.metrics=[{'identification' if kind == 'cmc' else 'verification'}]",
            file=sys.stderr,
        )
        return EXIT_USAGE
    for line in curve_left_out(runs, kind):
        print(f"ddp-rank compare: left out of the {kind} curve: {line}", file=sys.stderr)
    print(f"{kind} curve: {drawn}", file=sys.stderr)
    return 0


def _draw_grid(paths: list[Any], path: str) -> int:
    from ddp_rank.eval.retrieval_record import RecordError
    from ddp_rank.experiments.retrieval_pictures import draw_run_pictures

    def note(line: str) -> None:
        print(f"ddp-rank compare: {line}", file=sys.stderr)

    left_out: list[str] = []  # said once the outcome is known: a refusal is one line
    try:
        drawn = draw_run_pictures([Path(p) for p in paths], path, left_out.append)
    except RecordError as exc:
        for line in left_out:
            note(line)
        note(f"error: --grid: {exc}")
        return EXIT_USAGE
    if drawn is None:
        first = f" ({left_out[0]}{', ...' if len(left_out) > 1 else ''})" if left_out else ""
        note(
            f"error: no run has a retrieval picture to draw{first}; evaluate the runs with ddp-rank eval, which "
            "writes retrieval.json"
        )
        return EXIT_USAGE
    for line in left_out:
        note(line)
    picture, runs, queries = drawn
    note(f"retrieval grid: {picture} ({queries} queries; left to right: {', '.join(str(r) for r in runs)})")
    return 0


COMMAND = Command(
    "compare",
    help="one table of several runs: the settings that differ, best / last metrics, time, speed",
    description="Compare run directories (globs welcome; a sweep's folder stands for its runs): the config "
    "values that differ between them, steps and images seen, best and last metrics, wall time and images/s. "
    "Crashed, stopped and unfinished runs are listed as such.",
    arguments=_arguments,
    run=run,
)
