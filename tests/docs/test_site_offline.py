"""The site works offline: its browser libraries are bundled (docs/hooks/bundled.py) and a page that would load a
file from the network fails the build (docs/hooks/offline.py)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

from docs.hooks import bundled, offline

REPO = Path(__file__).resolve().parents[2]


# The two attributes of an MkDocs page the hooks read.
_PAGE = SimpleNamespace(url="concepts/losses/", file=SimpleNamespace(src_uri="concepts/losses.md"))


@pytest.mark.parametrize(
    ("tag", "seen"),
    [
        ('<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script>', "<script>"),
        ('<link rel="stylesheet" href="//fonts.googleapis.com/css?family=Roboto">', "<link>"),
        ('<link rel="preload" as="font" href="http://x.org/f.woff2">', "<link>"),
        ('<img alt="plot" src="https://example.org/plot.png">', "<img>"),
        ('<img srcset="local.png 1x, https://example.org/big.png 2x">', "<img>"),
        ("<div style=\"background: url('https://example.org/bg.png')\"></div>", "<div style>"),
        ("<style>@import 'https://example.org/theme.css';</style>", "<style>"),
        ('<iframe src="https://www.youtube.com/embed/x"></iframe>', "<iframe>"),
    ],
)
def test_a_remote_script_style_font_or_image_is_found(tag: str, seen: str) -> None:
    found = offline.remote_loads(f"<html><body><p>text</p>{tag}</body></html>")
    assert len(found) == 1 and found[0].startswith(seen), found


def test_links_to_web_pages_and_local_files_load_nothing() -> None:
    page = (
        '<link rel="canonical" href="https://example.org/docs/"><link rel="stylesheet" href="../assets/main.css">'
        '<a href="https://arxiv.org/abs/1234">the paper</a><script src="../javascripts/katex/katex.min.js"></script>'
        '<img src="plot.png"><div style="background: url(data:image/png;base64,AAAA)"></div>'
    )
    assert offline.remote_loads(page) == []


def test_a_diagram_needs_the_bundled_mermaid() -> None:
    diagram = '<pre class="mermaid"><code>graph LR; a --> b</code></pre>'
    assert "Mermaid from unpkg.com" in offline.remote_loads(diagram)[0]
    loaded = bundled.with_mermaid(
        f"<body>{diagram}<script src='x.js'></script></body>", "concepts/architecture/"
    )
    assert '<script src="../../javascripts/mermaid/mermaid.min.js"></script>' in loaded
    assert loaded.index("mermaid.min.js") < loaded.index("x.js")  # before Material's bundle looks for it
    assert offline.remote_loads(loaded) == []
    assert bundled.with_mermaid("<body><p>no diagram</p></body>", "") == "<body><p>no diagram</p></body>"
    assert 'src="javascripts/mermaid/mermaid.min.js"' in bundled.with_mermaid(f"<body>{diagram}</body>", "")


def test_the_build_fails_on_a_page_that_loads_from_the_network() -> None:
    page = '<head><script src="https://cdn.jsdelivr.net/npm/katex/dist/katex.min.js"></script></head>'
    with pytest.raises(
        PluginError, match=r"^concepts/losses.md loads from the network: <script> https://cdn"
    ):
        offline.on_post_page(page, _PAGE, {})
    assert offline.on_post_page("<p>fine</p>", _PAGE, {}) == "<p>fine</p>"


def test_the_build_fails_on_a_stylesheet_that_imports_a_remote_font(tmp_path: Path) -> None:
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "ok.css").write_text("@font-face { src: url(fonts/KaTeX_Main.woff2) }")
    offline.on_post_build({"site_dir": str(tmp_path)})
    (tmp_path / "assets" / "bad.css").write_text(
        '@import url("https://fonts.googleapis.com/css?family=Roboto");'
    )
    with pytest.raises(PluginError, match=re.escape("assets/bad.css: https://fonts.googleapis.com")):
        offline.on_post_build({"site_dir": str(tmp_path)})


def _fake_node_modules(base: Path) -> Path:
    for package, folder, names in bundled.LIBRARIES.values():
        for name in names:
            path = base / "node_modules" / package / folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("//")
    fonts = base / "node_modules" / "katex" / "dist" / "fonts"
    fonts.mkdir()
    (fonts / "KaTeX_Main-Regular.woff2").write_bytes(b"")
    return base / "node_modules"


def test_the_libraries_files_and_fonts_go_into_the_site(tmp_path: Path) -> None:
    modules = _fake_node_modules(tmp_path)
    assert bundled.node_modules(tmp_path) == modules
    assert set(bundled.site_files(modules)) == {
        "javascripts/katex/katex.min.js",
        "javascripts/katex/katex.min.css",
        "javascripts/katex/contrib/auto-render.min.js",
        "javascripts/katex/fonts/KaTeX_Main-Regular.woff2",
        "javascripts/mermaid/mermaid.min.js",
    }


def test_a_missing_install_is_one_line_naming_make_docs(tmp_path: Path) -> None:
    with pytest.raises(bundled.BundleError) as caught:
        bundled.node_modules(tmp_path / "nowhere")
    message = str(caught.value)
    assert "\n" not in message and "katex/dist/katex.min.js" in message and "run `make docs`" in message


def test_the_config_loads_the_bundled_files_and_no_cdn() -> None:
    text = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    extra = re.search(r"^extra_javascript:\n((?:  - .*\n)+)extra_css:\n((?:  - .*\n)+)", text, re.MULTILINE)
    assert extra, "mkdocs.yml: extra_javascript and extra_css are not where the test reads them"
    listed = re.findall(r"  - (\S+)", extra[1] + extra[2])
    assert not [path for path in listed if offline.is_remote(path)]
    bundle = {f"{folder}/{name}" for folder, (_, _, names) in bundled.LIBRARIES.items() for name in names}
    assert {"javascripts/katex/katex.min.js", "javascripts/katex/katex.min.css"} <= set(listed)
    assert all(path in bundle or (REPO / "docs" / path).is_file() for path in listed), listed
    assert "cdn." not in text and "unpkg" not in text


def test_the_lock_pins_exactly_what_package_json_asks() -> None:
    wanted = json.loads((REPO / "docs" / "package.json").read_text())["dependencies"]
    lock = json.loads((REPO / "docs" / "package-lock.json").read_text())
    assert lock["packages"][""]["dependencies"] == wanted
    for package, version in wanted.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), (
            f"docs/package.json: {package} {version} is not pinned"
        )
        assert lock["packages"][f"node_modules/{package}"]["version"] == version


def _installed() -> Path | None:
    try:
        return bundled.node_modules()
    except bundled.BundleError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(
    _installed() is None, reason="the site's npm packages are not installed: run `make docs` once"
)
def test_the_built_site_draws_its_formulas_with_the_bundled_katex(tmp_path: Path) -> None:
    """Builds the site (not --strict: pages in progress elsewhere must not hide this check; the hooks' own
    failures abort any build), then renders every formula of it with the bundled KaTeX under node."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--no-strict", "--quiet", "--site-dir", str(site)]
    done = subprocess.run(build, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = (site / "concepts" / "losses" / "index.html").read_text(encoding="utf-8")
    assert '<script src="../../javascripts/katex/katex.min.js"></script>' in losses
    assert (site / "javascripts" / "katex" / "katex.min.js").is_file()
    formulas = [
        (html.unescape(m[1]).strip(), m[0] == "div")
        for page in site.rglob("*.html")
        for m in re.findall(
            r'<(span|div) class="arithmatex">(.*?)</\1>', page.read_text(encoding="utf-8"), re.S
        )
    ]
    assert len(formulas) > 20
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the formulas were found, not rendered")
    script = (
        "const katex = require(process.argv[1]); let bad = [];"
        "for (const [tex, display] of JSON.parse(require('fs').readFileSync(0, 'utf8'))) {"
        "  try { katex.renderToString(tex.slice(2, -2), {displayMode: display, throwOnError: true}); }"
        "  catch (e) { bad.push(tex.slice(0, 80) + ': ' + e.message.slice(0, 120)); } }"
        "console.log(JSON.stringify(bad));"
    )
    katex = str(bundled.node_modules() / "katex")
    rendered = subprocess.run(
        ["node", "-e", script, katex], input=json.dumps(formulas), capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    assert json.loads(rendered.stdout) == [], "formulas KaTeX cannot draw"
