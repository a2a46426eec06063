"""The retrieval picture: one row per query, the query then its nearest neighbours, each neighbour framed green
when it shares the query's class and red when it does not.

This module only draws: it takes rows of :class:`Cell` (a thumbnail, whether it matches, a caption) and knows
nothing of shards, runs or the command line (``ddp_rank.eval.retrieval_record`` finds the cells). The layout is
fixed arithmetic (:class:`GridLayout`), so a test can compute where each frame lies and read its colour back, and
the PNG is written without timestamps or any other varying chunk: the same cells give the same bytes.

Several result lists of the same queries (``ddp-rank compare --grid``: one per run) are drawn as blocks side by
side, the query once at the left of its row, a gap between the blocks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageOps

__all__ = [
    "GREEN",
    "GREY",
    "QUERY_BLUE",
    "RED",
    "Cell",
    "GridLayout",
    "draw_grid",
    "frame_colour",
    "save_png",
    "thumbnail",
]

GREEN = (20, 170, 40)
"""Frame of a neighbour of the query's class."""
RED = (220, 30, 30)
"""Frame of a neighbour of another class."""
GREY = (150, 150, 150)
"""Frame where no class is known to compare (an unlabelled collection)."""
QUERY_BLUE = (40, 90, 220)
"""Frame of the query itself."""
BACKGROUND = (255, 255, 255)
PLACEHOLDER = (225, 225, 225)
"""Fill of a cell whose image could not be read (the frame still says whether it matches)."""


@dataclass(frozen=True)
class Cell:
    """One square of the picture: ``image`` (None: grey placeholder), ``match`` (True: the query's class, False:
    another, None: no class known) and a short ``caption`` written under it (a score, a class)."""

    image: Image.Image | None
    match: bool | None
    caption: str = ""


def frame_colour(match: bool | None) -> tuple[int, int, int]:
    """The frame colour of a neighbour: green (same class), red (another class), grey (unknown)."""
    return GREY if match is None else GREEN if match else RED


@dataclass(frozen=True)
class GridLayout:
    """Pixel sizes of the picture; every position is computed from them (:meth:`cell_origin`)."""

    thumb: int = 96
    """Side of a thumbnail inside its frame."""
    frame: int = 5
    """Width of the coloured frame around a thumbnail."""
    gap: int = 6
    """Space between two cells."""
    caption: int = 14
    """Height of the caption line under a cell."""
    block_gap: int = 24
    """Extra space between two result blocks (two runs)."""

    @property
    def cell(self) -> int:
        """Side of a framed cell."""
        return self.thumb + 2 * self.frame

    @property
    def row_height(self) -> int:
        return self.cell + self.caption + self.gap

    def cell_origin(self, row: int, block: int, column: int, k: int) -> tuple[int, int]:
        """Top-left pixel of a framed cell: ``column`` 0 is the query, 1..k the neighbours of result block
        ``block`` (blocks of ``k`` neighbours each, side by side)."""
        step = self.cell + self.gap
        x = self.gap
        if column:
            x += step + block * (k * step + self.block_gap) + (column - 1) * step
        return x, self.gap + row * self.row_height

    def size(self, rows: int, blocks: int, k: int) -> tuple[int, int]:
        step = self.cell + self.gap
        width = self.gap + step + blocks * k * step + (blocks - 1) * self.block_gap
        return width, self.gap + rows * self.row_height


def thumbnail(image: Image.Image, side: int) -> Image.Image:
    """``image`` scaled to fit a ``side`` square, centred on white (the aspect ratio kept)."""
    fitted = ImageOps.contain(image.convert("RGB"), (side, side), Image.Resampling.BILINEAR)
    square = Image.new("RGB", (side, side), BACKGROUND)
    square.paste(fitted, ((side - fitted.width) // 2, (side - fitted.height) // 2))
    return square


def draw_grid(
    queries: Sequence[Cell],
    results: Sequence[Sequence[Sequence[Cell]]],
    layout: GridLayout | None = None,
) -> Image.Image:
    """The picture of ``queries`` (one per row) and ``results[block][row]``: the neighbours of that row's query
    in each result block (one block per run), best first. Rows with fewer neighbours leave their cells blank."""
    layout = layout or GridLayout()
    if not queries:
        raise ValueError("a retrieval picture needs at least one query")
    if not results or any(len(block) != len(queries) for block in results):
        raise ValueError("each result block needs one list of neighbours per query")
    k = max(1, max(len(neighbours) for block in results for neighbours in block))
    picture = Image.new("RGB", layout.size(len(queries), len(results), k), BACKGROUND)
    draw = ImageDraw.Draw(picture)
    for row, query in enumerate(queries):
        _draw_cell(picture, draw, layout, layout.cell_origin(row, 0, 0, k), query, QUERY_BLUE)
        for block, rows in enumerate(results):
            for column, cell in enumerate(rows[row], start=1):
                origin = layout.cell_origin(row, block, column, k)
                _draw_cell(picture, draw, layout, origin, cell, frame_colour(cell.match))
    return picture


def _draw_cell(
    picture: Image.Image,
    draw: ImageDraw.ImageDraw,
    layout: GridLayout,
    origin: tuple[int, int],
    cell: Cell,
    colour: tuple[int, int, int],
) -> None:
    x, y = origin
    draw.rectangle([x, y, x + layout.cell - 1, y + layout.cell - 1], fill=colour)
    inner = (x + layout.frame, y + layout.frame)
    if cell.image is None:
        picture.paste(Image.new("RGB", (layout.thumb, layout.thumb), PLACEHOLDER), inner)
    else:
        picture.paste(thumbnail(cell.image, layout.thumb), inner)
    if cell.caption:
        # PIL's built-in bitmap font: no font file, the same pixels on every machine.
        draw.text((x, y + layout.cell + 1), cell.caption[:18], fill=(0, 0, 0), font=_FONT)


_FONT = None
try:  # Pillow >= 10.1 may hand back a FreeType font for load_default(size); the bitmap one is always there.
    from PIL import ImageFont

    _FONT = ImageFont.load_default_imagefont()
except (AttributeError, ImportError, OSError):  # pragma: no cover - older Pillow
    _FONT = None


def save_png(picture: Image.Image, path: str | os.PathLike[str]) -> Path:
    """Write ``picture`` as a PNG with no metadata chunk (no time stamp): the same picture, the same bytes."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    picture.save(tmp, format="PNG", optimize=False, compress_level=6)
    os.replace(tmp, out)
    return out
