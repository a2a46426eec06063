"""The retrieval picture: one row per query, the query then its nearest neighbours, each neighbour framed green
when it shares the query's class and red when it does not.

This module only draws: it takes rows of :class:`Cell` (a thumbnail, whether it matches, a caption) and knows
nothing of shards, runs or the command line (``ddp_rank.eval.retrieval_record`` finds the cells). The layout is
fixed arithmetic (:class:`GridLayout`), so a test can compute where each frame lies and read its colour back, and
the PNG is written without timestamps or any other varying chunk: the same cells give the same bytes.

Several result lists of the same queries (``ddp-rank compare --grid``: one per run) are drawn as blocks side by
side, the query once at the left of its row, a gap between the blocks. Under the rows a legend says what the
frames and the captions mean (:class:`LegendEntry`, chosen by the caller: a search compares with its top hit).

Captions are the user's names (a class name, a source file) as long as they come; :func:`caption_lines` and
:func:`legend_rows` shorten them to what fits, with ``..`` in the middle (the start and the end of a name are the
parts that tell ``014.Indigo_Bunting`` from ``015.Lazuli_Bunting`` and ``..._0021.jpg`` from ``..._0022.jpg``).
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
    "LegendEntry",
    "caption_lines",
    "draw_grid",
    "frame_colour",
    "legend_rows",
    "save_png",
    "shorten",
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
    another, None: no class known) and the ``caption`` written under it, one line per ``\n`` (a score, a class
    name, a file), shortened to fit when drawn (:func:`caption_lines`)."""

    image: Image.Image | None
    match: bool | None
    caption: str = ""


@dataclass(frozen=True)
class LegendEntry:
    """One item of the legend under the picture: a frame ``colour`` (None: a note without a swatch) and what it
    means."""

    colour: tuple[int, int, int] | None
    text: str


def shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: kept whole when it fits, else its start and end around ``..``."""
    if len(text) <= width:
        return text
    if width <= 2:
        return text[:width]
    head = (width - 2) // 2
    return f"{text[:head]}..{text[len(text) - (width - 2 - head) :]}"


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
    line: int = 12
    """Height of one line of text (PIL's bitmap font is 11 pixels high, 6 wide)."""
    caption_lines: int = 2
    """Lines of caption under a cell: the score or the class, then the class or the file."""
    block_gap: int = 24
    """Extra space between two result blocks (two runs)."""
    char: int = 6
    """Width of one character of the font."""

    @property
    def cell(self) -> int:
        """Side of a framed cell."""
        return self.thumb + 2 * self.frame

    @property
    def caption(self) -> int:
        """Height of the caption lines under a cell."""
        return self.caption_lines * self.line + 2

    @property
    def caption_chars(self) -> int:
        """Characters of a caption line: a cell and the gap after it."""
        return (self.cell + self.gap) // self.char

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

    def size(self, rows: int, blocks: int, k: int, legend_rows: int = 0) -> tuple[int, int]:
        """(width, height) of a picture of ``rows`` queries with a legend of ``legend_rows`` lines under them."""
        step = self.cell + self.gap
        width = self.gap + step + blocks * k * step + (blocks - 1) * self.block_gap
        legend = legend_rows * self.line + self.gap if legend_rows else 0
        return width, self.gap + rows * self.row_height + legend


def caption_lines(cell: Cell, layout: GridLayout | None = None) -> list[str]:
    """The lines drawn under ``cell``: its caption's lines, each shortened to the cell's width, at most
    ``layout.caption_lines`` of them."""
    layout = layout or GridLayout()
    lines = cell.caption.split("\n") if cell.caption else []
    return [shorten(line, layout.caption_chars) for line in lines[: layout.caption_lines]]


_SWATCH_TEXT = 2
"""Characters' width taken by a legend swatch and the space after it."""


def legend_rows(
    entries: Sequence[LegendEntry], width: int, layout: GridLayout | None = None
) -> list[list[LegendEntry]]:
    """``entries`` flowed into lines of a ``width``-pixel picture (each text shortened to fit a line alone), in
    order: the legend as drawn under the rows."""
    layout = layout or GridLayout()
    room = max(1, (width - 2 * layout.gap) // layout.char)
    rows: list[list[LegendEntry]] = []
    used = room
    for entry in entries:
        own = max(1, room - (_SWATCH_TEXT if entry.colour is not None else 0))
        fitted = LegendEntry(entry.colour, shorten(entry.text, own))
        need = len(fitted.text) + (_SWATCH_TEXT if entry.colour is not None else 0)
        if rows and used + 3 + need <= room:
            rows[-1].append(fitted)
            used += 3 + need
        else:
            rows.append([fitted])
            used = need
    return rows


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
    legend: Sequence[LegendEntry] = (),
) -> Image.Image:
    """The picture of ``queries`` (one per row) and ``results[block][row]``: the neighbours of that row's query
    in each result block (one block per run), best first, and ``legend`` under the rows. Rows with fewer
    neighbours leave their cells blank."""
    layout = layout or GridLayout()
    if not queries:
        raise ValueError("a retrieval picture needs at least one query")
    if not results or any(len(block) != len(queries) for block in results):
        raise ValueError("each result block needs one list of neighbours per query")
    k = max(1, max(len(neighbours) for block in results for neighbours in block))
    width, _ = layout.size(len(queries), len(results), k)
    lines = legend_rows(legend, width, layout)
    picture = Image.new("RGB", layout.size(len(queries), len(results), k, len(lines)), BACKGROUND)
    draw = ImageDraw.Draw(picture)
    for row, query in enumerate(queries):
        _draw_cell(picture, draw, layout, layout.cell_origin(row, 0, 0, k), query, QUERY_BLUE)
        for block, rows in enumerate(results):
            for column, cell in enumerate(rows[row], start=1):
                origin = layout.cell_origin(row, block, column, k)
                _draw_cell(picture, draw, layout, origin, cell, frame_colour(cell.match))
    top = layout.gap + len(queries) * layout.row_height
    for number, line in enumerate(lines):
        x, y = layout.gap, top + number * layout.line
        for entry in line:
            if entry.colour is not None:
                side = layout.line - 3
                draw.rectangle([x, y + 1, x + side - 1, y + side], fill=entry.colour)
                x += _SWATCH_TEXT * layout.char
            draw.text((x, y), entry.text, fill=(0, 0, 0), font=_FONT)
            x += (len(entry.text) + 3) * layout.char
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
    for number, line in enumerate(caption_lines(cell, layout)):
        # PIL's built-in bitmap font: no font file, the same pixels on every machine.
        draw.text((x, y + layout.cell + 1 + number * layout.line), line, fill=(0, 0, 0), font=_FONT)


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
