"""``ddp-rank eval``: Recall@k / MAP@R (or the verification / identification figures and their curves) of a
trained run, the untrained network or raw pixels. Thin.

Examples::

    ddp-rank eval --checkpoint runs/demo        # the run's config.yaml, its best (else latest) checkpoint
    ddp-rank eval --config configs/demo.yaml --baseline raw-pixels --output raw.json
    ddp-rank eval --checkpoint runs/demo/checkpoints/step-00000100 eval.search=torch
    ddp-rank eval --checkpoint runs/demo eval.protocol=verification --output runs/demo/verify.json  # + -roc.png
    ddp-rank eval --checkpoint runs/demo --bootstrap 1000   # R@1 52.80 ± 0.90: the spread over the queries
    ddp-rank eval --checkpoint runs/demo eval.protocol=verification --bootstrap 200   # over the identities
    ddp-rank eval --checkpoint runs/bs256-seed0 --per-query runs/bs256-seed0/queries.npz   # query by query
    accelerate launch --config_file launch/accelerate_cpu_2proc.yaml -m ddp_rank.cli eval --config ...

Every process embeds its part of the test split; the embeddings are gathered (padded) and rank 0 searches and
prints the table. ``--name`` labels the row of the table and the JSON entry.
"""

from __future__ import annotations

import argparse
import sys

from ddp_rank.cli.arguments import add_config_arguments
from ddp_rank.cli.command import Command
from ddp_rank.config import ConfigError

__all__ = ["COMMAND", "run"]


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(
        p,
        "experiment YAML; default with --checkpoint: the run's own config.yaml (else the checkpoint's meta.json)",
    )
    p.add_argument(
        "--checkpoint", help="run directory (its best, else latest checkpoint) or a step-* directory"
    )
    p.add_argument(
        "--baseline",
        choices=("untrained", "raw-pixels"),
        help="evaluate the network as built from the config (no checkpoint), or raw pixels",
    )
    p.add_argument(
        "--split",
        help="split to evaluate (default data.test_split; VehicleID recipe shards: every test_<size> list)",
    )
    p.add_argument("--name", help="row name in the table and key in the JSON (default: what was evaluated)")
    p.add_argument(
        "--output",
        help="write the results JSON here (default OUTPUT_DIR/eval.json); curve pictures and the retrieval "
        "picture (<name>-retrieval-<row>.png) go beside it",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=0,
        metavar="N",
        help="also each metric's spread: N resamples with replacement of the test queries (sop, inshop: 1000 is "
        "usual) or identities (verification, identification: each resample rescores the pairs, 100-200 is "
        "usual); the table shows value ± standard error, the JSON the 95%% interval too",
    )
    p.add_argument(
        "--bootstrap-seed", type=int, metavar="S", help="with --bootstrap: seed of the resampling (0)"
    )
    p.add_argument(
        "--per-query",
        metavar="PATH",
        help="also write each test query's values to PATH, an .npz: its hit at every k of eval.ks and its AP@R "
        "(one array per metric, whose means are the reported figures), its class ('label') and sample key "
        "('key'), in the order scored, lone queries left out; two runs evaluated on one split can then be "
        "compared query by query (ddp_rank.experiments.query_pairs). sop and inshop only",
    )


def run(args: argparse.Namespace) -> int:
    """Parse, evaluate, print. Setup errors print one clear line and exit 2."""
    from ddp_rank.eval.bootstrap import QueryBootstrap
    from ddp_rank.eval.protocols import EvalError
    from ddp_rank.eval.workflow import evaluate_and_record, load_run_config
    from ddp_rank.model import CheckpointError, ModelError
    from ddp_rank.runtime import TrainError

    if args.bootstrap == 1 or args.bootstrap < 0:
        print(
            f"ddp-rank eval: error: --bootstrap {args.bootstrap}: give 2 or more resamples (1000 is usual), "
            "or 0 for none",
            file=sys.stderr,
        )
        return 2
    if args.bootstrap_seed is not None and not args.bootstrap:
        print(
            "ddp-rank eval: error: --bootstrap-seed seeds --bootstrap N: add --bootstrap 1000 or leave it out",
            file=sys.stderr,
        )
        return 2
    bootstrap = QueryBootstrap(args.bootstrap, args.bootstrap_seed or 0) if args.bootstrap else None
    try:
        cfg = load_run_config(args.config, args.checkpoint, args.overrides)
        done = evaluate_and_record(
            cfg,
            checkpoint=args.checkpoint,
            baseline=args.baseline,
            split=args.split,
            name=args.name,
            output=args.output,
            bootstrap=bootstrap,
            per_query=args.per_query,
        )
        if done.written:
            print(f"\n{done.table()}\nresults: {done.path}")
    except (ConfigError, ModelError, CheckpointError, TrainError, EvalError) as exc:
        print(f"ddp-rank eval: error: {exc}", file=sys.stderr)
        return 2
    return 0


COMMAND = Command(
    "eval",
    help="retrieval evaluation (Recall@k, MAP@R) with the SOP / In-Shop / VehicleID protocols, or "
    "verification (TPR@FPR, ROC AUC, EER) and identification (CMC, FNIR@FPIR)",
    description="Embed the test split of data.shards and report Recall@k and MAP@R, or the verification / "
    "identification figures (eval.protocol, eval.metrics); their curves are drawn beside the results JSON as "
    "<name>-roc.png, -det.png, -pr.png, -cmc.png; <name>-retrieval-<row>.png beside it shows "
    "eval.grid_queries sampled queries and their top-k, framed green (the query's class) or red, captioned "
    "with the class names and files, a legend under them (recorded in retrieval.json; a training run's own "
    "retrieval.png is kept).",
    arguments=_arguments,
    run=run,
)
