"""The network of ``model.backbone=features``: a head only, on vectors a frozen backbone made once.

Feature shards (``data.features.records``) hold one backbone output per image; training on them trains the
embedding head alone, so the loss over the global batch is the whole step. ``FeatureHeadNet`` is an
``EmbeddingNet`` whose backbone is the identity and whose input is ``[n, input_dim]`` float vectors; its head is
linear (``model.head_hidden=0``) or a small MLP (one hidden layer with a ReLU).

``ImageFeatureNet`` puts the recorded backbone back in front of a trained head, so that an image (a ``search``
query, an image folder to export) is embedded exactly as the vectors of the shards were: the backbone the
manifest records, with the weights whose digest it records, in eval mode, in the precision it ran in.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddp_rank.autocast_off import outside_autocast
from ddp_rank.data.reading.transforms import uint8_to_unit
from ddp_rank.model.embedding import EmbeddingNet

__all__ = [
    "FeatureHeadNet",
    "ImageFeatureNet",
    "RawFeatures",
    "build_seeded",
    "image_features",
    "weights_digest",
]


class FeatureHeadNet(EmbeddingNet):
    """``x [n, input_dim]`` (float vectors) -> head -> ``e [n, embedding_dim]``, unit rows when ``normalize``."""

    def __init__(self, input_dim: int, embedding_dim: int, hidden: int = 0, normalize: bool = True) -> None:
        super().__init__(nn.Identity(), input_dim, embedding_dim, normalize)
        self.input_dim = input_dim
        if hidden:
            self.head = nn.Sequential(  # type: ignore[assignment]
                nn.Linear(input_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, embedding_dim)
            )

    def use_channels_last(self) -> FeatureHeadNet:
        """Vectors have no channels: nothing to lay out."""
        return self

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Vectors need no preparation (no image normalisation): the batch as it is."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.input_dim:
            raise ValueError(
                f"model.backbone=features takes [n, {self.input_dim}] vectors, got {tuple(x.shape)}: are "
                "data.shards feature shards (`ddp-rank shards features`)?"
            )
        e = self.head(x.to(_weight_dtype(self.head)) if not torch.is_autocast_enabled() else x)
        if self.normalize:
            e = F.normalize(e.float(), dim=-1)  # float32 norm, as EmbeddingNet
        return e

    def parameter_groups(self, lr: float, head_lr_mult: float, weight_decay: float) -> list[dict[str, Any]]:
        """One group, the head's, at ``lr * head_lr_mult`` (there is no backbone to train)."""
        return [
            {
                "params": [p for p in self.head.parameters() if p.requires_grad],
                "lr": lr * head_lr_mult,
                "weight_decay": weight_decay,
                "name": "head",
            },
        ]


class ImageFeatureNet(nn.Module):
    """A frozen image backbone followed by a feature head: images in, the head's embeddings out. The backbone
    runs under autocast to ``backbone_dtype`` (the precision the shards' vectors were made in) and its output is
    rounded to float16 as the shards store it; whitened shards (``ddp-rank shards whiten``) pass it through
    their map (``whitening``: ``mean [D]`` and ``projection [D, K]``), rounded to float16 again, as stored. The
    head runs as the caller sets it up."""

    whitening_mean: torch.Tensor
    whitening_projection: torch.Tensor

    def __init__(
        self,
        backbone: EmbeddingNet,
        head: FeatureHeadNet,
        backbone_dtype: torch.dtype | None = None,
        whitening: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone.eval()
        self.head = head
        self.backbone_dtype = backbone_dtype
        self.whitened = whitening is not None
        mean, projection = whitening if whitening is not None else (torch.zeros(0), torch.zeros(0, 0))
        self.register_buffer("whitening_mean", mean.float(), persistent=False)
        self.register_buffer("whitening_projection", projection.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cast = (
            torch.autocast(device_type=x.device.type, dtype=self.backbone_dtype)
            if self.backbone_dtype is not None
            else contextlib.nullcontext()
        )
        with cast:
            features = image_features(self.backbone, x)
        stored = features.to(torch.float16).float()
        if self.whitened:  # in float32 as the build computed it, whatever autocast the caller runs under
            with outside_autocast(x.device):
                whitened = (stored - self.whitening_mean) @ self.whitening_projection
            stored = whitened.to(torch.float16).float()
        return self.head(stored)

    def train(self, mode: bool = True) -> ImageFeatureNet:
        """The backbone stays in eval mode: it is frozen."""
        super().train(mode)
        self.backbone.eval()
        return self


class RawFeatures(nn.Module):
    """The vectors of feature shards as they are, L2-normalised: the frozen backbone's own retrieval, the
    baseline a trained head must beat (``ddp-rank eval --baseline raw-pixels`` on feature shards)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.float(), dim=-1)


def image_features(net: EmbeddingNet, x: torch.Tensor) -> torch.Tensor:
    """The backbone output of ``net`` for images ``x`` (uint8 or floats in [0, 1]): its pooled features, before
    the embedding head (what feature shards store)."""
    if net.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x = uint8_to_unit(x) if x.dtype == torch.uint8 else x
    x = (x - net.input_mean.to(x.dtype)) / net.input_std.to(x.dtype)
    return net.backbone(x)


def build_seeded(build: Callable[[], EmbeddingNet], seed: int) -> EmbeddingNet:
    """``build()`` under torch seed ``seed`` (the caller's RNG left as it was): a backbone with random weights
    is the same network each time, so feature shards made with one can still be searched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def weights_digest(module: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of every tensor of ``module``'s state_dict, in order."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _weight_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
