"""Each test query's own values, written by ``ddp-rank eval --per-query PATH``.

Why: a reported Recall@1 is a mean over the queries, and two runs evaluated on the same split are scored on the
same queries. Comparing them query by query (the paired bootstrap over the test classes of
``ddp_rank.experiments.query_pairs``) cancels what the runs share, which two means alone cannot. That needs
each query's hit at every k and AP@R, its class (the bootstrap draws classes) and its sample key (which checks
that query i is the same image in every run).

The file is an ``.npz``: one float64 array per metric (``recall@1``, ..., ``map@r`` when MAP@R is computed),
``label`` (int64) and ``key`` (fixed-width unicode, so that ``np.load(..., allow_pickle=False)`` reads it), all
of one length, in the order the queries were scored (:meth:`ddp_rank.eval.retrieval.QueryScores.per_query`).
Lone queries (no other image of their class) are left out as the metrics leave them out, so each array's mean
is the metric the evaluation reports. ``ddp_rank.experiments.query_pairs.load_query_values`` reads it; every
array in the file other than ``label`` and ``key`` is taken for a metric, so nothing else is written.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddp_rank.atomic_io import atomic_write_bytes

__all__ = ["PER_QUERY_PROTOCOLS", "PerQuery", "per_query_refusal", "write_per_query"]

PER_QUERY_PROTOCOLS = ("sop", "inshop")
"""The protocols whose figures are means over queries with one value each (``QueryScores``)."""

_WHY_NOT = {
    "vehicleid": "its figures average random one-image galleries (eval.vehicleid_repeats), so a query has no one "
    "value",
    "verification": "its figures (TPR@FPR, ROC AUC, EER) are counted over pairs of images, not over queries",
    "identification": "its figures (CMC, FNIR@FPIR) are counted over probes of an enrolled / non-enrolled split, "
    "not over retrieval queries",
}


def per_query_refusal(protocol: str) -> str | None:
    """The one-line reason ``--per-query`` is refused for ``protocol``, or None where it is honoured.

    Why here and not in each caller: the command refuses before embedding and :func:`~ddp_rank.eval.protocols.
    evaluate` refuses again when called directly; both say the same thing."""
    if protocol in PER_QUERY_PROTOCOLS:
        return None
    why = _WHY_NOT.get(protocol, "it is not a retrieval protocol")
    return (
        f"--per-query writes each query's Recall@k and MAP@R values, which the {' and '.join(PER_QUERY_PROTOCOLS)} "
        f"protocols score; eval.protocol={protocol}: {why}: leave out --per-query"
    )


@dataclass(frozen=True)
class PerQuery:
    """The values of the scored queries (``values[metric]``: float64 [n]) with each query's class (``labels``,
    int64 [n]) and sample key (``keys``, str [n]), in scoring order."""

    values: dict[str, np.ndarray]
    labels: np.ndarray
    keys: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.labels)
        lengths = {name: len(v) for name, v in self.values.items()} | {"key": len(self.keys)}
        wrong = {name: m for name, m in lengths.items() if m != n}
        if wrong:
            raise ValueError(f"per-query arrays of other lengths than the {n} labels: {wrong}")
        clash = {"label", "key"} & set(self.values)
        if clash:
            raise ValueError(
                f"a metric may not be named {sorted(clash)}: the file keeps those names for the queries"
            )

    @property
    def num_queries(self) -> int:
        return len(self.labels)

    def arrays(self) -> dict[str, np.ndarray]:
        """The file's arrays, in the types the contract names (a key array of objects would need pickle)."""
        out = {name: np.asarray(v, dtype=np.float64) for name, v in self.values.items()}
        out["label"] = np.asarray(self.labels, dtype=np.int64)
        out["key"] = np.asarray([str(k) for k in self.keys], dtype=np.str_)
        return out


def write_per_query(per_query: PerQuery, path: str | os.PathLike[str]) -> Path:
    """Write ``per_query`` to ``path`` (exactly that name: numpy's ``.npz`` suffix is not added) atomically: a
    study reading the files of several runs never meets half of one written by a run still evaluating."""
    buffer = io.BytesIO()
    # Any: numpy's stubs read a ``**`` dict as its ``allow_pickle`` flag, which numpy < 2.1 does not take at all.
    arrays: dict[str, Any] = per_query.arrays()
    np.savez(buffer, **arrays)
    out = Path(path)
    atomic_write_bytes(out, buffer.getvalue())
    return out
