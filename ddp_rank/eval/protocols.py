"""The retrieval protocols of the papers, on a set of test embeddings with their labels and subsets.

- ``sop`` (Stanford Online Products; also the PNP paper's datasets and the demo): every test image queries all
  the other test images; Recall@1, 10, 100, 1000.
- ``inshop`` (In-Shop Clothes Retrieval): images of subset ``query`` search the images of subset ``gallery``;
  Recall@1, 10, 20, 30, 40, 50.
- ``vehicleid`` (PKU VehicleID): for each test list (``small`` 800, ``medium`` 1,600, ``large`` 2,400
  vehicles), one image per vehicle is drawn at random into the gallery and all the others query it;
  Recall@1, 5, averaged over ``repeats`` draws. Plain keys (``recall@1``) repeat the largest evaluated list.
  No MAP@R: each query has exactly one relevant gallery image, so MAP@R would always equal Recall@1.
- ``verification``: every pair of the test set, TPR@FPR, ROC AUC, EER, AP (``ddp_rank.eval.verification``).
- ``identification``: a seeded enrolled / non-enrolled split of the test identities, CMC and FNIR@FPIR with the
  gallery size (``ddp_rank.eval.identification``).

Beside ``sop`` and ``inshop``, ``metrics`` adds the verification and/or identification figures on the same test
set (``eval.metrics``); their curves come under the key ``curves`` (``ddp_rank.eval.curves``).

Subsets come from the ``subset`` field of each sample's ``.json`` in the shards (written by the data layer's
build from the listing's ``subset`` column). A sample may carry several tokens separated by commas, e.g.
``small,medium,large`` for a VehicleID image that is in all three test lists. The data layer's VehicleID recipe
writes each test list as its own split instead (``test_small`` / ``test_medium`` / ``test_large``);
``ddp_rank.eval.runner`` then embeds each split and marks its samples with the list's token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ddp_rank.eval.bootstrap import QueryBootstrap, bootstrap_queries
from ddp_rank.eval.deployment import (
    DeploymentSettings,
    deployment_metric_names,
    deployment_metrics,
)
from ddp_rank.eval.per_query import PerQuery, per_query_refusal
from ddp_rank.eval.retrieval import QueryScores, query_scores

__all__ = [
    "DEPLOYMENT_PROTOCOLS",
    "PROTOCOLS",
    "PROTOCOL_KS",
    "SUBSET_TOKENS",
    "VEHICLEID_SIZES",
    "EmbeddedSet",
    "EvalError",
    "evaluate",
    "metric_names",
    "subset_mask",
    "subsets_to_bits",
    "with_largest_list_as_headline",
]

PROTOCOLS = ("sop", "inshop", "vehicleid", "verification", "identification")
DEPLOYMENT_PROTOCOLS = ("verification", "identification")
PROTOCOL_KS: dict[str, tuple[int, ...]] = {
    "sop": (1, 10, 100, 1000),
    "inshop": (1, 10, 20, 30, 40, 50),
    "vehicleid": (1, 5),
}
SUBSET_TOKENS: tuple[str, ...] = ("query", "gallery", "small", "medium", "large")
"""Subset names the protocols understand; each is one bit of a sample's subset mask."""
VEHICLEID_SIZES = ("small", "medium", "large")


class EvalError(ValueError):
    """The test data does not fit the requested protocol; the message says what is missing."""


def subsets_to_bits(subset: str | None) -> int:
    """``"small,medium"`` -> a bit mask over :data:`SUBSET_TOKENS` (unknown tokens are ignored)."""
    bits = 0
    for token in re.split(r"[,+;\s]+", (subset or "").strip().lower()):
        if token in SUBSET_TOKENS:
            bits |= 1 << SUBSET_TOKENS.index(token)
    return bits


