"""Reading and writing the config: defaults <- YAML file <- ``section.key=value`` overrides, merged, coerced to
the field types and validated by the schema; the merged result saved to the run directory; ``--help-config``.

Merge order (dinov2 style): the schema's defaults <- the YAML file <- ``section.key=value`` overrides from the
command line. The merged result is what runs, and :func:`save_config` writes it to the run directory so that a
run can always be reproduced from its own folder. The merged values are validated once, by the schema
(:mod:`ddp_rank.config.schema`); its errors become one line that names where the value came from (the file or the
command line), the key, what is wrong, the valid values and the closest match (:func:`~ddp_rank.config.checks.explain`).
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import ValidationError

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.config.checks import LOADED, ConfigError, _suggest, explain, field_choices
from ddp_rank.config.schema import _SECTIONS, Config


def _suggest_full_key(name: str) -> str:
    """For a key given without its section: the full keys whose field has that (or a close) name."""
    full = {f"{s}.{key}": key for s, c in _SECTIONS.items() for key in c.model_fields}
    exact = [k for k, v in full.items() if v == name]
    if exact:
        return f" Did you mean {' or '.join(repr(k) for k in exact)}?"
    close = difflib.get_close_matches(name, list(full.values()), n=1, cutoff=0.6)
    return (
        f" Did you mean {' or '.join(repr(k) for k, v in full.items() if close and v == close[0])}?"
        if close
        else ""
    )


Origins = dict[tuple[str, ...], str]
"""Where each value came from (a file's name, ``command line``), by ``(section,)`` and ``(section, key)``."""


def _merge(base: dict[str, dict[str, Any]], update: Mapping[str, Any], origin: str, origins: Origins) -> None:
    """Merge a nested ``{section: {key: value}}`` mapping into ``base`` in place, noting each value's origin.

    The values stay as written (text from the command line); the schema reads and checks them, unknown sections
    and keys included, once everything is merged."""
    if not isinstance(update, Mapping):
        raise ConfigError(f"{origin}: the top level must be a mapping of sections ({', '.join(_SECTIONS)})")
    for section, values in update.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{origin}: unknown section '{section}'; valid sections: {', '.join(_SECTIONS)}."
                + _suggest(str(section), list(_SECTIONS))
            )
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: section '{section}' must be a mapping of key: value")
        origins[(section,)] = origin
        for key, value in values.items():
            if (section, key) == ("train", "tensorboard"):
                raise ConfigError(
                    f"{origin}: train.tensorboard was replaced by train.log_with: write train.log_with: [tensorboard] "
                    "instead (or delete the line: no tracker)"
                )
            base.setdefault(section, {})[str(key)] = value
            origins[(section, str(key))] = origin


def parse_overrides(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["optim.lr=1e-4", "train.steps=10"]`` into ``{"optim": {"lr": "1e-4"}, "train": {"steps": "10"}}``.

    Values stay strings here; :func:`load_config` coerces them to the field types. A stray flag or a key without
    a section is rejected with the list of sections.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override '{item}' is not of the form section.key=value (e.g. optim.lr=1e-4); "
                f"sections: {', '.join(_SECTIONS)}"
            )
        key, value = item.split("=", 1)
        key = key.strip()
        if key.startswith("-"):
            raise ConfigError(
                f"unknown option '{key}': overrides are written section.key=value, without dashes"
            )
        if "." not in key:
            raise ConfigError(
                f"override '{item}' has no section; write section.key=value with a section among "
                f"{', '.join(_SECTIONS)}." + _suggest_full_key(key)
            )
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = value
    return out


def _build(values: Mapping[str, Mapping[str, Any]], origins: Origins) -> Config:
    try:
        return Config.model_validate(values, context=LOADED)
    except ValidationError as exc:
        raise ConfigError(explain(exc, Config, origins)) from None


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as plain nested dicts (YAML/JSON-ready)."""
    return cfg.model_dump()


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file at ``path`` (if any) <- ``section.key=value`` overrides; validated.

    Raises :class:`ConfigError` naming the file, the key, the valid choices and a close match for a typo.

    Examples:
        >>> from ddp_rank.config import load_config
        >>> cfg = load_config(overrides=["data.global_batch_size=64", "loss.name=pnp"])
        >>> cfg.data.global_batch_size, cfg.loss.name, cfg.model.weights
        (64, 'pnp', 'none')
        >>> load_config(overrides=["data.global_batch_sise=64"])
        Traceback (most recent call last):
            ...
        ddp_rank.config.checks.ConfigError: command line: unknown key 'data.global_batch_sise'; ... Did you mean 'global_batch_size'?
    """
    values: dict[str, dict[str, Any]] = {}
    origins: Origins = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' not found; pass an existing YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {exc}") from exc
        _merge(values, loaded, str(p), origins)
    _merge(values, parse_overrides(overrides), "command line", origins)
    return _build(values, origins)


def config_from_dict(
    loaded: Mapping[str, Any], overrides: Sequence[str] = (), origin: str = "saved config"
) -> Config:
    """Defaults <- ``loaded`` (e.g. the config a checkpoint's meta.json holds) <- overrides; validated."""
    values: dict[str, dict[str, Any]] = {}
    origins: Origins = {}
    _merge(values, loaded, origin, origins)
    _merge(values, parse_overrides(overrides), "command line", origins)
    return _build(values, origins)


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the merged config as YAML, atomically (a reader never sees half a file)."""
    text = "# The merged configuration this run used (defaults <- file <- overrides).\n"
    atomic_write_text(path, text + yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _type_name(annotation: Any) -> str:
    """``int``, ``list[float]``, ``str`` for a ``Literal`` of strings: a key's type as a config file writes it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return type(args[0]).__name__
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def describe() -> str:
    """Every config key with its type, default, choices and documentation (for ``--help-config``)."""
    lines: list[str] = []
    for section, cls in _SECTIONS.items():
        lines.append(f"{section}:  {cls.__doc__}")
        default = cls()
        for name, info in cls.model_fields.items():
            choices = field_choices(cls, name)
            extra = f" [choices: {', '.join(map(str, choices))}]" if choices else ""
            tname = _type_name(info.annotation)
            lines.append(f"  {section}.{name} ({tname}, default {getattr(default, name)!r}){extra}")
            lines.append(f"      {info.description or ''}")
    return "\n".join(lines)
