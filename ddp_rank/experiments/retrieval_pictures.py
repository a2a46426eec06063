"""Several runs' retrieval pictures side by side, for the same queries (``ddp-rank compare --grid OUT.png``).

Each run keeps the record of its pictures in ``retrieval.json`` (``ddp_rank.eval.retrieval_record``: written by
``ddp-rank eval`` into the run directory and by every evaluation of a training run); the last entry of each is
drawn, one block of neighbours per run, for the queries every record shows, captioned with the class names (read
from the shards for a record written before it kept them) under a legend. The runs show the same queries when
they were evaluated on the same split with the same ``eval.grid_seed``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ddp_rank.eval.retrieval_record import (
    RECORD_FILE,
    RecordError,
    RetrievalRecord,
    ShardImages,
    draw_records,
    last_record,
    read_records,
    shard_images_for,
    with_names,
)

__all__ = ["draw_run_pictures"]


def draw_run_pictures(
    run_dirs: list[Path], path: str | os.PathLike[str], note: Callable[[str], None]
) -> tuple[Path, list[Path], int] | None:
    """Draw the last retrieval record of each run into ``path``, side by side, in the order given; each run
    left out is named through ``note`` with the reason. Returns (the PNG, the runs drawn, the queries drawn), or
    None when no run has a record to draw."""
    records: list[RetrievalRecord] = []
    readers: list[ShardImages] = []
    drawn: list[Path] = []
    try:
        for run in run_dirs:
            file = run / RECORD_FILE
            if not file.is_file():
                note(
                    f"{run}: left out of --grid: no {RECORD_FILE} (ddp-rank eval --checkpoint {run} writes it, "
                    "as does every evaluation of a run trained with eval.grid_queries > 0)"
                )
                continue
            try:
                record = last_record(read_records(file))
            except RecordError as exc:
                note(f"{run}: left out of --grid: {exc}")
                continue
            if record is None:
                note(f"{run}: left out of --grid: {file} holds no record")
                continue
            try:
                reader = shard_images_for(record)
            except (OSError, ValueError) as exc:  # the shards moved or are damaged
                note(f"{run}: left out of --grid: cannot open its shards {record.shards}: {exc}")
                continue
            if reader is None:
                note(f"{run}: left out of --grid: its shards hold feature vectors, no image to draw")
                continue
            records.append(with_names(record, reader.names))  # an older record: names from its shards
            readers.append(reader)
            drawn.append(run)
        if not records:
            return None
        picture, queries = draw_records(records, readers, path)
        return picture, drawn, queries
    finally:
        for reader in readers:
            reader.close()
