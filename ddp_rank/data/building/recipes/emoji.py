"""The emoji demo set: one class per emoji, one image per vendor, category from ``emoji.json``.

Artwork comes from npm packages fetched with ``npm pack`` (the only network access, through the npm registry):
``emoji-datasource-google`` and ``emoji-datasource-twitter`` (64 px PNGs plus ``emoji.json`` with each emoji's
category, 10 of them) and ``openmoji`` (colour and black SVGs, rendered to PNG with cairosvg). About 1,900 classes
with four images each: a small, SOP-like few-shot set (hard negatives are emoji of the same category). The
tarballs and renders are cached, so a second run is offline. Splits are by class (seeded, stratified by
category), like SOP's disjoint train / test classes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ddp_rank.data.building.listing import ListingError, Record, assign_splits
from ddp_rank.data.building.recipes import npm

PACKAGES: dict[str, tuple[str, str]] = {
    "google": ("emoji-datasource-google", "16.0.0"),
    "twitter": ("emoji-datasource-twitter", "16.0.0"),
    "openmoji": ("openmoji", "17.0.0"),
}
"""Pinned versions (tested): npm name and version per source."""
VENDORS: tuple[str, ...] = ("google", "twitter", "openmoji-color", "openmoji-black")
_WANTED_PREFIXES = (
    "package/emoji.json",
    "package/img/google/64/",
    "package/img/twitter/64/",
    "package/color/svg/",
    "package/black/svg/",
)


def fetch(cache: Path, package: str, version: str) -> Path:
    """``npm pack`` the package into ``cache`` (once) and unpack what the recipe reads; returns ``.../package``."""
    return npm.fetch(cache, package, version, _WANTED_PREFIXES)


def render_svg(svg: str, png: str, size: int) -> None:
    """Render one SVG to a ``size`` px PNG, written atomically (module level for worker processes)."""
    try:
        import cairosvg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ListingError(
            "the openmoji images need cairosvg: pip install cairosvg (libcairo2 must be installed)"
        ) from exc
    tmp = f"{png}.partial"
    cairosvg.svg2png(url=svg, write_to=tmp, output_width=size, output_height=size)
    os.replace(tmp, png)


def _svg_for(folder: Path, emoji: dict[str, Any]) -> Path | None:
    for code in (emoji["unified"], emoji.get("non_qualified")):
        if code and (folder / f"{code.upper()}.svg").is_file():
            return folder / f"{code.upper()}.svg"
    return None


def records(
    root: str | os.PathLike[str],
    size: int = 64,
    test_fraction: float = 0.5,
    seed: int = 0,
    workers: int | None = None,
    vendors: Sequence[str] = VENDORS,
) -> list[Record]:
    """Fetch (if needed), render the SVGs and list every emoji's images; ``root`` is the cache directory."""
    unknown = set(vendors) - set(VENDORS)
    if unknown:
        raise ListingError(f"unknown vendor(s) {sorted(unknown)}; choose from {list(VENDORS)}")
    cache = Path(root)
    packages = {k: fetch(cache, *v) for k, v in PACKAGES.items() if any(x.startswith(k) for x in vendors)}
    index = packages.get("google") or packages.get("twitter") or fetch(cache, *PACKAGES["google"])
    emojis = sorted(
        json.loads((index / "emoji.json").read_text(encoding="utf-8")),
        key=lambda e: (e.get("sort_order", 0), e["unified"]),
    )
    out: list[Record] = []
    jobs: list[tuple[str, str]] = []
    for emoji in emojis:
        for vendor in vendors:
            path = _vendor_image(cache, packages, vendor, emoji, size, jobs)
            if path is not None:
                out.append(Record(path=str(path), cls=emoji["unified"].lower(), category=emoji["category"]))
    _render_all(jobs, size, workers)
    return assign_splits(out, test_fraction, seed)


def _vendor_image(
    cache: Path,
    packages: dict[str, Path],
    vendor: str,
    emoji: dict[str, Any],
    size: int,
    jobs: list[tuple[str, str]],
) -> Path | None:
    if vendor in ("google", "twitter"):
        png = packages[vendor] / "img" / vendor / "64" / emoji["image"]
        return png if png.is_file() else None
    style = vendor.split("-")[1]
    svg = _svg_for(packages["openmoji"] / style / "svg", emoji)
    if svg is None:
        return None
    png = cache / f"render-{size}" / vendor / f"{emoji['unified'].lower()}.png"
    if not png.is_file():
        jobs.append((str(svg), str(png)))
    return png


def _render_all(jobs: list[tuple[str, str]], size: int, workers: int | None) -> None:
    if not jobs:
        return
    for _, png in jobs:
        Path(png).parent.mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    render = partial(render_svg, size=size)
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            list(pool.map(render, *zip(*jobs), chunksize=64))
    else:
        for svg, png in jobs:
            render(svg, png)
