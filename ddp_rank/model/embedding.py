"""The embedding network every backbone is wrapped in: backbone -> linear head -> L2 normalisation.

Its own module, below both ``net`` (which builds one per configured backbone) and ``feature_head`` (whose
``FeatureHeadNet`` is one without a backbone): ``net.build_model`` builds either, so the class they share sits
beneath them and neither imports the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddp_rank.data.reading.transforms import uint8_to_unit

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class EmbeddingNet(nn.Module):
    """Backbone -> linear embedding head -> (optional) L2 normalisation; input images in [0, 1] or uint8.

    Shapes: ``x [n, 3, H, W]`` (float in [0, 1], or uint8 in 0-255) -> ``e [n, embedding_dim]``, unit rows when
    ``normalize``. After :meth:`use_channels_last` the images are laid out channels-last before the backbone
    (what cuDNN's fastest convolutions take in mixed precision).
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        embedding_dim: int,
        normalize: bool = True,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(feature_dim, embedding_dim)
        self.normalize = normalize
        # Constants, not state: non-persistent so checkpoints hold only learned weights and running stats.
        self.register_buffer("input_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("input_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        self.input_mean: torch.Tensor
        self.input_std: torch.Tensor
        self.channels_last = False
        self._takes_prepared = False

    def use_channels_last(self) -> EmbeddingNet:
        """Lay the weights and every input out channels-last (the trainer does it for CUDA runs)."""
        self.to(memory_format=torch.channels_last)
        self.channels_last = True
        return self

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The images as the backbone takes them: channels-last (after :meth:`use_channels_last`), uint8 turned
        into floats, normalised with the backbone's mean and std, in the weights' dtype for uint8 input.

        :meth:`forward` does this itself; the chunked step calls it once for the whole batch and runs its chunk
        forwards under :meth:`batch_prepared`, so that the work is done once per batch, not once per chunk and
        pass. Element by element, so a slice of the prepared batch is the prepared slice, bit for bit.
        """
        if self.channels_last:  # before the conversion below: on uint8, a quarter of the bytes to move
            x = x.contiguous(memory_format=torch.channels_last)
        if x.dtype == torch.uint8:
            # In float32 whatever the engine's dtype, then in the weights' dtype (DeepSpeed bf16 / fp16 casts
            # the module and uses no autocast); the same float32 values as the data layer's float path.
            x = (uint8_to_unit(x) - self.input_mean.float()) / self.input_std.float()
            return x.to(self.head.weight.dtype)
        return (x - self.input_mean.to(x.dtype)) / self.input_std.to(x.dtype)

    @contextlib.contextmanager
    def batch_prepared(self) -> Iterator[None]:
        """Inside, :meth:`forward` takes what :meth:`prepare_batch` returned (or rows of it) as it is."""
        previous, self._takes_prepared = self._takes_prepared, True
        try:
            yield
        finally:
            self._takes_prepared = previous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._takes_prepared:
            x = self.prepare_batch(x)
        e = self.head(self.backbone(x))
        if self.normalize:
            # float32 norm: in fp16 a small row can underflow to a zero norm.
            e = F.normalize(e.float(), dim=-1)
        return e

    def parameter_groups(self, lr: float, head_lr_mult: float, weight_decay: float) -> list[dict[str, Any]]:
        """Two optimizer groups, backbone at ``lr`` and head at ``lr * head_lr_mult`` (FastAP: 10x)."""
        return [
            {
                "params": [p for p in self.backbone.parameters() if p.requires_grad],
                "lr": lr,
                "weight_decay": weight_decay,
                "name": "backbone",
            },
            {
                "params": [p for p in self.head.parameters() if p.requires_grad],
                "lr": lr * head_lr_mult,
                "weight_decay": weight_decay,
                "name": "head",
            },
        ]
