"""Deliberately naive, loop-based definitions of the losses, differentiated by autograd.

They follow the papers' formulas term by term (O(N^3) for the rank losses) and share no code with
ddp_rank.losses, so agreement with them checks the chunked, closed-form implementation independently.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _prepare(x: Tensor, normalize: bool) -> Tensor:
    return torch.nn.functional.normalize(x, dim=1) if normalize else x


def fastap(x: Tensor, y: Tensor, num_bins: int = 10, normalize: bool = True) -> Tensor:
    x = _prepare(x, normalize)
    n = x.shape[0]
    delta = 4.0 / num_bins
    centres = torch.linspace(0, 4, num_bins + 1, dtype=x.dtype)
    aps = []
    for a in range(n):
        pos = [j for j in range(n) if j != a and y[j] == y[a]]
        if not pos:
            continue
        d = 2 - 2 * x @ x[a]
        kernel = torch.relu(1 - (d[None, :] - centres[:, None]).abs() / delta)  # [L, N]
        is_pos = torch.tensor([j in pos for j in range(n)], dtype=x.dtype)
        is_neg = torch.tensor([y[j] != y[a] for j in range(n)], dtype=x.dtype)
        h_pos, h = kernel @ is_pos, kernel @ (is_pos + is_neg)
        H_pos, H = torch.cumsum(h_pos, 0), torch.cumsum(h, 0)
        terms = torch.where(
            H > 0, h_pos * H_pos / torch.where(H > 0, H, torch.ones_like(H)), torch.zeros_like(H)
        )
        aps.append(terms.sum() / len(pos))
    return 1 - torch.stack(aps).mean() if aps else x.sum() * 0


def _sig(u: Tensor, tau: float) -> Tensor:
    return torch.sigmoid(u / tau)


def pnp(
    x: Tensor,
    y: Tensor,
    variant: str,
    tau: float = 0.01,
    b: float = 2.0,
    alpha: float = 1.0,
    count_self: bool = True,
    normalize: bool = True,
) -> Tensor:
    x = _prepare(x, normalize)
    s = x @ x.T
    n = x.shape[0]
    per_query = []
    for a in range(n):
        others = [i for i in range(n) if i != a and y[i] == y[a]]
        if not others:
            continue
        positives = [*others, a] if count_self else others
        negatives = [j for j in range(n) if y[j] != y[a]]
        terms = []
        for i in positives:
            r = sum((_sig(s[a, j] - s[a, i], tau) for j in negatives), s.new_zeros(()))
            terms.append(
                {
                    "O": r,
                    "Iu": (1 + r) * torch.log(1 + r),
                    "Ib": (b * r - torch.log(1 + b * r)) / b**2,
                    "Ds": torch.log(1 + r),
                    "Dq": -((1 + r) ** -alpha),
                }[variant]
            )
        per_query.append(torch.stack(terms).mean())
    if not per_query:
        return x.sum() * 0
    loss = torch.stack(per_query).mean()
    return 1 + loss if variant == "Dq" else loss


def smooth_ap(
    x: Tensor, y: Tensor, tau: float = 0.01, count_self: bool = True, normalize: bool = True
) -> Tensor:
    x = _prepare(x, normalize)
    s = x @ x.T
    n = x.shape[0]
    aps = []
    for a in range(n):
        ranked = [j for j in range(n) if count_self or j != a]
        positives = [j for j in ranked if y[j] == y[a]]
        if not positives:
            continue
        terms = []
        for i in positives:
            rank_pos = 1 + sum((_sig(s[a, j] - s[a, i], tau) for j in positives if j != i), s.new_zeros(()))
            rank_all = 1 + sum((_sig(s[a, j] - s[a, i], tau) for j in ranked if j != i), s.new_zeros(()))
            terms.append(rank_pos / rank_all)
        aps.append(torch.stack(terms).mean())
    return 1 - torch.stack(aps).mean() if aps else x.sum() * 0
