"""What training and evaluation both set up: the accelerator and its precision, the run's shards, determinism,
the data schedule, and the errors every rank raises alike (and how a failed rank ends).

It sits above the data and model layers and below ``train`` and ``eval``, so neither of those imports the other
for set-up (the trainer may call the evaluation; the evaluation never imports the trainer).
"""

from ddp_rank.runtime.accelerator import (
    autocast_dtype,
    make_accelerator,
    precision_dtype,
    resolve_mixed_precision,
)
from ddp_rank.runtime.errors import AGREED_ERRORS, TrainError
from ddp_rank.runtime.shards import check_split, open_shards, open_training_shards

__all__ = [
    "AGREED_ERRORS",
    "TrainError",
    "autocast_dtype",
    "check_split",
    "make_accelerator",
    "open_shards",
    "open_training_shards",
    "precision_dtype",
    "resolve_mixed_precision",
]
