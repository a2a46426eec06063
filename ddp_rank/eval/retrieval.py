"""Exact inner-product retrieval and its metrics: Recall@k and MAP@R.

Definitions (FastAP paper sec. 5.1; Musgrave et al., "A Metric Learning Reality Check", 2020):

- Recall@k: the fraction of queries with at least one relevant item (same label) among their k nearest
  database items.
- MAP@R: for a query with R relevant database items, the mean over the first R results of precision@i at each
  relevant position i: ``(1/R) * sum_{i<=R} P(i) * rel(i)``.

Conventions, identical to pytorch-metric-learning's ``AccuracyCalculator`` so the numbers can be compared:
queries with no relevant database item are left out of every metric (and counted in ``num_lone_queries``);
when the database contains the queries (``exclude_self``), each query's own row is removed from its result list
(or, if it is not among the results, the last result is dropped).

Search is exact inner product (the embeddings are L2-normalised, so it ranks like Euclidean distance): a chunked
``torch.topk`` over query blocks on the GPU when there is one, else faiss's ``IndexFlatIP`` when faiss is
installed, else the chunked ``torch.topk`` on the CPU. Queries are
processed in blocks and the metrics accumulated, so memory stays ``O(block * (N + k))`` even for SOP's
60k x 60k with k = 1000.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ExactSearch",
    "QueryScores",
    "drop_self",
    "faiss_available",
    "knn_search",
    "query_scores",
]


def faiss_available() -> bool:
    """Whether faiss can be imported (the ``eval`` extra)."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        if device.type == "cuda":
            return "torch"  # exact top-k on the GPU beats faiss-cpu by far
        return "faiss" if faiss_available() else "torch"
    if backend == "faiss" and not faiss_available():
        raise RuntimeError(
            "eval.search=faiss but faiss is not installed: pip install faiss-cpu, or eval.search=torch"
        )
    if backend not in ("faiss", "torch"):
        raise ValueError(f"search backend {backend!r}: valid are auto, faiss, torch")
    return backend


SCORE_BYTES = 1 << 30
"""Most bytes of one block of query-by-database scores on the device (the chunked top-k's working memory)."""


