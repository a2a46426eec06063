"""What every config section shares: the error type, the value types that read YAML and command-line text, the
section base class, and the translation of pydantic's errors into one-line messages that end with the fix.

The sections themselves live in the ``*_section`` modules; this module knows none of them.

Why pydantic with these types and not its own coercion: its lax mode reads ``16.0`` and ``true`` as integers,
which a config must refuse (16.0 passes every bound, then travels on as a float into a record or a file name).
So each value type first turns command-line text into the value it spells (``"1_000"`` -> 1000, ``"yes"`` ->
True, ``"1,10,100"`` -> [1, 10, 100]) and leaves anything else as it is, and pydantic then checks it strictly:
the type, the bounds of the field, its choices (``Literal``), unknown keys (``extra="forbid"``).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A configuration problem: the message names the key, what is wrong and how to fix it."""


def _suggest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


LOADED = {"loaded": True}
"""The validation context of values read from a file or the command line (:mod:`~ddp_rank.config.loader`): there
a whole float (``image_size: 224.0``) is the integer it equals, as the loader has always read it; a section built
in Python gets no such help (``ModelConfig(output_stride=16.0)`` is refused)."""


def _int(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            return value
    return value


def _read_int(value: Any, info: ValidationInfo) -> Any:
    """:func:`_int`, and a whole float read from a file (:data:`LOADED`) as the integer it equals."""
    if isinstance(value, float) and value.is_integer() and info.context == LOADED:
        return int(value)
    return _int(value)


def _whole(value: Any, info: ValidationInfo) -> int:
    """An integer (or its text) as an int, anything else refused: for a ``Literal`` of numbers, which would
    take 16.0 for 16."""
    value = _read_int(value, info)
    if type(value) is not int:
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def _float(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return value
    return value


def _bool(value: Any) -> Any:
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
    elif type(value) is int and value in (0, 1):
        return bool(value)
    return value


def _text(value: Any) -> Any:
    if value is None:  # ``key:`` with no value in YAML
        return ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # ``train_split: 2024``
    return value


def _list(value: Any) -> Any:
    """``"1,10,100"`` and ``"[0.9, 0.999]"`` (command line) and tuples become lists; the rest is left as it is."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError:
                return value
        return [v for v in (p.strip() for p in text.split(",")) if v]
    return list(value) if isinstance(value, tuple) else value


Int = Annotated[int, BeforeValidator(_read_int), Strict()]
Float = Annotated[float, BeforeValidator(_float), Strict()]
Bool = Annotated[bool, BeforeValidator(_bool), Strict()]
Text = Annotated[str, BeforeValidator(_text), Strict()]
Positive = Annotated[int, Field(ge=1), BeforeValidator(_read_int), Strict()]
NonNegative = Annotated[float, Field(ge=0.0), BeforeValidator(_float), Strict()]
Rate = Annotated[float, Field(gt=0.0, le=1.0), BeforeValidator(_float), Strict()]
"""Items of lists with bounds (the bounds first: the JSON schema shows them as ``minimum``, ``maximum``)."""
ListOf = BeforeValidator(_list)
"""Put on a ``list[...]`` field (``Annotated[list[Int], ListOf]``): it reads ``1,10,100`` from the command line."""


def _field(
    default: Any,
    doc: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> Any:
    """A field with its documentation (``description``: ``--help-config`` and the JSON schema) and its bounds
    (``above``: an exclusive lower bound, for keys that must be strictly positive). A list's bounds are its
    items' and belong in its type; its default is copied for each new section (pydantic copies a mutable
    default), so a list default is written as it is."""
    kwargs: dict[str, Any] = {"description": doc, "ge": minimum, "le": maximum, "gt": above}
    return Field(default, **{k: v for k, v in kwargs.items() if v is not None})


def _section_key(cls: type) -> str:
    """A section's name in YAML files, overrides and :class:`~ddp_rank.config.Config`: ``DataConfig`` -> ``data``.

    Why derived from the class name: the schema builds its table of sections with this same rule, so the name in
    an error message and the key a user writes cannot disagree.
    """
    return cls.__name__.removesuffix("Config").lower()


def choices_of(annotation: Any) -> tuple[Any, ...] | None:
    """The valid values of a field's type (its ``Literal``, also inside ``Annotated`` or ``list``), or None."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    for arg in typing.get_args(annotation):
        found = choices_of(arg)
        if found is not None:
            return found
    return None


def field_choices(cls: type[BaseModel], name: str) -> tuple[Any, ...] | None:
    """The valid values of field ``name`` of the section ``cls`` (None: any value of its type)."""
    return choices_of(cls.model_fields[name].annotation)


_M = TypeVar("_M", bound="_Model")


class _Model(BaseModel):
    """Base of the config and its sections: unknown keys refused, NaN and infinities refused, frozen once made (a
    part handed a section reads what the run was started with; :meth:`replaced` makes a checked copy), and
    pydantic's errors raised as a one-line :class:`ConfigError` also when a section is built in Python."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(explain(exc, type(self))) from None

    # Marked as pydantic marks its own: a section inside the config is then validated by pydantic directly (with
    # the loader's context and the whole path of an error), not through this __init__. Without the mark (a
    # pydantic that drops it) the checks stay the same; only a nested error's origin is the section's.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def replaced(self: _M, **changes: Any) -> _M:
        """A copy with ``changes``, checked as a new one is (``dataclasses.replace`` did that with the dataclass
        sections; pydantic's ``model_copy(update=...)`` checks nothing)."""
        return type(self)(**{**dict(self), **changes})


class _Section(_Model):
    """Base of every config section (its key, ``data`` for ``DataConfig``, opens the path of its errors)."""


def explain(exc: ValidationError, model: type[BaseModel], origins: Mapping[tuple[str, ...], str] = {}) -> str:
    """The first of pydantic's errors as one line: where the value came from (``origins``: the file or
    ``command line`` by section and by (section, key)), the key, what is wrong, the valid values, a close match.

    ``model`` is the class that was validated: the config, or one section (whose key then opens the path)."""
    error = exc.errors()[0]
    loc = tuple(str(part) for part in error["loc"])
    prefix = (_section_key(model),) if issubclass(model, _Section) else ()
    path = (*prefix, *loc)
    origin = origins.get(path[:2]) or origins.get(path[:1])
    if origin is None and len(path) <= 1 and origins:  # a check across keys: every place the values came from
        origin = " and ".join(dict.fromkeys(origins.values()))
    lead = f"{origin}: " if origin else ""
    return lead + _problem(error, path, model)


def _problem(error: Any, path: tuple[str, ...], model: type[BaseModel]) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])  # a check of the schema's own: its message is complete
    # The key without a list index (``optim.betas=nan``): a list's items are named by their value.
    keys = [p for p in path if not p.isdigit()]
    where = ".".join(keys[:2])
    if kind == "extra_forbidden":
        return _unknown(keys, model)
    if kind == "missing":
        return f"{where} is missing"
    shown = f"{where}={value!r}"
    if kind == "literal_error":
        valid = _valid(keys, model)
        names = [str(c) for c in valid]
        return f"{shown} is not a valid choice; valid choices: {', '.join(names)}." + _suggest(
            str(value), names
        )
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        if isinstance(value, str):  # a list item's bound sees the text it was read from: show the number
            value = _float(value) if isinstance(limit, float) else _int(value)
            shown = f"{where}={value!r}"
        return f"{shown} must be {bounds[kind]} {limit}"
    if kind == "finite_number":
        return f"{shown} must be a finite number, not nan or inf"
    if kind.startswith("int_"):
        return f"{shown} must be an integer"
    if kind.startswith("float_"):
        return f"{shown} must be a number"
    if kind.startswith("bool_"):
        return f"{shown} must be a boolean (true/false)"
    if kind.startswith("string_"):
        return f"{shown} must be a string"
    if kind.startswith("list_"):
        return f"{shown} must be a list, e.g. {where}=1,10,100"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"section '{where}' must be a mapping of key: value"
    return f"{shown}: {error['msg']}"


def _section_class(keys: list[str], model: type[BaseModel]) -> tuple[type[BaseModel] | None, list[str]]:
    """The section class a path ends in (None at the top of the config) and the keys left after it."""
    if issubclass(model, _Section):
        return model, keys[1:]
    if not keys or keys[0] not in model.model_fields:
        return None, keys
    section = model.model_fields[keys[0]].annotation
    return (section if isinstance(section, type) and issubclass(section, BaseModel) else None), keys[1:]


def _valid(keys: list[str], model: type[BaseModel]) -> tuple[Any, ...]:
    section, rest = _section_class(keys, model)
    return (field_choices(section, rest[0]) or ()) if section is not None and rest else ()


def _unknown(keys: list[str], model: type[BaseModel]) -> str:
    section, rest = _section_class(keys, model)
    if section is None:
        sections = list(model.model_fields)
        return f"unknown section '{keys[0]}'; valid sections: {', '.join(sections)}." + _suggest(
            keys[0], sections
        )
    name, valid = _section_key(section), list(section.model_fields)
    return f"unknown key '{name}.{rest[0]}'; valid keys of '{name}': {', '.join(valid)}." + _suggest(
        rest[0], valid
    )
