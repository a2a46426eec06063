"""Dataset recipes: turn a public dataset's own files into a listing (``Record`` rows) for ``build_shards``.

Each recipe is a function ``records(root, **options) -> list[Record]``; ``RECIPES`` maps the names the CLI
accepts (``ddp-rank shards listing NAME ROOT OUT.csv``) to them. Recipes only read the dataset's own index files
and paths; the build checks the images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddp_rank.data.building.listing import Record
from ddp_rank.data.building.recipes import cars, cub, emoji, inat, inshop, sop, vehicleid, words

RECIPES: dict[str, Callable[..., list[Record]]] = {
    "cub": cub.records,
    "cars": cars.records,
    "sop": sop.records,
    "inshop": inshop.records,
    "vehicleid": vehicleid.records,
    "emoji": emoji.records,
    "inat": inat.records,
    "words": words.records,
}


def run_recipe(name: str, root: str, **options: Any) -> list[Record]:
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name](root, **options)
