"""The figures people who deploy an embedding model decide with: verification (1:1) and identification (1:N).

Either is a protocol of its own (``eval.protocol=verification`` / ``identification``) or reported beside another
protocol's Recall@k (``eval.metrics``). The metrics are plain numbers (None where not measurable); the curves
travel with them under :data:`ddp_rank.eval.curves.CURVES_KEY`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ddp_rank.eval.bootstrap import QueryBootstrap
from ddp_rank.eval.curves import CURVES_KEY
from ddp_rank.eval.identification import DEFAULT_FPIRS, DEFAULT_RANKS, identification_report, probe_outcomes
from ddp_rank.eval.identity_bootstrap import bootstrap_identification, bootstrap_verification
from ddp_rank.eval.verification import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_FPRS,
    DEFAULT_MAX_POSITIVE_PAIRS,
    fpr_key,
    verification_metrics,
)

__all__ = ["GROUPS", "DeploymentSettings", "deployment_metric_names", "deployment_metrics"]

GROUPS = ("verification", "identification")


@dataclass(frozen=True)
class DeploymentSettings:
    """The settings of both groups (``eval.fprs``, ``eval.fpirs``, ... ; ``ranks``: the CMC ranks)."""

    fprs: tuple[float, ...] = DEFAULT_FPRS
    fpirs: tuple[float, ...] = DEFAULT_FPIRS
    ranks: tuple[int, ...] = DEFAULT_RANKS
    enrolled_fraction: float = 0.5
    gallery_per_identity: int = 1
    max_positive_pairs: int = DEFAULT_MAX_POSITIVE_PAIRS
    block_bytes: int = DEFAULT_BLOCK_BYTES
    seed: int = 0


def deployment_metric_names(groups: Sequence[str], settings: DeploymentSettings) -> list[str]:
    """The metric keys :func:`deployment_metrics` returns for ``groups``, known before any image is read."""
    names: list[str] = []
    if "verification" in groups:
        names += [fpr_key("tpr@fpr", f) for f in settings.fprs]
        names += ["roc_auc", "eer", "pr_auc", "num_positive_pairs", "num_negative_pairs"]
    if "identification" in groups:
        names += [f"cmc@{r}" for r in sorted(set(settings.ranks))]
        names += [fpr_key("fnir@fpir", f) for f in settings.fpirs]
        names += ["gallery_size", "gallery_identities", "num_mated_probes", "num_non_mated_probes"]
    return names


def deployment_metrics(
    groups: Sequence[str],
    embeddings: Tensor,
    labels: Tensor,
    settings: DeploymentSettings,
    bootstrap: QueryBootstrap | None = None,
) -> dict[str, Any]:
    """The figures of ``groups`` on the embedded split, with their curves under ``CURVES_KEY``; ``bootstrap``:
    with their spread over the identities under ``bootstrap`` (``ddp_rank.eval.identity_bootstrap``).

    Raises ValueError (the message names the setting) when the split is too large for the exact verification.
    """
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown metric group {unknown[0]!r}; valid: {', '.join(GROUPS)}")
    e = embeddings.detach().float().cpu().numpy()
    y = labels.detach().cpu().long().numpy()
    out: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    spreads: dict[str, Any] = {}
    if "verification" in groups:
        metrics, drawn = verification_metrics(
            e,
            y,
            settings.fprs,
            block_bytes=settings.block_bytes,
            max_positive_pairs=settings.max_positive_pairs,
        )
        out.update(metrics)
        curves.update(drawn)
        if bootstrap is not None:
            spreads.update(bootstrap_verification(e, y, bootstrap, settings.fprs, settings.block_bytes))
    if "identification" in groups:
        outcomes = probe_outcomes(
            e,
            y,
            enrolled_fraction=settings.enrolled_fraction,
            gallery_per_identity=settings.gallery_per_identity,
            seed=settings.seed,
            block_bytes=settings.block_bytes,
        )
        metrics, drawn = identification_report(outcomes, settings.ranks, settings.fpirs)
        out.update(metrics)
        curves.update(drawn)
        if bootstrap is not None:
            spreads.update(bootstrap_identification(outcomes, y, bootstrap, settings.ranks, settings.fpirs))
    if bootstrap is not None:
        out["bootstrap"] = {
            "resamples": bootstrap.resamples,
            "seed": bootstrap.seed,
            "over": ["identities"],
            "metrics": spreads,
        }
    out[CURVES_KEY] = curves
    return out
