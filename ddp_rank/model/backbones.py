"""Pooling choices and timm backbones (ViT, DeiT, DINOv2, ConvNeXt, ...) beside the torchvision ones.

Pooling (``model.pooling``) turns a backbone's last feature map ``[n, C, H, W]`` (CNNs) or its tokens
``[n, T, C]`` (vision transformers, prefix tokens such as the class token left out) into ``[n, C]``:

- ``avg``: the mean over positions; ``max_avg``: max + mean, the sum of global max and average pooling;
- ``gem``: generalised mean ``(mean x^p)^(1/p)`` over positions with a learnable ``p`` (Radenovic et al. 2018),
  features clamped at a small positive value first (it is defined for non-negative activations);
- ``grid``: no pooling, ``[n, H*W*C]``: every position's features side by side. Global pooling forgets where a
  feature lies, which is what tells apart images made of the same parts in another order (the letters of a word:
  on the word set's held-out words, a frozen EfficientNet-Lite0 finds the same word in another font as its top
  neighbour 1.15% of the time with its averaged features, 7.7% with its stride-16 map kept whole;
  ``benchmarks/results/study-features-2026-11-26-findings.md``).

timm models are named ``timm:<model>`` and used without their classifier. With
``pooling=default`` the model's own pooled features are used (class token + final norm for a ViT, average pool
+ head norm for ConvNeXt); otherwise ``forward_features`` and the pooling above. The timm modules that
``forward_features`` never calls (ConvNeXt's head norm) are removed then: their parameters would get no
gradient, which DDP reports as an error.

Weights: ``none`` (random), ``default`` (timm's pretrained weights, downloaded from the Hugging Face hub: only
when asked), or a local file, loaded through timm's own loader so that original checkpoints are converted the way
timm converts them (position embeddings resampled to ``data.image_size``, the classifier dropped).
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from ddp_rank.config import TIMM_PREFIX
from ddp_rank.extras import install_hint

__all__ = ["POOLINGS", "Pooling", "TimmBackbone", "build_timm_backbone", "replace_pooling"]

POOLINGS = ("avg", "max_avg", "gem", "grid")


class Pooling(nn.Module):
    """Global pooling of ``[n, C, H, W]`` feature maps or ``[n, T, C]`` tokens to ``[n, C]`` (``[n, H*W*C]``,
    ``[n, T*C]`` for ``grid``).

    ``prefix_tokens``: leading tokens (class / register tokens) left out of a token sequence.
    ``channels_last``: 4-d inputs are ``[n, H, W, C]`` (timm models whose ``output_fmt`` is NHWC).
    """

    def __init__(
        self, kind: str, prefix_tokens: int = 0, channels_last: bool = False, eps: float = 1e-6
    ) -> None:
        super().__init__()
        if kind not in POOLINGS:
            raise ValueError(f"pooling {kind!r}: valid are {', '.join(POOLINGS)}")
        self.kind = kind
        self.prefix_tokens = prefix_tokens
        self.channels_last = channels_last
        self.eps = eps
        if kind == "gem":
            self.p = nn.Parameter(torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 4:
            x = x.flatten(1, 2) if self.channels_last else x.flatten(2).transpose(1, 2)  # [n, HW, C]
        elif x.ndim == 3:
            x = x[:, self.prefix_tokens :]
        else:
            raise ValueError(f"pooling expects [n, C, H, W] or [n, T, C] features, got {tuple(x.shape)}")
        if self.kind == "grid":
            return x.flatten(1)
        if self.kind == "avg":
            return x.mean(1)
        if self.kind == "max_avg":
            return x.amax(1) + x.mean(1)
        p = self.p.clamp(min=1.0)  # p < 1 would leave the mean-to-max range the pooling is meant to span
        return x.float().clamp(min=self.eps).pow(p).mean(1).pow(1.0 / p).to(x.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, prefix_tokens={self.prefix_tokens}"


def replace_pooling(backbone: nn.Module, kind: str) -> None:
    """Put :class:`Pooling` in place of a torchvision / ddp_rank CNN's global average pool (``avgpool`` or
    ``pool``); ``default`` keeps the backbone's own."""
    if kind == "default":
        return
    for name in ("avgpool", "pool"):
        if hasattr(backbone, name):
            setattr(backbone, name, Pooling(kind))
            return
    raise ValueError(f"{type(backbone).__name__} has no global pooling layer to replace")  # pragma: no cover


