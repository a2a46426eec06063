"""``loss.name=pml:<Loss>(...)`` and ``loss.miner=pml:<Miner>(...)``: pytorch-metric-learning in the trainer.

pytorch-metric-learning stays an optional extra (``pml``, docs/install.md): it is imported here, only when
a config names one of its classes. The loss goes global through ``GlobalBatchLoss``'s generic path (the whole
loss on the gathered batch on every rank); a proxy loss's parameters join the optimizer (see ``Trainer``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from ddp_rank.config import ConfigError
from ddp_rank.config.call_spec import PML_PREFIX, CallSpec, parse_call
from ddp_rank.config.checks import _suggest
from ddp_rank.extras import install_hint

__all__ = ["PML_PREFIX", "PmlParts", "build_pml", "generic_work_space"]

GENERIC_MATRICES = 8
"""How many float32 ``[N, N]`` matrices a pair/tuple loss is assumed to hold on the gathered batch (distances,
masks, per-pair losses): an estimate for the chunk choice, since the library does not say."""

_EXAMPLES = {
    "losses": "pml:ContrastiveLoss(pos_margin=0.0, neg_margin=1.0)",
    "miners": "pml:MultiSimilarityMiner(epsilon=0.1)",
}


@dataclass(frozen=True)
class PmlParts:
    """The built loss and miner (``None``: no miner), and how they were built, for the log."""

    loss: nn.Module
    miner: nn.Module | None
    description: str


def build_pml(name: str, miner_name: str, num_classes: int, embedding_size: int) -> PmlParts:
    """The loss (``loss.name``) and miner (``loss.miner``; empty: none) named. ``num_classes`` and
    ``embedding_size`` default to the shards' class count and ``model.embedding_dim`` for the losses that take
    them (the proxy losses)."""
    defaults = {"num_classes": num_classes, "embedding_size": embedding_size}
    # Both texts parsed before anything is imported or built: a malformed one is refused before either is built.
    loss_spec = parse_call(name, "loss.name", _EXAMPLES["losses"])
    miner_spec = parse_call(miner_name, "loss.miner", _EXAMPLES["miners"]) if miner_name else None
    loss = _build("losses", "loss.name", name, loss_spec, defaults)
    description = "pytorch-metric-learning " + _describe(loss, loss_spec, defaults)
    if miner_spec is None:
        return PmlParts(loss, None, description)
    miner = _build("miners", "loss.miner", miner_name, miner_spec, {})
    return PmlParts(loss, miner, f"{description} with the miner {miner_spec.describe()}")


def generic_work_space(global_batch: int) -> int:
    """Bytes a pytorch-metric-learning loss is assumed to need on one rank (:data:`GENERIC_MATRICES`)."""
    return GENERIC_MATRICES * global_batch * global_batch * 4


def _build(kind: str, key: str, text: str, spec: CallSpec, defaults: dict[str, Any]) -> nn.Module:
    module = _import(kind, key, text)
    base = module.BaseMetricLossFunction if kind == "losses" else module.BaseMiner
    names = sorted(
        n for n, c in vars(module).items() if isinstance(c, type) and issubclass(c, base) and c is not base
    )
    cls = getattr(module, spec.name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(
            f"{key}={text!r}: pytorch-metric-learning has no {'loss' if kind == 'losses' else 'miner'} named {spec.name!r}; valid: "
            f"{', '.join(names)}." + _suggest(spec.name, names)
        )
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted and k not in spec.kwargs} | spec.kwargs
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"{key}={text!r}: {spec.name} refused its arguments {kwargs}: {exc}") from None


def _import(kind: str, key: str, text: str) -> Any:
    try:
        if kind == "losses":
            from pytorch_metric_learning import losses

            return losses
        from pytorch_metric_learning import miners

        return miners
    except ImportError:
        raise ConfigError(
            f"{key}={text!r} needs pytorch-metric-learning, which is not installed: {install_hint('pml')}"
        ) from None


def _describe(loss: nn.Module, spec: CallSpec, defaults: dict[str, Any]) -> str:
    accepted = inspect.signature(type(loss)).parameters
    filled = {k: v for k, v in defaults.items() if k in accepted and k not in spec.kwargs}
    return CallSpec(spec.name, {**spec.kwargs, **filled}).describe()