class ExactSearch:
    """Exact inner-product search over a fixed database, built once and queried in blocks.

    ``backend="torch"`` keeps the database on ``device`` (default: the GPU when there is one) and runs
    ``topk`` over blocks of queries there, each block's score matrix at most :data:`SCORE_BYTES`;
    ``"faiss"`` uses ``IndexFlatIP`` on the CPU; ``"auto"`` picks torch on a GPU, else faiss when installed.
    """

    def __init__(
        self, database: Tensor, backend: str = "auto", device: torch.device | str | None = None
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.backend = _resolve_backend(backend, self.device)
        d = database.detach().float().contiguous()
        self.size, self.dim = int(d.shape[0]), int(d.shape[1]) if d.ndim == 2 else 0
        if self.backend == "faiss":
            import faiss

            self.index = faiss.IndexFlatIP(self.dim)
            self.index.add(d.cpu().numpy())
            self.device = torch.device("cpu")
        else:
            self.database = d.to(self.device)

    def search(self, queries: Tensor, k: int, block: int = 4096) -> tuple[Tensor, Tensor]:
        """(scores [Q, k] float32, indices [Q, k] int64) on the CPU, best first; ``k`` clipped to the size."""
        k = min(k, self.size)
        q = queries.detach().float().contiguous()
        if k == 0 or q.shape[0] == 0:
            return torch.empty(q.shape[0], k), torch.empty(q.shape[0], k, dtype=torch.int64)
        if self.backend == "faiss":
            scores, idx = self.index.search(q.cpu().numpy(), k)
            return torch.from_numpy(np.ascontiguousarray(scores)), torch.from_numpy(
                np.ascontiguousarray(idx)
            ).long()
        rows = max(1, min(block, SCORE_BYTES // (4 * max(self.size, 1))))
        out_s, out_i = [], []
        for start in range(0, q.shape[0], rows):
            s, i = torch.topk(q[start : start + rows].to(self.device) @ self.database.T, k, dim=1)
            out_s.append(s.cpu())
            out_i.append(i.cpu())
        return torch.cat(out_s), torch.cat(out_i)


def knn_search(
    queries: Tensor,
    database: Tensor,
    k: int,
    backend: str = "auto",
    block: int = 4096,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact top-``k`` inner-product search: returns (scores [Q, k] float32, indices [Q, k] int64), best first.

    ``k`` is clipped to the database size. See :class:`ExactSearch` for the backends and the device.
    """
    return ExactSearch(database, backend, device).search(queries, k, block)


def drop_self(indices: Tensor, self_index: Tensor) -> Tensor:
    """Remove each row's own index (or its last entry when absent): [Q, k+1] -> [Q, k]."""
    is_self = indices == self_index.unsqueeze(1)
    missing = ~is_self.any(dim=1)
    is_self[missing, -1] = True
    # Exactly one True per row: keep the others in order.
    return indices[~is_self].view(indices.shape[0], indices.shape[1] - 1)


@dataclass(frozen=True)
class QueryScores:
    """Each non-lone query's own figures: ``hits[k]`` (bool [n]: a relevant item among its first k results) and
    ``average_precision`` (float64 [n], the AP@R whose mean is MAP@R; None when not asked for). The metrics are
    their means; ``ddp_rank.eval.bootstrap`` resamples them."""

    hits: dict[int, np.ndarray]
    average_precision: np.ndarray | None
    num_lone_queries: int
    rows: np.ndarray | None = None
    """int64 [n]: which of the queries given to :func:`query_scores` each value belongs to (lone ones are left
    out), so that ``eval --per-query`` can name every value's query by its class and sample key."""

    @property
    def num_queries(self) -> int:
        return len(next(iter(self.hits.values()))) if self.hits else 0

    def per_query(self) -> dict[str, np.ndarray]:
        """``{"recall@1": [n] 0/1, ..., "map@r": [n]}``: the values whose means are the metrics."""
        out = {f"recall@{k}": hit.astype(np.float64) for k, hit in self.hits.items()}
        if self.average_precision is not None:
            out["map@r"] = self.average_precision
        return out

    def metrics(self) -> dict[str, float]:
        n = self.num_queries
        out: dict[str, float] = {
            name: (float(v.mean()) if n else float("nan")) for name, v in self.per_query().items()
        }
        out["num_queries"] = n
        out["num_lone_queries"] = self.num_lone_queries
        return out


def query_scores(
    queries: Tensor,
    query_labels: Tensor,
    database: Tensor,
    database_labels: Tensor,
    ks: Sequence[int],
    *,
    exclude_self: bool = False,
    map_at_r: bool = True,
    backend: str = "auto",
    block: int = 4096,
    device: torch.device | str | None = None,
) -> QueryScores:
    """Each query's hits at every k and its AP@R: Recall@k for each k in ``ks`` and MAP@R of ``queries``
    against ``database`` (``.metrics()``: ``{"recall@1": ..., "map@r": ..., "num_queries": ...,
    "num_lone_queries": ...}``).

    With ``exclude_self`` the database must be the queries themselves (SOP: each image queries the rest). A k
    larger than the database is clipped (Recall@k then counts every non-lone query as a hit).
    """
    if exclude_self and queries.shape[0] != database.shape[0]:
        raise ValueError("exclude_self needs the database to be the queries themselves")
    ql = query_labels.detach().cpu().long()
    dl = database_labels.detach().cpu().long()
    # R per query: relevant database items, the query itself excluded.
    uniq, counts = torch.unique(dl, return_counts=True)
    pos = torch.searchsorted(uniq, ql).clamp(max=max(len(uniq) - 1, 0))
    found = uniq[pos] == ql if len(uniq) else torch.zeros_like(ql, dtype=torch.bool)
    r = torch.where(found, counts[pos], torch.zeros_like(ql)) - int(exclude_self)
    valid = r > 0
    n_db = database.shape[0] - int(exclude_self)
    ks = sorted({int(x) for x in ks})
    k_max = min(max([*ks, int(r.max()) if map_at_r and len(r) else 1]), n_db)

    first_hits: list[Tensor] = []
    average_precisions: list[Tensor] = []
    q_idx = torch.nonzero(valid).flatten()
    searcher = ExactSearch(database, backend, device)
    for start in range(0, len(q_idx), block):
        rows = q_idx[start : start + block]
        _, idx = searcher.search(queries[rows], k_max + int(exclude_self), block=block)
        if exclude_self:
            idx = drop_self(idx, rows)
        rel = dl[idx] == ql[rows].unsqueeze(1)  # [b, k_max]
        first_hits.append(torch.where(rel.any(1), rel.float().argmax(1), torch.full_like(rows, k_max + 1)))
        if map_at_r:
            rr = r[rows]
            positions = torch.arange(1, k_max + 1).unsqueeze(0)
            in_r = positions <= rr.unsqueeze(1)
            rel_r = rel & in_r
            precision = rel_r.cumsum(1).double() / positions
            average_precisions.append((precision * rel_r).sum(1) / rr.double())
    first_hit = torch.cat(first_hits).numpy() if first_hits else np.zeros(0, dtype=np.int64)
    ap = torch.cat(average_precisions).numpy() if average_precisions else np.zeros(0)
    return QueryScores(
        hits={k: first_hit < k for k in ks},
        average_precision=ap if map_at_r else None,
        num_lone_queries=int((~valid).sum()),
        rows=q_idx.numpy().astype(np.int64),
    )
