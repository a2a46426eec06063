"""A package's public names loaded on first use, from one table of where each is defined.

``ddp_rank.data``, ``ddp_rank.model`` and ``ddp_rank.eval`` re-export names of their modules without importing
them: the shard tools must not pay for torch, an export reader for faiss, and ``model`` would otherwise import
its head half-defined (each package's docstring says why). A package hands its table to :func:`lazy_exports` and
takes the module ``__getattr__`` and ``__dir__`` it returns (PEP 562).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names are ``exports``' keys, each defined in the
    module it maps to: a name is imported on first use and then kept in the package, so later lookups do not
    come back here; ``dir()`` (and tab completion) lists the names not loaded yet."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
