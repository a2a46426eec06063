"""The names a user knows their samples by: the class name the manifest keeps and the source file a sample's json
records.

``shards build`` names each class after its folder or listing entry (``014.Indigo_Bunting``) in the manifest and
writes ``{"class": ..., "category": ..., "source": <the original file>}`` into each sample's ``.json``; shards of
other tools indexed in place keep what their samples say (the ``.cls`` text or the json ``class`` field), and may
have no json at all. These helpers read both without failing: a name that is not there is ``""``, and the caller
falls back to the ids it has.
"""

from __future__ import annotations

import json
from typing import Any

from ddp_rank.data.format.manifest_parts import ClassInfo

__all__ = ["class_name", "sample_field", "sample_source"]


def class_name(classes: tuple[ClassInfo, ...] | list[ClassInfo], class_id: int) -> str:
    """The manifest's name of class ``class_id`` (``Manifest.classes`` is indexed by id); ``""`` for an id the
    manifest does not hold (-1: no class)."""
    return classes[class_id].name if 0 <= class_id < len(classes) else ""


def sample_field(meta: bytes | None, field: str) -> str:
    """The text of ``field`` in a sample's ``.json`` member (``""``: no json, not JSON, or no such field)."""
    if not meta:
        return ""
    try:
        data: Any = json.loads(meta.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return ""
    value = data.get(field) if isinstance(data, dict) else None
    return "" if value is None else str(value)


def sample_source(meta: bytes | None) -> str:
    """The original file a sample was built from, as ``shards build`` records it (``""`` when not recorded)."""
    return sample_field(meta, "source")
