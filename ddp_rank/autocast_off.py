"""A block with autocast off: for computations that keep their own precision whatever the caller's autocast
(the listwise losses, the whitening map of a feature head's images)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["outside_autocast"]


def outside_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A block where autocast is off for ``device``'s type (nothing to turn off where it has none)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
