"""Retrieval evaluation: embedding of test shards, Recall@k / MAP@R, the datasets' protocols, and what a
deployment uses after training: the export of a collection's embeddings, the nearest-neighbour index over them
and the searcher that answers query images.

The public names load on first use (as in ``ddp_rank.data``): the index needs faiss and the searcher torch, and
a script that only reads an export should pay for neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_rank.lazy_exports import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers; at run time ``__getattr__`` below loads them
    from ddp_rank.eval.export import Embeddings, ExportError, load_export, save_export
    from ddp_rank.eval.search import Hit, Searcher
    from ddp_rank.eval.vector_index import IndexBuildError, IndexSpec, SearchIndex, build_index

_EXPORTS = {
    "Embeddings": "ddp_rank.eval.export",
    "ExportError": "ddp_rank.eval.export",
    "load_export": "ddp_rank.eval.export",
    "save_export": "ddp_rank.eval.export",
    "Hit": "ddp_rank.eval.search",
    "Searcher": "ddp_rank.eval.search",
    "IndexBuildError": "ddp_rank.eval.vector_index",
    "IndexSpec": "ddp_rank.eval.vector_index",
    "SearchIndex": "ddp_rank.eval.vector_index",
    "build_index": "ddp_rank.eval.vector_index",
}

__all__ = [
    "Embeddings",
    "ExportError",
    "Hit",
    "IndexBuildError",
    "IndexSpec",
    "SearchIndex",
    "Searcher",
    "build_index",
    "load_export",
    "save_export",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
