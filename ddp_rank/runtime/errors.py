"""The errors a run raises alike on every rank, and the one for a run that cannot start or continue.

Training, evaluation and export all raise and catch these; they live below both so neither imports the other
for an exception type.
"""

from __future__ import annotations

from ddp_rank.config import ConfigError
from ddp_rank.model.checkpoint_read import CheckpointError
from ddp_rank.model.net import ModelError

__all__ = ["AGREED_ERRORS", "TrainError"]


class TrainError(RuntimeError):
    """A run that cannot start or continue as configured; the message says what to change."""


AGREED_ERRORS = (ConfigError, ModelError, CheckpointError, TrainError)
"""The trainer's own errors: raised on every rank alike, so every rank can unwind (``ddp_rank.runtime.failure``)."""
