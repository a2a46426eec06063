"""``ddp-rank shards features`` and ``ddp-rank shards whiten``: feature shards, embedded once by a frozen
backbone, and their PCA whitening. Thin: parse and call."""

from __future__ import annotations

import argparse
import sys

from ddp_rank.cli.command import Command
from ddp_rank.data.format.info import format_info


def _features_arguments(p: argparse.ArgumentParser) -> None:
    from ddp_rank.cli.arguments import add_config_arguments

    p.add_argument("source", help="image shard directory or URL (made by `shards build` or `shards index`)")
    p.add_argument("out", help="directory to write the feature shards to (new, or an unfinished build)")
    add_config_arguments(p, "experiment YAML: model.backbone/weights/pooling and data.* sizes and crop")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--overwrite", action="store_true", help="replace the feature shards in OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _whiten_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="feature shard directory or URL (made by `shards features`)")
    p.add_argument("out", help="directory to write the whitened shards to (new, or an unfinished build)")
    p.add_argument("--dim", type=int, default=None, help="axes kept, largest variance first (default: all)")
    p.add_argument(
        "--shrinkage",
        type=float,
        default=1e-4,
        help="added to each eigenvalue, times their mean, before dividing by its root (default 1e-4)",
    )
    p.add_argument("--split", default="train", help="the split the map is fitted on (default: train)")
    p.add_argument("--overwrite", action="store_true", help="replace the whitened shards in OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _features(args: argparse.Namespace) -> int:
    from ddp_rank.config import ConfigError, load_config
    from ddp_rank.distributed import end_process_group
    from ddp_rank.eval.features.build import FeatureBuildError, FeatureBuildOptions, build_feature_shards
    from ddp_rank.model import ModelError
    from ddp_rank.runtime import make_accelerator

    accelerator = None
    try:
        if args.batch_size < 1:
            raise FeatureBuildError(f"--batch-size must be at least 1, got {args.batch_size}")
        cfg = load_config(args.config, args.overrides)
        accelerator = make_accelerator(cfg)
        options = FeatureBuildOptions(args.batch_size, args.overwrite, not args.no_progress)
        manifest = build_feature_shards(
            cfg.model, cfg.data, cfg.train.seed, args.source, args.out, accelerator, options
        )
    except (ConfigError, ModelError, FeatureBuildError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if accelerator is not None:
            accelerator.end_training()
        end_process_group()
    if manifest is not None:
        print(format_info(args.out))
    return 0


def _whiten(args: argparse.Namespace) -> int:
    from ddp_rank.eval.features.build import FeatureBuildError
    from ddp_rank.eval.features.whiten import WhitenOptions, whiten_feature_shards

    try:
        options = WhitenOptions(args.dim, args.shrinkage, args.split, args.overwrite, not args.no_progress)
        manifest, eigenvalues = whiten_feature_shards(args.source, args.out, options)
    except (FeatureBuildError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kept = manifest.build["features"]["dim"]
    share = float(eigenvalues[:kept].sum() / eigenvalues.sum())
    print(f"whitened: {kept} of {len(eigenvalues)} axes, {share:.1%} of the {args.split} vectors' variance")
    print(format_info(args.out))
    return 0


COMMANDS = (
    Command(
        "features",
        help="embed every image of a shard set once with the config's frozen backbone: feature shards "
        "(train a head on them with model.backbone=features)",
        arguments=_features_arguments,
        run=_features,
    ),
    Command(
        "whiten",
        help="PCA-whiten the vectors of feature shards (fitted on the training split): a head trains on them "
        "in a few epochs",
        arguments=_whiten_arguments,
        run=_whiten,
    ),
)
