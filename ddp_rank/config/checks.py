"""What every config section shares: the error type, the field metadata (doc, choices, bounds) and the generic
checks made from it, and the close-match suggestion that error messages end with.

The sections themselves live in :mod:`ddp_rank.config.schema`; this module knows none of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem: the message names the key, what is wrong and how to fix it."""


def _suggest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _meta(
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> dict[str, Any]:
    """Field metadata: the documentation and the validation rules of one config key (``above``: an exclusive
    lower bound, for keys that must be strictly positive).

    Why metadata and not a docstring per field: the checks in ``_Section.__post_init__`` and the help text are
    generated from the same place, so a field cannot gain a choice that its doc or its check does not know.
    """
    return {
        "doc": doc,
        "choices": tuple(choices) if choices is not None else None,
        "min": minimum,
        "max": maximum,
        "above": above,
    }


def _field(
    default: Any,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> Any:
    """A dataclass field with an immutable default and its :func:`_meta` (lists use ``field(default_factory=...)``)."""
    return field(
        default=default, metadata=_meta(doc, choices=choices, minimum=minimum, maximum=maximum, above=above)
    )


def _section_key(cls: type) -> str:
    """A section's name in YAML files, overrides and :class:`~ddp_rank.config.Config`: ``DataConfig`` -> ``data``.

    Why derived from the class name: the schema builds its table of sections with this same rule, so the name in
    an error message and the key a user writes cannot disagree.
    """
    return cls.__name__.removesuffix("Config").lower()


class _Section:
    """Base of every config section: generic checks of choices and bounds from the field metadata."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            where = f"{_section_key(type(self))}.{f.name}"
            # 16.0 == 16 passes every choice and bound, then travels on as a float (into a record, a file name).
            if f.type in ("int", int) and isinstance(value, float):
                raise ConfigError(f"{where}={value!r} must be an integer")
            if choices is not None:
                values = value if isinstance(value, list) else [value]
                for v in values:
                    if v not in choices:
                        raise ConfigError(
                            f"{where}={v!r} is not a valid choice; valid choices: {', '.join(map(str, choices))}."
                            + _suggest(str(v), [str(c) for c in choices])
                        )
            lo, hi, above = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("above")
            nums = value if isinstance(value, list) else [value]
            for v in nums:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    if not math.isfinite(v):  # NaN compares False with every bound: it would pass them all
                        raise ConfigError(f"{where}={v!r} must be a finite number, not nan or inf")
                    if above is not None and v <= above:
                        raise ConfigError(f"{where}={v!r} must be > {above}")
                    if lo is not None and v < lo:
                        raise ConfigError(f"{where}={v!r} must be >= {lo}")
                    if hi is not None and v > hi:
                        raise ConfigError(f"{where}={v!r} must be <= {hi}")
