"""Count the places where a tensor's value reaches the host: on a GPU each one makes the CPU wait for the stream.

On a CPU-only machine nothing synchronises, but the same calls would on a GPU, so a CPU test can still hold a
hot loop to "no value read on the host". The tests hold the code to it and the acceptance harness's
``sync_check`` (on CPU) and ``benchmarks.chunk_host`` count with it: it lives here, where both import it, since
the benchmarks never import the tests. ``count_host_syncs()`` records, in the calling thread only (a
``TorchFunctionMode`` lives in thread-local state, so a data reader thread is not counted), every call that:

- reads a value: ``item``, ``bool()``, ``int()``, ``float()``, ``index()`` (``__index__``), ``complex()``,
  ``tolist``, ``numpy``, ``__array__``, formatting a tensor (``repr``, ``str``, ``format``), ``torch.equal``,
  ``allclose``, ``is_nonzero``;
- moves it to the host: ``cpu()``, ``to("cpu")`` / ``to(device="cpu")`` (``to(device)`` with a ``torch.device``
  only when the tensor is not on the CPU already: on a CPU-only run, ``to(run_device)`` moves nothing);
- has an output whose size depends on the values (the host must learn the size): ``nonzero``, ``argwhere``,
  one-argument ``where``, ``masked_select``, ``unique``, ``unique_consecutive``, ``repeat_interleave`` with tensor
  repeats and no ``output_size``, and indexing (read or write) with a boolean tensor;
- builds a device tensor from host values: ``torch.tensor(..., device=...)`` and ``torch.as_tensor`` of a
  non-tensor with a ``device`` (a blocking copy from pageable memory, which waits like a synchronisation).

What it cannot see: reads inside C++ kernels that torch does not route through Python (none of the above are),
and ``torch.cuda.synchronize`` / event waits, which are not torch functions; on a GPU,
``torch.cuda.set_sync_debug_mode("warn")`` is the judge (``benchmarks/acceptance/gpu_check.py --part syncs``).

Use::

    with count_host_syncs() as syncs:
        step()
    assert syncs.total == 1, syncs.report()
    syncs.by_kind()        # Counter({'item': 1})
    syncs.places()         # Counter({'ddp_rank/train/trainer.py:238 in train_step': 1})
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSync", "HostSyncs", "count_host_syncs"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE)))

_READS: dict[Callable[..., Any], str] = {
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.__complex__: "complex",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "numpy",
    torch.Tensor.__repr__: "format",
    torch.Tensor.__format__: "format",
    torch.Tensor.cpu: "cpu",
    torch.equal: "host_value",
    torch.Tensor.equal: "host_value",
    torch.allclose: "host_value",
    torch.Tensor.allclose: "host_value",
    torch.is_nonzero: "host_value",
    torch.Tensor.is_nonzero: "host_value",
    torch.nonzero: "nonzero",
    torch.Tensor.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.Tensor.argwhere: "nonzero",
    torch.masked_select: "nonzero",
    torch.Tensor.masked_select: "nonzero",
    torch.unique: "nonzero",
    torch.Tensor.unique: "nonzero",
    torch.unique_consecutive: "nonzero",
    torch.Tensor.unique_consecutive: "nonzero",
}
_FACTORIES = {torch.tensor: "tensor_from_host", torch.as_tensor: "tensor_from_host"}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_TO = {torch.Tensor.to}
_WHERE = {torch.where, torch.Tensor.where}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}


@dataclass(frozen=True)
class HostSync:
    """One call that brings a value to the host: its kind, the torch function, and where it was called from."""

    kind: str
    name: str
    stack: traceback.StackSummary

    @property
    def place(self) -> str:
        """``path:line in function`` of the innermost caller outside torch and this helper (paths relative to the
        repository when inside it)."""
        for frame in reversed(self.stack):
            path = os.path.abspath(frame.filename)
            if path == _THIS_FILE or path.startswith(_TORCH_DIR):
                continue
            shown = os.path.relpath(path, _REPO) if path.startswith(_REPO) else path
            return f"{shown}:{frame.lineno} in {frame.name}"
        return "<torch>"

    def functions(self) -> set[str]:
        """The names of every function on the stack (to ask whether a call happened inside some loop)."""
        return {frame.name for frame in self.stack}


@dataclass
class HostSyncs:
    """What :func:`count_host_syncs` saw, in call order."""

    events: list[HostSync] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.events)

    def by_kind(self) -> Counter[str]:
        return Counter(e.kind for e in self.events)

    def places(self) -> Counter[str]:
        return Counter(e.place for e in self.events)

    def report(self) -> str:
        """One line per distinct (kind, place) with its count: for an assertion message."""
        lines = Counter((e.kind, e.name, e.place) for e in self.events)
        body = "\n".join(
            f"  {n} x {kind} ({name}) at {place}" for (kind, name, place), n in lines.most_common()
        )
        return f"{self.total} host syncs:\n{body}" if body else "no host syncs"


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _has_bool_tensor(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves a tensor to the host: a device tensor to the CPU, or any
    tensor to the CPU named as the string ``"cpu"`` (code that names the host; a ``torch.device`` held in a
    variable is the run's device, the CPU only on a CPU-only run, where the move is none)."""
    first = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(first, torch.Tensor):  # to(other): other's device
        first = first.device
    if not isinstance(first, (str, torch.device)) or not _is_cpu(first):
        return False
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return isinstance(first, str) or (source is not None and source.device.type != "cpu")


