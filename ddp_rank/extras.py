"""How to install an optional extra, worded once for every message and help text that names one; matplotlib's
pyplot imported for every picture with that hint where it is missing, and a finished figure saved.

ddp_rank is not on a package index: it installs from a clone, with the versions CI tests
(``constraints.txt``), into ``.venv`` by ``make install`` or into an environment of the user's own by pip
(``docs/install.md``). A message naming the package as if an index had it would send its reader nowhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["INSTALL_PAGE", "install_hint", "pyplot", "save_figure"]

INSTALL_PAGE = "docs/install.md"
"""The page that shows both ways to install, and what each extra brings."""


def install_hint(*extras: str) -> str:
    """The command that adds ``extras`` to the environment, run in a clone of ddp_rank, e.g.
    ``pip install -c constraints.txt -e ".[pml]" (in your clone of ddp_rank; docs/install.md)``."""
    if not extras:
        raise ValueError("install_hint needs at least one extra")
    return f'pip install -c constraints.txt -e ".[{",".join(extras)}]" (in your clone of ddp_rank; {INSTALL_PAGE})'


def pyplot(picture: str) -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed), to draw ``picture``; an
    ImportError that names ``picture`` and the install command where matplotlib (the ``eval`` extra) is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"{picture} needs matplotlib: {install_hint('eval')}") from exc
    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made), and close it (pyplot keeps open figures)."""
    plt = pyplot(Path(path).name)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