class TimmBackbone(nn.Module):
    """A timm model without classifier, pooled as ``pooling`` says; ``out_features`` is its output width."""

    def __init__(self, net: nn.Module, pooling: str, image_size: int) -> None:
        super().__init__()
        self.net = net
        self.pool: Pooling | None = None
        if pooling != "default":
            self.pool = Pooling(
                pooling,
                prefix_tokens=int(getattr(net, "num_prefix_tokens", 0)),
                channels_last=str(getattr(net, "output_fmt", "NCHW")) == "NHWC",
            )
        sample = torch.zeros(1, 3, image_size, image_size)
        if self.pool is not None:
            used = self._children_called(sample)
            for name, child in list(net.named_children()):
                if name not in used and any(True for _ in child.parameters()):
                    setattr(net, name, nn.Identity())
        with torch.no_grad():
            was_training = net.training
            net.eval()
            self.out_features = int(self.forward(sample).shape[-1])
            net.train(was_training)

    def _children_called(self, sample: torch.Tensor) -> set[str]:
        """Names of the top-level modules one forward pass calls."""
        called: set[str] = set()
        hooks = [
            child.register_forward_hook(lambda *_, n=name: called.add(n))
            for name, child in self.net.named_children()
        ]
        try:
            with torch.no_grad():
                was_training = self.net.training
                self.net.eval()
                self.forward(sample)
                self.net.train(was_training)
        finally:
            for h in hooks:
                h.remove()
        return called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is None:
            out: torch.Tensor = self.net(x)
            return out
        features: torch.Tensor = self.net.forward_features(x)  # type: ignore[operator]
        return self.pool(features)


def _create(timm: Any, name: str, image_size: int, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` at ``image_size`` where the model takes one (ViTs); CNNs take any size.

    Pretrained weights are loaded WITH the classifier, then the classifier is removed: timm loads non-strictly
    when ``num_classes`` differs from the weights', so a file of another model would load nothing, silently.
    """
    if not kwargs.get("pretrained"):
        kwargs["num_classes"] = 0
    try:
        net = timm.create_model(name, img_size=image_size, **kwargs)
    except TypeError as exc:
        if "img_size" not in str(exc):
            raise
        net = timm.create_model(name, **kwargs)
    net.reset_classifier(0)
    return net


def build_timm_backbone(
    backbone: str, weights: str, pooling: str, image_size: int, is_path: bool
) -> tuple[TimmBackbone, tuple[float, float, float], tuple[float, float, float]]:
    """(backbone, input mean, input std) for ``model.backbone=timm:<name>``; raises ``ValueError`` with the fix."""
    try:
        import timm
    except ImportError as exc:
        raise ValueError(
            f"model.backbone={backbone} needs the timm package: pip install timm, or {install_hint('models')}"
        ) from exc
    name = backbone[len(TIMM_PREFIX) :].strip()
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.7)
        raise ValueError(
            f"model.backbone={backbone}: timm has no model '{name}'"
            + (f"; similar: {', '.join(close)}" if close else "; see timm.list_models()")
        )
    if weights == "none":
        kwargs: dict[str, Any] = {"pretrained": False}
    elif weights == "default":
        kwargs = {"pretrained": True}
    elif is_path:
        kwargs = {"pretrained": True, "pretrained_cfg_overlay": {"file": weights}}
    else:
        raise ValueError(
            f"model.weights='{weights}' for {backbone}: valid are none, default (timm's pretrained weights from "
            "the Hugging Face hub) or a local file path"
        )
    try:
        net = _create(timm, name, image_size, **kwargs)
    except (OSError, RuntimeError, KeyError) as exc:  # hub download errors, or a file that does not fit
        where = f"the file {weights}" if is_path else "the Hugging Face hub"
        raise ValueError(
            f"could not load the weights of {backbone} from {where} ({exc}); pass model.weights=/path/to/file "
            "(.safetensors / .pth of that model) or model.weights=none"
        ) from exc
    cfg = getattr(net, "pretrained_cfg", {}) or {}
    mean = tuple(float(v) for v in cfg.get("mean", (0.485, 0.456, 0.406)))
    std = tuple(float(v) for v in cfg.get("std", (0.229, 0.224, 0.225)))
    return TimmBackbone(net, pooling, image_size), mean, std  # type: ignore[return-value]
