"""The split of CUB-200-2011 and Cars196 for metric learning: the first half of the classes train, the rest test.

Oh Song et al. (2016) set it, and the field kept it (Musgrave et al. 2020 among others): train on classes 1-100
of CUB and 1-98 of Cars196, test on the unseen 101-200 and 99-196. The order is the dataset's own class ids,
which for Cars196 is not the order of the class names, so the recipes split by id rather than leaving it to
``shards build --test-classes last`` (which orders by name).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddp_rank.data.building.listing import ListingError


def split_of_class(class_ids: Sequence[int], source: Path) -> dict[int, str]:
    """``train`` for the first half of ``class_ids`` in numeric order (the larger half when odd), ``test`` for
    the rest; ``source`` names the file the ids come from in the error."""
    ids = sorted(set(class_ids))
    if len(ids) < 2:
        raise ListingError(f"{source}: {len(ids)} class(es); a train and a test half need at least 2")
    n_train = len(ids) - len(ids) // 2
    return {cid: "train" if i < n_train else "test" for i, cid in enumerate(ids)}
