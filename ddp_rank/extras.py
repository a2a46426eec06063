"""How to install an optional extra, worded once for every message and help text that names one.

ddp_rank is not on a package index: it installs from a clone, with the versions CI tests
(``constraints.txt``), into ``.venv`` by ``make install`` or into an environment of the user's own by pip
(``docs/install.md``). A message naming the package as if an index had it would send its reader nowhere.
"""

from __future__ import annotations

__all__ = ["INSTALL_PAGE", "install_hint"]

INSTALL_PAGE = "docs/install.md"
"""The page that shows both ways to install, and what each extra brings."""


def install_hint(*extras: str) -> str:
    """The command that adds ``extras`` to the environment, run in a clone of ddp_rank, e.g.
    ``pip install -c constraints.txt -e ".[pml]" (in your clone of ddp_rank; docs/install.md)``."""
    if not extras:
        raise ValueError("install_hint needs at least one extra")
    return f'pip install -c constraints.txt -e ".[{",".join(extras)}]" (in your clone of ddp_rank; {INSTALL_PAGE})'
