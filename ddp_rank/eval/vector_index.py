"""Nearest-neighbour indexes over exported embeddings (faiss): exact, IVF-PQ or HNSW, with measured recall.

All three rank by inner product (the embeddings are L2-normalised, so this is cosine similarity):

- ``flat``: ``IndexFlatIP``, exact; the reference the others are measured against.
- ``ivfpq``: ``IndexIVFPQ``: ``nlist`` k-means cells, ``nprobe`` of them visited per query, vectors compressed to
  ``pq_m`` codes of ``pq_bits`` bits (``pq_m * pq_bits / 8`` bytes instead of ``4 d``). Needs training data: at
  least ``2 ** pq_bits`` and ``nlist`` vectors; unset values are chosen from the collection's size.
- ``hnsw``: ``IndexHNSWFlat``: a graph with ``hnsw_m`` links per node, ``ef_search`` candidates per query.

:func:`recall_against_exact` measures what the approximation costs: for a sample of the indexed vectors used as
queries, the fraction of their exact top-k that the index returns in its top-k.

An index directory holds ``index.faiss``, ``items/`` (the export it indexes, in the export layout: row i of the
index is row i there, with its key, label and category) and ``index.json`` (the kind, its settings, the measured
recall, the description of the export: source, checkpoint, model, and the size and SHA-256 of ``index.faiss``).
:meth:`SearchIndex.load` checks every file before faiss or numpy reads it and refuses a missing, cut or changed
one in one line that names it (``ddp_rank.eval.export`` checks ``items/``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.eval.export import Embeddings, ExportError, read_json_file
from ddp_rank.file_checks import file_digest, size_problem

__all__ = [
    "INDEX_KINDS",
    "IndexBuildError",
    "IndexSpec",
    "SearchIndex",
    "build_index",
    "recall_against_exact",
]

INDEX_KINDS = ("flat", "ivfpq", "hnsw")
INDEX_FILE = "index.faiss"
_REBUILD = "build it again with `ddp-rank index EXPORT --output DIR`"


class IndexBuildError(ValueError):
    """An index that cannot be built as asked; the message names the setting to change."""


@dataclass
class IndexSpec:
    """How to build an index; 0 means "choose from the collection" where a setting says so."""

    kind: str = "flat"
    nlist: int = 0
    """ivfpq: k-means cells; 0 = about 4 sqrt(N), at most N / 39 (faiss's minimum of 39 points per cell)."""
    nprobe: int = 16
    """ivfpq: cells visited per query (clipped to nlist)."""
    pq_m: int = 0
    """ivfpq: sub-quantizers, a divisor of the dimension; 0 = the largest divisor <= 64 with >= 2 dims each."""
    pq_bits: int = 0
    """ivfpq: bits per code; 0 = 8, fewer for a collection under 256 vectors."""
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise IndexBuildError(f"index kind {self.kind!r}: valid are {', '.join(INDEX_KINDS)}")


def _pq_m(dim: int) -> int:
    return max([m for m in range(1, min(64, dim // 2) + 1) if dim % m == 0] or [1])


def _resolved(spec: IndexSpec, n: int, dim: int) -> IndexSpec:
    """``spec`` with its automatic values filled in for ``n`` vectors of ``dim``; impossible values refused."""
    if spec.kind != "ivfpq":
        return spec
    nlist = spec.nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
    pq_m = spec.pq_m or _pq_m(dim)
    pq_bits = spec.pq_bits or max(1, min(8, int(math.log2(max(n, 2)))))
    if nlist > n:
        raise IndexBuildError(f"nlist={nlist} cells for {n} vectors: use at most {n} (or 0 to choose)")
    if dim % pq_m:
        raise IndexBuildError(
            f"pq_m={pq_m} does not divide the dimension {dim}; pick a divisor (or 0 to choose)"
        )
    if 2**pq_bits > n:
        raise IndexBuildError(
            f"pq_bits={pq_bits} needs at least {2**pq_bits} vectors to train its codebooks, the export has {n}: "
            f"use pq_bits <= {int(math.log2(n))} (or 0 to choose), or the flat / hnsw index"
        )
    return IndexSpec("ivfpq", nlist, min(spec.nprobe, nlist), pq_m, pq_bits)


def build_index(vectors: np.ndarray, spec: IndexSpec) -> tuple[Any, IndexSpec]:
    """A faiss index over ``vectors [N, d]`` (float32) and the settings it was built with."""
    import faiss

    x = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = x.shape
    if n == 0:
        raise IndexBuildError("the export holds no embedding: nothing to index")
    spec = _resolved(spec, n, dim)
    index: Any
    if spec.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, spec.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = spec.ef_construction
        index.hnsw.efSearch = spec.ef_search
    else:
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFPQ(
            quantizer, dim, spec.nlist, spec.pq_m, spec.pq_bits, faiss.METRIC_INNER_PRODUCT
        )
        index.train(x)
        index.nprobe = spec.nprobe
    index.add(x)
    return index, spec


def recall_against_exact(
    index: Any, vectors: np.ndarray, k: int = 10, num_queries: int = 1000, seed: int = 0
) -> tuple[float, int, float]:
    """(recall@k of ``index`` against exact search, number of queries, seconds ``index`` took for them):
    ``num_queries`` indexed vectors drawn at random serve as queries; recall = |approximate top-k ∩ exact
    top-k| / k, averaged."""
    import faiss

    x = np.ascontiguousarray(vectors, dtype=np.float32)
    k = min(k, len(x))
    rows = np.random.default_rng(seed).choice(len(x), size=min(num_queries, len(x)), replace=False)
    exact = faiss.IndexFlatIP(x.shape[1])
    exact.add(x)
    _, truth = exact.search(x[rows], k)
    t0 = time.perf_counter()
    _, found = index.search(x[rows], k)
    seconds = time.perf_counter() - t0
    hits = sum(len(set(t.tolist()) & set(f.tolist())) for t, f in zip(truth, found))
    return hits / (k * len(rows)), len(rows), seconds


@dataclass
class SearchIndex:
    """A built index with the keys, labels and categories of its rows (row i of the index is item i).

    Examples:
        An exact (``flat``) index over four embedded items, and the two nearest to a query:

        >>> import numpy as np
        >>> from ddp_rank.eval import Embeddings, IndexSpec, SearchIndex
        >>> items = Embeddings(
        ...     np.eye(4, dtype=np.float32), keys=np.array(["a", "b", "c", "d"]), labels=np.arange(4),
        ...     categories=np.zeros(4, dtype=np.int64), subsets=np.array(["test"] * 4),
        ... )
        >>> index = SearchIndex.build(items, IndexSpec("flat"))
        >>> scores, rows = index.search(np.array([[0.8, 0.6, 0.0, 0.0]], dtype=np.float32), k=2)
        >>> items.keys[rows[0]].tolist(), [round(float(score), 2) for score in scores[0]]
        (['a', 'b'], [0.8, 0.6])
    """

    index: Any
    items: Embeddings
    """The export the index was built from (embeddings included, so the index can be rebuilt or re-measured)."""
    info: dict[str, Any]

    @classmethod
    def build(
        cls, data: Embeddings, spec: IndexSpec, recall_k: int = 10, recall_queries: int = 1000
    ) -> SearchIndex:
        """Build over ``data`` and measure recall@``recall_k`` against exact search."""
        t0 = time.perf_counter()
        index, resolved = build_index(data.embeddings, spec)
        built = time.perf_counter() - t0
        recall, queries, seconds = recall_against_exact(index, data.embeddings, recall_k, recall_queries)
        per_query = seconds / max(queries, 1)
        info = {
            "spec": asdict(resolved),
            "rows": len(data),
            "dim": data.dim,
            f"recall@{recall_k}": recall,
            "recall_k": recall_k,
            "recall_queries": queries,
            "build_seconds": built,
            "search_seconds_per_query": per_query,
            "export": data.meta,
        }
        return cls(index, data, info)

    @property
    def recall(self) -> float:
        return float(self.info[f"recall@{self.info['recall_k']}"])

    def search(self, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """(scores [Q, k], row indices [Q, k]) best first; -1 where the index found fewer than k."""
        return self.index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(self.items)))

    def save(self, out_dir: str | os.PathLike[str]) -> Path:
        import faiss

        from ddp_rank.eval.export import save_export

        root = Path(out_dir)
        root.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(root / INDEX_FILE))
        save_export(self.items, root / "items")
        self.info["files"] = {INDEX_FILE: file_digest(root / INDEX_FILE)}
        atomic_write_text(root / "index.json", json.dumps(self.info, indent=1) + "\n")
        return root

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SearchIndex:
        """Read an index directory, every file checked first (:class:`ExportError` names the damaged one)."""
        import faiss

        from ddp_rank.eval.export import load_export

        root = Path(path)
        if not (root / "index.json").is_file():
            raise FileNotFoundError(
                f"'{path}' is not an index directory (no index.json): build one with `ddp-rank index`"
            )
        info = _read_info(root / "index.json")
        _check_index_file(root, info.get("files"))
        items = load_export(root / "items")
        try:
            index: Any = faiss.read_index(str(root / INDEX_FILE))
        except RuntimeError as exc:  # faiss's message is a C++ location: the file and the fix say more
            raise ExportError(f"{root / INDEX_FILE} cannot be read by faiss (damaged); {_REBUILD}") from exc
        if index.ntotal != len(items) or index.d != items.dim:
            raise ExportError(
                f"{root / INDEX_FILE} holds {index.ntotal} vectors of dim {index.d} but items/ holds {len(items)} of "
                f"dim {items.dim}: they come from different builds; {_REBUILD}"
            )
        if info["spec"]["kind"] == "hnsw":
            index.hnsw.efSearch = info["spec"]["ef_search"]
        elif info["spec"]["kind"] == "ivfpq":
            index.nprobe = info["spec"]["nprobe"]
        return cls(index, items, info)


def _read_info(path: Path) -> dict[str, Any]:
    """``index.json``, checked: an object with the index's kind and the settings :meth:`SearchIndex.load` uses."""
    info = read_json_file(path, _REBUILD)
    spec = info.get("spec") if isinstance(info, dict) else None
    needs = {"hnsw": "ef_search", "ivfpq": "nprobe"}
    if (
        not isinstance(spec, dict)
        or spec.get("kind") not in INDEX_KINDS
        or not isinstance(spec.get(needs.get(spec["kind"], "kind")), int | str)
        or not isinstance(info.get("recall_k"), int)
    ):
        raise ExportError(f"{path} is damaged (no valid spec.kind, its settings, recall_k); {_REBUILD}")
    return info


def _check_index_file(root: Path, files: Any) -> None:
    """``index.faiss`` against its size and SHA-256 in ``index.json`` (an index of an older version, without
    them: it must exist, and faiss's own reading is the check)."""
    path = root / INDEX_FILE
    record = files.get(INDEX_FILE) if isinstance(files, dict) else None
    if (
        isinstance(record, dict)
        and isinstance(record.get("bytes"), int)
        and isinstance(record.get("sha256"), str)
    ):
        problem = size_problem(path, record["bytes"])
        if problem is None and file_digest(path)["sha256"] != record["sha256"]:
            problem = f"{INDEX_FILE} does not match the SHA-256 recorded in index.json"
    elif files is not None:
        problem = "index.json's record of index.faiss is damaged"
    else:
        problem = None if path.is_file() else f"{INDEX_FILE} is missing"
    if problem is not None:
        raise ExportError(f"{root}: {problem}; {_REBUILD}")
