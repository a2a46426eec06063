"""What the retrieval pictures and ``ddp-rank search`` say about a sample: the user's class name and source file.

The names come from the data layer (``ddp_rank.data.format.sample_names``: the manifest's class names, the
``source`` each sample's json records) through the readers that fetch the thumbnails; this module only turns
them into text. Where a name is unknown (shards of another tool without names, an image-folder export, a record
written before names were kept) the text falls back to the ids there are: ``class 13``, the sample key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from ddp_rank.eval.retrieval_grid import GREEN, GREY, QUERY_BLUE, RED, LegendEntry

__all__ = [
    "RECORD_LEGEND",
    "SampleName",
    "class_text",
    "file_text",
    "hit_line",
    "neighbour_caption",
    "query_caption",
    "search_legend",
]

SCORE_NOTE = LegendEntry(None, "caption: cosine similarity, class")

RECORD_LEGEND = (
    LegendEntry(QUERY_BLUE, "query: its class, its file"),
    LegendEntry(GREEN, "the query's class"),
    LegendEntry(RED, "another class"),
    SCORE_NOTE,
)
"""The legend of ``retrieval.png`` and ``compare --grid``: frames and captions of a test split's queries."""


def search_legend(labelled: bool) -> tuple[LegendEntry, ...]:
    """The legend of ``search --grid``: an ad-hoc query has no class, so the hits are compared with the top hit;
    an unlabelled collection (an image folder) has nothing to compare."""
    if not labelled:
        return (
            LegendEntry(QUERY_BLUE, "query file"),
            LegendEntry(GREY, "hit (no class to compare)"),
            LegendEntry(None, "caption: cosine similarity, file"),
        )
    return (
        LegendEntry(QUERY_BLUE, "query file"),
        LegendEntry(GREY, "top hit: the class compared with"),
        LegendEntry(GREEN, "the top hit's class"),
        LegendEntry(RED, "another class"),
        SCORE_NOTE,
    )


@dataclass(frozen=True)
class SampleName:
    """A sample as its user knows it: its class ``name`` and ``source`` file (``""``: not known)."""

    name: str = ""
    source: str = ""


def class_text(name: str, label: int) -> str:
    """The class as shown: its name, else ``class <id>`` (``""`` for a sample without a class)."""
    return name or (f"class {label}" if label >= 0 else "")


def file_text(source: str, key: str) -> str:
    """The file as shown in a picture: the source's file name (the folder is the class), else the sample key."""
    return PurePath(source).name if source else key


def query_caption(name: str, label: int, source: str, key: str) -> str:
    """Under a query of a test split: its class, then its file."""
    return f"{class_text(name, label)}\n{file_text(source, key)}"


def neighbour_caption(score: float, name: str, label: int, source: str = "", key: str = "") -> str:
    """Under a neighbour: its score, then its class (or, for a sample without a class, its file)."""
    below = class_text(name, label) or (file_text(source, key) if key else "")
    return f"{score:.3f}\n{below}" if below else f"{score:.3f}"


def hit_line(rank: int, score: float, key: str, label: int, category: str, names: SampleName) -> str:
    """One line of ``ddp-rank search``: rank, score, key, then the class by name with its id, the category and
    the source file, whichever are known (full, never shortened)."""
    parts = [f"  {rank:>2}  {score:.4f}  {key}"]
    if label >= 0:
        parts.append(f"{names.name} (label {label})" if names.name else f"label {label}")
    if category:
        parts.append(category)
    if names.source:
        parts.append(names.source)
    return "  ".join(parts)
