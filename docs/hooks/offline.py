"""MkDocs hook: the strict build fails if a page would load anything from the network.

Why: the site is read on clusters without network, where a script, stylesheet, font or image fetched from a
CDN silently breaks the page (raw TeX instead of formulas, missing styles). Every page's HTML is scanned after
it is rendered, and every stylesheet of the site after the build, for resources with an ``http(s)://`` or
``//`` address: ``<script src>``, ``<link href>`` of a stylesheet, icon, font or preload, ``<img>``,
``<source>``, ``<video>``, ``<audio>``, ``<iframe>``, ``<embed>``, ``<object>``, and ``url()`` / ``@import``
in styles. A link to another web page (``<a href>``, ``<link rel="canonical">``) loads nothing and is allowed.

One load hides in a script: Material's bundle fetches Mermaid from unpkg.com for a page with a diagram unless the
page has loaded its own first (``docs/hooks/bundled.py``), so a diagram without a bundled Mermaid counts too.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

# <link rel=...> values that make the browser fetch the target.
_LOADING_RELS = frozenset(
    {"stylesheet", "icon", "shortcut", "apple-touch-icon", "preload", "modulepreload", "prefetch", "manifest"}
)
# Tag -> the attributes whose address the browser fetches.
_FETCHED = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "track": ("src",),
    "iframe": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "input": ("src",),
}
_REMOTE = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)
# url(...) and @import "..." in CSS whose address is remote.
_CSS_REMOTE = re.compile(
    r"""(?:url\(\s*['"]?|@import\s+['"])\s*((?:https?:)?//[^'")\s]+)""",
    re.IGNORECASE,
)


def is_remote(address: str) -> bool:
    """``https://x/y.js``, ``http://...`` and protocol-relative ``//x/y.js`` are fetched from the network."""
    return bool(_REMOTE.match(address))


def remote_in_css(css: str) -> list[str]:
    """The remote addresses a stylesheet (or a ``style`` attribute) fetches."""
    return _CSS_REMOTE.findall(css)


class _Scanner(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self.mermaid_loaded = False
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        addresses: list[str] = []
        if tag == "link" and _LOADING_RELS & set(values.get("rel", "").lower().split()):
            addresses.append(values.get("href", ""))
        for name in _FETCHED.get(tag, ()):
            value = values.get(name, "")
            # srcset: "a.png 1x, b.png 2x"
            addresses += (
                [part.split()[0] for part in value.split(",") if part.strip()]
                if name == "srcset"
                else [value]
            )
        self.found += [f"<{tag}> {a.strip()}" for a in addresses if is_remote(a)]
        if tag == "script" and values.get("src", "").endswith("/mermaid.min.js"):
            self.mermaid_loaded = self.mermaid_loaded or not is_remote(values["src"])
        self.found += [f"<{tag} style> {a}" for a in remote_in_css(values.get("style", ""))]
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.found += [f"<style> {a}" for a in remote_in_css(data)]


def remote_loads(html: str) -> list[str]:
    """What a page fetches from the network when viewed, as ``<tag> address``; empty when it loads nothing."""
    scanner = _Scanner()
    scanner.feed(html)
    scanner.close()
    if 'class="mermaid"' in html and not scanner.mermaid_loaded:
        scanner.found.append("a diagram: Material fetches Mermaid from unpkg.com (no bundled mermaid.min.js)")
    return scanner.found


# ---------------------------------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------------------------------


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Fail the build on a page that would load a remote script, stylesheet, font or image."""
    found = remote_loads(output)
    if found:
        from mkdocs.exceptions import PluginError

        raise PluginError(
            f"{page.file.src_uri} loads from the network: {'; '.join(found)}. The site must work offline: "
            "bundle the file into the site (docs/package.json and a hook, as docs/hooks/bundled.py does for KaTeX)"
        )
    return output


def on_post_build(config: Any) -> None:
    """Fail the build on a stylesheet of the site that imports a remote file or font."""
    found = [
        f"{path.relative_to(config['site_dir']).as_posix()}: {address}"
        for path in sorted(Path(config["site_dir"]).rglob("*.css"))
        for address in remote_in_css(path.read_text(encoding="utf-8", errors="replace"))
    ]
    if found:
        from mkdocs.exceptions import PluginError

        raise PluginError(
            f"the site's stylesheets load from the network: {'; '.join(found)}. Bundle the file into the site"
        )