@dataclass
class EmbeddedSet:
    """A test set after embedding: ``embeddings [N, d]``, ``labels [N]`` and ``subset_bits [N]`` (int64)."""

    embeddings: Tensor
    labels: Tensor
    subset_bits: Tensor
    index: Tensor | None = None
    """``[N]`` int64 hash of each sample's key (``ddp_rank.eval.runner.key_index``), when read from shards: the
    retrieval picture finds its samples' images by it."""
    keys: np.ndarray | None = None
    """``[N]`` str: each sample's key, when the embedding was asked for them (``eval --per-query`` names its
    queries by them; gathering every key costs memory and a collective that an evaluation without it skips)."""

    def __post_init__(self) -> None:
        if not (len(self.embeddings) == len(self.labels) == len(self.subset_bits)):
            raise ValueError("embeddings, labels and subset_bits must have the same length")
        if self.index is not None and len(self.index) != len(self.labels):
            raise ValueError("index must have one entry per embedding")
        if self.keys is not None and len(self.keys) != len(self.labels):
            raise ValueError("keys must have one entry per embedding")

    @classmethod
    def from_lists(
        cls,
        embeddings: Tensor,
        labels: Iterable[int],
        subsets: Iterable[str | None],
        keys: Iterable[str] | None = None,
    ) -> EmbeddedSet:
        """Build from per-sample subset strings (tests, notebooks)."""
        return cls(
            embeddings,
            torch.as_tensor(list(labels), dtype=torch.int64),
            torch.tensor([subsets_to_bits(s) for s in subsets], dtype=torch.int64),
            keys=None if keys is None else np.asarray(list(keys), dtype=np.str_),
        )


def subset_mask(data: EmbeddedSet, token: str) -> Tensor:
    """Boolean mask of the samples that carry subset ``token``."""
    return (data.subset_bits & (1 << SUBSET_TOKENS.index(token))) != 0


def _ks(protocol: str, ks: Sequence[int] | None) -> list[int]:
    return list(ks) if ks else list(PROTOCOL_KS.get(protocol, ()))


def metric_names(
    protocol: str,
    ks: Sequence[int] | None = None,
    *,
    map_at_r: bool = True,
    vehicleid_sizes: Sequence[str] = VEHICLEID_SIZES,
    metrics: Sequence[str] = (),
    deployment: DeploymentSettings | None = None,
) -> list[str]:
    """The metric keys :func:`evaluate` returns for these settings, known before any image is read.

    Why: the trainer checks ``train.best_metric`` against them at start-up instead of at the first evaluation.
    """
    if protocol not in PROTOCOLS:
        raise EvalError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    settings = _deployment_settings(deployment, ks)
    if protocol in DEPLOYMENT_PROTOCOLS:
        return deployment_metric_names([protocol, *_extra_groups(protocol, metrics)], settings)
    extra = deployment_metric_names(_extra_groups(protocol, metrics), settings)
    base = [f"recall@{k}" for k in sorted(set(_ks(protocol, ks)))]
    if map_at_r and protocol != "vehicleid":
        base.append("map@r")
    base += ["num_queries", "num_lone_queries"]
    if protocol != "vehicleid":
        return base + extra
    return base + [f"{size}/{name}" for size in vehicleid_sizes for name in base]