def _kind(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if func in _READS:
        return _READS[func]
    if func in _FACTORIES:
        data = args[0] if args else kwargs.get("data")
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
            return _FACTORIES[func]
        return None
    if func in _INDEXING:
        return "bool_index" if len(args) > 1 and _has_bool_tensor(args[1]) else None
    if func in _TO:
        return "cpu" if _to_cpu(args, kwargs) else None
    if func in _WHERE:
        return "nonzero" if len(args) + len(kwargs) == 1 else None
    if func in _REPEAT:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None and len(args) < 4:
            return "nonzero"
    return None


class _HostSyncMode(TorchFunctionMode):
    """The Python-level net: names each call by what the caller wrote (``item``, ``bool``, ``x[mask]``)."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs
        self.counting = 0  # > 0 while a call counted here runs: the dispatcher net then stays silent

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        self.syncs.events.append(HostSync(kind, name, traceback.extract_stack()[:-1]))
        self.counting += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counting -= 1


_ATEN_KINDS = {
    "_local_scalar_dense": "item",
    "nonzero": "nonzero",
    "argwhere": "nonzero",
    "masked_select": "nonzero",
    "_unique": "nonzero",
    "_unique2": "nonzero",
    "unique_dim": "nonzero",
    "unique_consecutive": "nonzero",
}


def _aten_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    name = func.overloadpacket.__name__
    if name in _ATEN_KINDS:
        return _ATEN_KINDS[name]
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        indices = args[1] if isinstance(args[1], (list, tuple)) else ()
        return "bool_index" if _has_bool_tensor(tuple(i for i in indices if i is not None)) else None
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) == 1:
        return None if kwargs.get("output_size") is not None else "nonzero"
    if name in ("_to_copy", "copy_") and len(args) > 0:
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device")
        if isinstance(source, torch.Tensor) and source.device.type != "cpu" and _is_cpu(target):
            return "cpu"
    return None


class _DispatchNet(TorchDispatchMode):
    """The dispatcher-level net, for what the Python-level one cannot see: the reads of a custom autograd
    Function's backward (the autograd engine runs it without the caller's function modes) and the reads that
    kernels make through the dispatcher (``bincount``'s maximum, for one). Silent while a call the Python net
    counted runs, so that nothing is counted twice."""

    def __init__(self, syncs: HostSyncs, python_net: _HostSyncMode) -> None:
        super().__init__()
        self.syncs = syncs
        self.python_net = python_net

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not self.python_net.counting:
            kind = _aten_kind(func, args, kwargs)
            if kind is not None:
                self.syncs.events.append(
                    HostSync(kind, f"aten.{func.overloadpacket.__name__}", traceback.extract_stack()[:-1])
                )
        return func(*args, **kwargs)


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Record every call of this thread that brings a tensor's value to the host, for the duration."""
    syncs = HostSyncs()
    python_net = _HostSyncMode(syncs)
    with _DispatchNet(syncs, python_net), python_net:
        yield syncs
