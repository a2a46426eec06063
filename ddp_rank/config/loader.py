"""Reading and writing the config: defaults <- YAML file <- ``section.key=value`` overrides, merged, coerced to
the field types and validated by the schema; the merged result saved to the run directory; ``--help-config``.

Merge order (dinov2 style): the dataclass defaults <- the YAML file <- ``section.key=value`` overrides from the
command line. The merged result is what runs, and :func:`save_config` writes it to the run directory so that a
run can always be reproduced from its own folder. Unknown sections and keys are rejected with the valid ones and
the closest match; what the values may be is the schema's business (:mod:`ddp_rank.config.schema`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.config.checks import ConfigError, _suggest
from ddp_rank.config.schema import _SECTIONS, Config


def _suggest_full_key(name: str) -> str:
    """For a key given without its section: the full keys whose field has that (or a close) name."""
    full = {f"{s}.{f.name}": f.name for s, c in _SECTIONS.items() for f in dataclasses.fields(c)}
    exact = [k for k, v in full.items() if v == name]
    if exact:
        return f" Did you mean {' or '.join(repr(k) for k in exact)}?"
    close = difflib.get_close_matches(name, list(full.values()), n=1, cutoff=0.6)
    return (
        f" Did you mean {' or '.join(repr(k) for k, v in full.items() if close and v == close[0])}?"
        if close
        else ""
    )


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML or command-line value to the field type ``tp``; reject what does not fit."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = yaml.safe_load(text)
            else:
                value = [v for v in (p.strip() for p in text.split(",")) if v]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r} must be a list, e.g. {where}=1,10,100")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}={value!r} must be a boolean (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be a number")
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}={value!r} must be a string")
    raise ConfigError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover - a programming error


def _merge(base: dict[str, dict[str, Any]], update: Mapping[str, Any], origin: str) -> None:
    """Merge a nested ``{section: {key: value}}`` mapping into ``base`` in place, rejecting unknown keys."""
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
        hints = typing.get_type_hints(_SECTIONS[section])
        # The replaced train.tensorboard last: in one mapping with train.log_with it adds tensorboard to that
        # list (merged, not overwritten by it, whatever the order of the two keys).
        for key, value in sorted(
            values.items(), key=lambda item: (section, item[0]) == ("train", "tensorboard")
        ):
            if (section, key) == ("train", "tensorboard"):
                # Replaced by train.log_with: a config.yaml of an earlier run still loads, and means the same.
                trackers = list(base["train"].get("log_with") or [])
                if _coerce(value, bool, "train.tensorboard") and "tensorboard" not in trackers:
                    base["train"]["log_with"] = [*trackers, "tensorboard"]
                continue
            if key not in hints:
                valid = [f.name for f in dataclasses.fields(_SECTIONS[section])]
                raise ConfigError(
                    f"{origin}: unknown key '{section}.{key}'; valid keys of '{section}': {', '.join(valid)}."
                    + _suggest(str(key), valid)
                )
            base[section][key] = _coerce(value, hints[key], f"{section}.{key}")


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


def _build(values: Mapping[str, Mapping[str, Any]]) -> Config:
    sections = {name: cls(**values.get(name, {})) for name, cls in _SECTIONS.items()}
    return Config(**sections)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as plain nested dicts (YAML/JSON-ready)."""
    return dataclasses.asdict(cfg)


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML file at ``path`` (if any) <- ``section.key=value`` overrides; validated.

    Raises :class:`ConfigError` naming the file, the key, the valid choices and a close match for a typo.
    """
    values = to_dict(Config())
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' not found; pass an existing YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {exc}") from exc
        _merge(values, loaded, str(p))
    _merge(values, parse_overrides(overrides), "command line")
    return _build(values)


def config_from_dict(
    loaded: Mapping[str, Any], overrides: Sequence[str] = (), origin: str = "saved config"
) -> Config:
    """Defaults <- ``loaded`` (e.g. the config a checkpoint's meta.json holds) <- overrides; validated."""
    values = to_dict(Config())
    _merge(values, loaded, origin)
    _merge(values, parse_overrides(overrides), "command line")
    return _build(values)


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the merged config as YAML, atomically (a reader never sees half a file)."""
    text = "# The merged configuration this run used (defaults <- file <- overrides).\n"
    atomic_write_text(path, text + yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe() -> str:
    """Every config key with its type, default, choices and documentation (for ``--help-config``)."""
    lines: list[str] = []
    for section, cls in _SECTIONS.items():
        lines.append(f"{section}:  {cls.__doc__}")
        hints = typing.get_type_hints(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            tname = getattr(tp, "__name__", str(tp)) if typing.get_origin(tp) is None else str(tp)
            extra = (
                f" [choices: {', '.join(map(str, f.metadata['choices']))}]"
                if f.metadata.get("choices")
                else ""
            )
            lines.append(f"  {section}.{f.name} ({tname}, default {getattr(default, f.name)!r}){extra}")
            lines.append(f"      {f.metadata.get('doc', '')}")
    return "\n".join(lines)
