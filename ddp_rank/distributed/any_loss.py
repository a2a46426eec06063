"""The generic global-batch path: any loss called as ``loss(embeddings, labels)`` over the batch of all ranks.

The project's listwise losses split by query rows (``global_loss.GlobalBatchLossFunction``: N_local x N per
rank). Any other loss (a pytorch-metric-learning loss, a proxy loss, a user's own) is treated as a black box, so
every rank computes the WHOLE loss on the gathered batch, with autograd only through its own rows:

    E = [e_0.detach(), ..., scale_grad(e_r, c), ..., e_{W-1}.detach()]      [N, d], identical values everywhere
    L = miner-then-loss(E, y)                                               the single-process value, every rank

Gradient convention (the one of ``global_loss``): rank r's embeddings receive ``c * dL/de_r`` with ``c = W`` for
``grad_reduction="mean"`` (DDP and ZeRO average: ``(1/W) sum_r W dL/de_r de_r/dtheta = dL/dtheta``) and ``c = 1``
for ``"sum"``. The loss's OWN parameters (proxies) are a different matter: every rank computes their full
single-process gradient ``dL/dP``, not a share of it, so they must be averaged (or left alone), never summed,
over the ranks; ``GlobalBatchLoss``'s docstring says so.

Why a black box: a pair or tuple loss with a miner depends on the whole batch through the mining and the
reduction (``AvgNonZeroReducer`` divides by the number of non-zero terms of the GLOBAL batch), so no row split is
exact for every loss; computing the whole loss everywhere is, at the cost of N x N work per rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ddp_rank.distributed.collectives import CommCounter, all_reduce_sum, padded_all_gather
from ddp_rank.distributed.process_group import is_distributed, world_size

LossCallable = Callable[..., Tensor]
MinerCallable = Callable[[Tensor, Tensor], Any]

ACCEPTED = (
    "GlobalBatchLoss wraps a loss called as loss(embeddings [n, d], labels [n]) -> 0-d tensor: a ddp_rank "
    "listwise loss (FastAPLoss, PNPLoss, SmoothAPLoss: row-split, memory-linear) or any other module or "
    "function with that call, such as a pytorch-metric-learning loss (the whole loss on the gathered batch); "
    "an optional miner(embeddings, labels) -> indices is then applied to the global batch"
)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by a constant (the reduction convention's c)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def check_wrappable(loss: object, miner: object | None, listwise: bool) -> None:
    """Refuse, when ``GlobalBatchLoss`` is built, what cannot be wrapped; the message says what it accepts."""
    name = type(loss).__name__
    if not callable(loss):
        raise TypeError(f"{ACCEPTED}; got a {name}, which cannot be called")
    if name in ("GlobalBatchLoss", "DistributedLossWrapper"):
        raise TypeError(
            f"{ACCEPTED}; got a {name}, which already spans the ranks (it would gather twice): wrap the plain loss"
        )
    if callable(getattr(loss, "mine", None)) and not callable(getattr(loss, "compute_loss", None)):
        raise TypeError(f"{ACCEPTED}; got the miner {name} as the loss: pass it as miner= beside a loss")
    if not _accepts_positional(loss, 2):
        raise TypeError(f"{ACCEPTED}; {name} cannot be called with two positional arguments")
    if miner is None:
        return
    if listwise:
        raise TypeError(
            f"a miner ({type(miner).__name__}) with the listwise loss {name}: listwise losses rank the whole "
            "batch and take no mined tuples; drop miner= or use a pair/tuple loss"
        )
    if not callable(miner) or not _accepts_positional(miner, 2):
        raise TypeError(
            f"miner must be called as miner(embeddings, labels) -> indices, got a {type(miner).__name__}"
        )
    if not _accepts_positional(loss, 3):
        raise TypeError(
            f"{name} takes no third argument, so it cannot use the miner's indices: loss(embeddings, labels, "
            "indices) is how a miner's output is passed (pytorch-metric-learning's convention)"
        )


def _accepts_positional(fn: object, count: int) -> bool:
    """Whether ``fn(a1, ..., a_count)`` binds (a module is checked through its ``forward``)."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        signature = inspect.signature(target)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return True
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


def loss_signature(loss: object, miner: object | None) -> str:
    """What the ranks compare before the collectives: the classes, their plain hyper-parameters and the shapes
    of the loss's parameters (two ranks with different losses would otherwise mix two functions silently)."""
    parts = [_describe(loss)]
    if miner is not None:
        parts.append("miner " + _describe(miner))
    return "; ".join(parts)


def _describe(obj: object) -> str:
    kind = type(obj)
    plain = (
        {
            k: v
            for k, v in sorted(vars(obj).items())
            if isinstance(v, (bool, int, float, str)) and not k.startswith("_")
        }
        if hasattr(obj, "__dict__")
        else {}
    )
    shapes = [tuple(p.shape) for p in obj.parameters()] if isinstance(obj, nn.Module) else []
    return f"{kind.__module__}.{kind.__qualname__}{plain}{shapes if shapes else ''}"


def gathered_loss(
    loss: LossCallable,
    miner: MinerCallable | None,
    embeddings: Tensor,
    labels: Tensor,
    sizes: tuple[int, ...],
    rank: int,
    label_dtype: torch.dtype,
    grad_scale: float,
    group: Any,
    counter: CommCounter | None,
) -> tuple[Tensor | None, BaseException | None]:
    """The whole loss of the gathered batch on this rank, differentiable through this rank's rows only.

    Returns ``(loss, None)``, or ``(None, exception)`` when the loss raised here; the caller shares that with
    the other ranks so that every rank raises instead of one waiting in the next collective.
    """
    compute = torch.promote_types(embeddings.dtype, torch.float32)  # fp16/bf16 embeddings: float32 loss
    database = padded_all_gather(embeddings.detach(), sizes, group, counter).to(compute)
    database_labels = padded_all_gather(labels.to(label_dtype), sizes, group, counter).long()
    start = sum(sizes[:rank])
    mine = _ScaleGrad.apply(embeddings.to(compute), grad_scale)
    everything = torch.cat([database[:start], mine, database[start + sizes[rank] :]])
    if everything.shape[0] == 0:  # no row on any rank: nothing to rank, a zero that still has a graph
        return mine.sum() * 0.0, None
    try:
        if miner is None:
            value = loss(everything, database_labels)
        else:
            value = loss(everything, database_labels, miner(everything, database_labels))
        if not isinstance(value, Tensor) or value.dim() != 0:
            raise ValueError(f"the loss must return a 0-d tensor, got {getattr(value, 'shape', type(value))}")
    except Exception as exc:  # shared with every rank by the caller, then raised everywhere
        return None, exc
    return value, None


def any_failed(failed: bool, device: torch.device, group: Any, counter: CommCounter | None) -> bool:
    """Collective: whether the loss failed on some rank (one small all-reduce)."""
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    return float(all_reduce_sum(flag, group, counter)) > 0


def average_gradients(parameters: list[nn.Parameter], group: Any = None) -> None:
    """Collective: replace each parameter's gradient by its mean over the ranks (a missing one counts as zero).

    For a loss's own parameters (proxies) kept out of the engine's gradient reduction: every rank computed
    their full gradient on the same global batch, so the mean is that gradient, and it leaves them bitwise
    equal on every rank whatever the order of floating-point sums inside each rank's loss.
    """
    if not parameters or not is_distributed(group):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    flat /= world_size(group)
    for p, piece in zip(parameters, flat.split([g.numel() for g in grads])):
        p.grad = piece.view_as(p).clone()
