"""MkDocs hook: the browser libraries the pages need, copied into the site from the npm registry's packages.

Why bundled: a library loaded from a CDN when a page is viewed breaks the page on a cluster without network (raw
TeX instead of formulas, diagrams left as text). ``docs/package.json`` pins them (``docs/package-lock.json``: each
exact tarball and its digest); ``make docs`` installs them with ``npm ci`` into ``build/docs-node/``
(``DOCS_NODE``), and this hook adds them to the build:

- KaTeX draws the formulas: its script, auto-render extension, stylesheet and fonts go under
  ``javascripts/katex/``, which ``mkdocs.yml``'s ``extra_javascript`` and ``extra_css`` load on every page;
  ``docs/javascripts/katex.js`` renders the ``\\( \\)`` and ``\\[ \\]`` spans ``pymdownx.arithmatex`` writes.
- Mermaid draws the diagrams: Material fetches it from unpkg.com unless the page already defines ``mermaid``, so
  its single-file build is copied to ``javascripts/mermaid/`` and loaded, before Material's own script, by the
  pages that hold a diagram (3.5 MB: not by the others).

Nothing is fetched at build or view time; ``docs/hooks/offline.py`` checks it.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Where ``make docs`` runs ``npm ci``; DDP_RANK_DOCS_NODE names another folder (CI builds beside its export).
DEFAULT_NODE_DIR = REPO / "build" / "docs-node"
# ``{folder in the site: (package, folder in the package, files)}``; KaTeX's stylesheet names its fonts relatively.
LIBRARIES = {
    "javascripts/katex": ("katex", "dist", ("katex.min.js", "katex.min.css", "contrib/auto-render.min.js")),
    "javascripts/mermaid": ("mermaid", "dist", ("mermaid.min.js",)),
}
MERMAID_SCRIPT = "javascripts/mermaid/mermaid.min.js"
# What marks a page with a diagram (pymdownx.superfences' mermaid fence, mkdocs.yml), and the first script that
# loads a file (Material's bundle, which looks for ``mermaid`` when it starts).
DIAGRAM = 'class="mermaid"'
_FIRST_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=", re.IGNORECASE)


class BundleError(Exception):
    """A library the site bundles is not installed where the build looks for it."""


def node_modules(node_dir: str | os.PathLike[str] | None = None) -> Path:
    """The ``node_modules`` folder ``npm ci`` filled, or :class:`BundleError` saying how to fill it."""
    base = Path(node_dir or os.environ.get("DDP_RANK_DOCS_NODE") or DEFAULT_NODE_DIR)
    modules = base / "node_modules"
    missing = [
        f"{package}/{folder}/{name}"
        for package, folder, names in LIBRARIES.values()
        for name in names
        if not (modules / package / folder / name).is_file()
    ]
    if missing:
        raise BundleError(
            f"{modules} lacks {missing[0]}: run `make docs` (npm ci of docs/package.json into {base}), or set "
            "DDP_RANK_DOCS_NODE to a folder where `npm ci` ran on docs/package.json"
        )
    return modules


def site_files(modules: Path) -> dict[str, Path]:
    """``{path in the site: installed file}``: each library's files, and KaTeX's fonts."""
    out = {}
    for site_dir, (package, folder, names) in LIBRARIES.items():
        dist = modules / package / folder
        wanted = [dist / name for name in names]
        if package == "katex":
            wanted += sorted((dist / "fonts").glob("KaTeX_*"))
        out.update({f"{site_dir}/{path.relative_to(dist).as_posix()}": path for path in wanted})
    return out


def with_mermaid(html: str, page_url: str) -> str:
    """A page with a diagram loads the bundled Mermaid before the first script (Material's, which then uses it
    instead of fetching its own); ``page_url`` is the page's address in the site (``concepts/architecture/``)."""
    if DIAGRAM not in html or MERMAID_SCRIPT in html:
        return html
    src = posixpath.relpath(MERMAID_SCRIPT, posixpath.dirname(page_url) or ".")
    first = _FIRST_SCRIPT.search(html)
    at = first.start() if first else html.find("</body>")
    return html[:at] + f'<script src="{src}"></script>\n    ' + html[at:]


# ---------------------------------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add the libraries' files to the build; a missing install fails it in one line."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    try:
        modules = node_modules()
    except BundleError as exc:
        raise PluginError(str(exc)) from None
    for uri, path in site_files(modules).items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Load the bundled Mermaid on a page with a diagram."""
    return with_mermaid(output, page.url)