def evaluate(
    protocol: str,
    data: EmbeddedSet,
    ks: Sequence[int] | None = None,
    *,
    map_at_r: bool = True,
    backend: str = "auto",
    vehicleid_sizes: Sequence[str] = VEHICLEID_SIZES,
    repeats: int = 1,
    seed: int = 0,
    device: torch.device | str | None = None,
    metrics: Sequence[str] = (),
    deployment: DeploymentSettings | None = None,
    bootstrap: QueryBootstrap | None = None,
    per_query: bool = False,
) -> dict[str, Any]:
    """Run ``protocol`` on ``data``; returns a flat ``{metric: value}`` dict (see the module doc for keys), with
    the curves of the verification / identification figures under ``curves`` when there are any.

    ``backend`` / ``device``: the exact search (:class:`ddp_rank.eval.retrieval.ExactSearch`; by default on the
    GPU when there is one). ``metrics``: figure groups added beside ``sop`` / ``inshop`` (``verification``,
    ``identification``), with ``deployment``'s settings (``ks`` gives the CMC ranks when set). ``bootstrap``:
    also the spread of each metric under the key ``bootstrap``: Recall@k and MAP@R over the queries
    (``ddp_rank.eval.bootstrap``), the verification and identification figures over the identities
    (``ddp_rank.eval.identity_bootstrap``); refused for vehicleid. ``per_query``: also each scored query's
    Recall@k and MAP@R values, class and key (:class:`ddp_rank.eval.per_query.PerQuery`, under the key
    ``per_query``; ``data.keys`` must be set); sop and inshop only.
    """
    if protocol not in PROTOCOLS:
        raise EvalError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    refusal = per_query_refusal(protocol) if per_query else None
    if refusal is not None:
        raise EvalError(refusal)
    if per_query and data.keys is None:
        raise EvalError(
            "per-query values name their queries by sample key, and this embedded set carries none: embed it "
            "with ddp_rank.eval.runner.embed_split(..., keys=True)"
        )
    if bootstrap is not None and protocol == "vehicleid":
        raise EvalError(
            "the bootstrap covers the sop, inshop, verification and identification protocols; VehicleID's "
            "figures average random galleries (eval.vehicleid_repeats): leave out --bootstrap"
        )
    if len(data.labels) < 2:
        raise EvalError(f"the test set has {len(data.labels)} image(s): retrieval needs at least 2")
    settings = _deployment_settings(deployment, ks)
    if protocol in DEPLOYMENT_PROTOCOLS:
        groups = [protocol, *_extra_groups(protocol, metrics)]
        return _deployment(protocol, groups, data, settings, bootstrap)
    groups = _extra_groups(protocol, metrics)  # refused before any search
    out: dict[str, Any] = _evaluate_retrieval(
        protocol,
        data,
        ks,
        map_at_r=map_at_r,
        backend=backend,
        vehicleid_sizes=vehicleid_sizes,
        repeats=repeats,
        seed=seed,
        device=device,
        bootstrap=bootstrap,
        per_query=per_query,
    )
    if not groups:
        return out
    figures = _deployment(protocol, groups, data, settings, bootstrap)
    if bootstrap is not None:  # one entry: Recall@k's spread over the queries, the rest over the identities
        spreads = figures.pop("bootstrap")
        out["bootstrap"] = {
            **out["bootstrap"],
            "over": ["queries", "identities"],
            "metrics": {**out["bootstrap"]["metrics"], **spreads["metrics"]},
        }
    return {**out, **figures}


def _deployment_settings(settings: DeploymentSettings | None, ks: Sequence[int] | None) -> DeploymentSettings:
    settings = settings or DeploymentSettings()
    return replace(settings, ranks=tuple(ks)) if ks else settings


def _extra_groups(protocol: str, metrics: Sequence[str]) -> list[str]:
    """The groups of ``eval.metrics`` added to ``protocol``; refused beside VehicleID (a set of test lists, each
    evaluated on its own: there is no one split of pairs)."""
    groups = [m for m in metrics if m != protocol]  # verification and identification go together too
    if groups and protocol == "vehicleid":
        raise EvalError(
            f"eval.metrics={','.join(groups)} is not available beside eval.protocol=vehicleid (its test lists are "
            "evaluated one by one); use eval.protocol=verification or identification on one list's split"
        )
    return groups


def _deployment(
    protocol: str,
    groups: Sequence[str],
    data: EmbeddedSet,
    settings: DeploymentSettings,
    bootstrap: QueryBootstrap | None = None,
) -> dict[str, Any]:
    try:
        return deployment_metrics(groups, data.embeddings, data.labels, settings, bootstrap)
    except ValueError as exc:
        raise EvalError(f"eval.protocol={protocol}: {exc}") from exc


