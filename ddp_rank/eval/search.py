"""Answer query images: embed them with the exported model, look them up in an index, return keys and scores.

``Searcher`` is the Python API for serving from your own code; ``ddp-rank search`` prints what it returns. The
model is rebuilt from what the index records: the checkpoint the export was made with and the exact config used
(image size, crop, backbone) and the precision it embedded in, so a query is embedded exactly like the indexed
collection. A head trained on feature shards gets the backbone their manifest records in front of it
(``eval.features.images``): the query image is embedded as the shards' images were, then by the head.

The index folder goes down once: the index gives the export's record, that record (or the files given) the
config's ``model`` and ``data`` sections (``ddp_rank.eval.settings``), and those the network
(``ddp_rank.eval.eval_model``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from ddp_rank.config import DataConfig
from ddp_rank.data.reading.transforms import transform_from_config
from ddp_rank.eval.embed import autocast
from ddp_rank.eval.eval_model import build_eval_model, feature_shards, images_in_front
from ddp_rank.eval.settings import index_settings
from ddp_rank.eval.sources import open_image, pil_batch
from ddp_rank.eval.vector_index import SearchIndex
from ddp_rank.runtime.accelerator import precision_dtype

__all__ = ["Hit", "Searcher"]


@dataclass(frozen=True)
class Hit:
    """One result: the indexed item's key, its inner-product score (cosine similarity), label and category."""

    key: str
    score: float
    label: int
    category: str


class Searcher:
    """``Searcher.from_index("runs/demo/index").search_files(["query.jpg"], k=5)`` -> ``[[Hit, ...]]``."""

    def __init__(
        self,
        model: nn.Module,
        data: DataConfig,
        index: SearchIndex,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        """``data``: the ``data`` section the indexed images were read with (their transform and pixel limit)."""
        self.model = model.to(device).eval()
        self.data = data
        self.index = index
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.transform = transform_from_config(data)

    @classmethod
    def from_index(
        cls,
        index_dir: str | os.PathLike[str],
        checkpoint: str | None = None,
        config: str | None = None,
        device: torch.device | str | None = None,
        max_pixels: int | None = None,
    ) -> Searcher:
        """Load the index and the model it was exported with (or ``checkpoint`` / ``config`` if given);
        ``max_pixels`` replaces the config's ``data.max_image_pixels`` for the query images."""
        index = SearchIndex.load(index_dir)
        export = index.info.get("export", {})
        checkpoint = checkpoint or export.get("checkpoint")
        model_cfg, data = index_settings(export, f"{index_dir}/index.json", config, checkpoint)
        manifest = feature_shards(model_cfg, data)
        model, _ = build_eval_model(model_cfg, data.image_size, manifest, checkpoint, None)
        model, data = images_in_front(model, data, manifest)  # queries are images: a feature head's backbone
        if max_pixels is not None:
            data = data.replaced(max_image_pixels=max_pixels)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = precision_dtype(export.get("mixed_precision", "no"))
        searcher = cls(model, data, index, device, autocast_dtype=dtype)
        probe = searcher.embed([Image.new("RGB", (data.image_size,) * 2)])
        if probe.shape[1] != index.items.dim:
            raise ValueError(
                f"the model embeds into {probe.shape[1]} dimensions but the index holds {index.items.dim}: pass the "
                "checkpoint and config the export was made with"
            )
        return searcher

    @torch.no_grad()
    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        """``[len(images), d]`` float32 embeddings (the test-time transform of the export)."""
        batch = pil_batch(images, self.transform).to(self.device)
        with autocast(self.device, self.autocast_dtype):
            return self.model(batch).float().cpu().numpy()

    def search(self, images: Sequence[Image.Image], k: int = 5) -> list[list[Hit]]:
        """The top-``k`` indexed items of each image, best first."""
        scores, rows = self.index.search(self.embed(images), k)
        items = self.index.items
        return [
            [
                Hit(str(items.keys[r]), float(s), int(items.labels[r]), str(items.categories[r]))
                for s, r in zip(score_row, row)
                if r >= 0
            ]
            for score_row, row in zip(scores, rows)
        ]

    def open_files(
        self, paths: Sequence[str | os.PathLike[str]], skipped: list[str] | None = None
    ) -> tuple[list[Path], list[Image.Image]]:
        """The query files that decode (as the export decoded its images, within its pixel limit) and their
        images. A file that does not decode raises ``SourceError`` naming it, or with a ``skipped`` list is
        recorded there (``path: why``) and left out."""
        kept, images = [], []
        for p in paths:
            image = open_image(Path(p), self.transform, skipped)
            if image is not None:
                kept.append(Path(p))
                images.append(image)
        return kept, images

    def search_files(self, paths: Sequence[str | os.PathLike[str]], k: int = 5) -> list[list[Hit]]:
        """:meth:`search` for image files (a file that does not decode: ``SourceError`` naming it)."""
        return self.search(self.open_files(paths)[1], k)
