"""Count the places a loss call brings a value to the host, on CPU.

On CPU nothing waits, but every call below makes a CUDA stream wait for the GPU (a value the host reads, a
data-dependent output size, a host value copied in from pageable memory), so counting them on CPU tells how
many synchronisations the same call makes on a GPU. A ``TorchFunctionMode`` sees every torch function and
``Tensor`` method, dunder conversions included, before it runs.

(The chunked step's tests have their own counter, ``tests/helpers/host_syncs.py``; this one stays beside the
losses' tests until the two are merged.)
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.Tensor.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    torch.unique: "unique",
    torch.unique_consecutive: "unique",
    torch.Tensor.unique: "unique",
    torch.Tensor.unique_consecutive: "unique",
    torch.equal: "equal",
    torch.Tensor.equal: "equal",
    torch.allclose: "allclose",
    torch.is_nonzero: "bool",
}
"""Calls that read a value on the host, or whose output size depends on the values (a sync on CUDA)."""


def _holds_bool_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _sync_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    kind = _READS.get(func)
    if kind is not None:
        return kind
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _holds_bool_mask(args[1]):
        return "boolean indexing"  # nonzero on the mask first
    if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
        return "torch.tensor(..., device=...)"  # a host value copied in (pageable memory: a sync)
    if func is torch.Tensor.to and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device"))):
        return "to cpu"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "nonzero"
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs:
        return "repeat_interleave" if isinstance(repeats, torch.Tensor) else None
    return None


def _is_cpu(device: Any) -> bool:
    return (isinstance(device, str) and device.startswith("cpu")) or (
        isinstance(device, torch.device) and device.type == "cpu"
    )


def _where() -> str:
    """The innermost frame of the project's own code (or of the caller) that made the call."""
    frames = traceback.extract_stack()[:-2]  # less this function and __torch_function__
    for frame in reversed(frames):
        if "/ddp_rank/" in frame.filename:
            return f"{frame.filename.split('/ddp_rank/')[-1]}:{frame.lineno} ({frame.name})"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: ...``; then ``syncs.count`` and ``syncs.places`` (a Counter of
    ``"kind at file:line (function)"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.places: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.places.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _sync_kind(func, args, kwargs)
        if kind is not None:
            self.places[f"{kind} at {_where()}"] += 1
        return func(*args, **kwargs)