def _evaluate_retrieval(
    protocol: str,
    data: EmbeddedSet,
    ks: Sequence[int] | None,
    *,
    map_at_r: bool,
    backend: str,
    vehicleid_sizes: Sequence[str],
    repeats: int,
    seed: int,
    device: torch.device | str | None,
    bootstrap: QueryBootstrap | None,
    per_query: bool = False,
) -> dict[str, Any]:
    """Recall@k / MAP@R under the papers' protocols (sop, inshop, vehicleid), with their query bootstrap and
    (sop, inshop) the per-query values."""
    kk = _ks(protocol, ks)
    e, y = data.embeddings, data.labels
    if protocol == "sop":
        scores = query_scores(
            e, y, e, y, kk, exclude_self=True, map_at_r=map_at_r, backend=backend, device=device
        )
        return _with_extras(scores, bootstrap, data, torch.arange(len(y)) if per_query else None)
    if protocol == "inshop":
        q, g = subset_mask(data, "query"), subset_mask(data, "gallery")
        if not q.any() or not g.any():
            raise EvalError(
                f"protocol inshop needs test samples with subset 'query' and 'gallery' (found {int(q.sum())} query, "
                f"{int(g.sum())} gallery): build the shards with the In-Shop recipe, or use eval.protocol=sop"
            )
        scores = query_scores(e[q], y[q], e[g], y[g], kk, map_at_r=map_at_r, backend=backend, device=device)
        return _with_extras(scores, bootstrap, data, torch.nonzero(q).flatten() if per_query else None)
    # vehicleid
    out: dict[str, float] = {}
    gen = torch.Generator().manual_seed(seed)
    evaluated = []
    for size in vehicleid_sizes:
        mask = subset_mask(data, size)
        if not mask.any():
            raise EvalError(
                f"protocol vehicleid: no test sample carries subset '{size}'; build the shards with the VehicleID "
                "recipe (subset tokens small/medium/large) or set eval.vehicleid_sizes"
            )
        idx = torch.nonzero(mask).flatten()
        sums: dict[str, float] = {}
        for _ in range(repeats):
            gallery = _one_per_class(y[idx], gen)
            is_g = torch.zeros(len(idx), dtype=torch.bool)
            is_g[gallery] = True
            qi, gi = idx[~is_g], idx[is_g]
            # One relevant gallery image per query: MAP@R would repeat Recall@1, so it is left out.
            res = query_scores(
                e[qi], y[qi], e[gi], y[gi], kk, map_at_r=False, backend=backend, device=device
            ).metrics()
            for k, v in res.items():
                sums[k] = sums.get(k, 0.0) + v / repeats
        for k, v in sums.items():
            out[f"{size}/{k}"] = v
        evaluated.append(size)
    return with_largest_list_as_headline(out, evaluated)


def _with_extras(
    scores: QueryScores, bootstrap: QueryBootstrap | None, data: EmbeddedSet, query_rows: Tensor | None
) -> dict[str, Any]:
    """The metrics of ``scores``, with their spread over the queries when ``bootstrap`` is asked for, and each
    query's values when ``query_rows`` (the rows of ``data`` that were the queries, in the order given to the
    search) is."""
    out: dict[str, Any] = dict(scores.metrics())
    if bootstrap is not None:
        out["bootstrap"] = bootstrap_queries(scores, bootstrap)
    if query_rows is not None:
        # query_scores always sets rows; evaluate refused a set without keys.
        assert scores.rows is not None and data.keys is not None
        rows = query_rows.cpu().numpy()[scores.rows]
        out["per_query"] = PerQuery(scores.per_query(), data.labels.cpu().numpy()[rows], data.keys[rows])
    return out


def _one_per_class(labels: Tensor, gen: torch.Generator) -> Tensor:
    """Positions of one randomly drawn sample per distinct label (the VehicleID gallery)."""
    perm = torch.randperm(len(labels), generator=gen)
    shuffled = labels[perm]
    order = torch.argsort(shuffled, stable=True)
    sorted_labels = shuffled[order]
    first = torch.ones(len(labels), dtype=torch.bool)
    first[1:] = sorted_labels[1:] != sorted_labels[:-1]
    return perm[order[first]]


def with_largest_list_as_headline(out: dict[str, Any], sizes: list[str]) -> dict[str, Any]:
    """VehicleID reports each test list as ``<size>/<metric>``; the largest list evaluated also gives the
    plain metric names (the headline figure, as in the papers' tables)."""
    largest = max(sizes, key=VEHICLEID_SIZES.index)
    out.update({k.split("/", 1)[1]: v for k, v in list(out.items()) if k.startswith(f"{largest}/")})
    return out
