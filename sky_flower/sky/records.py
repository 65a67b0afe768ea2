"""Typed records: the protocol's frozen dataclasses as flat Flower records and back.

:class:`Record` is the mixin of every config and figure dataclass of
:mod:`sky_flower.sky.protocol` (which re-exports it and :class:`ProtocolError`): one flat
``ConfigRecord`` (or ``MetricRecord``) each way, nested dataclasses inlined, every value
type-checked on the way in.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from flwr.app import ConfigRecord


class ProtocolError(ValueError):
    """A record lacks a key of a protocol dataclass, or holds a value of the wrong type."""


R = TypeVar("R", bound="Record")


def _check(cls_name: str, key: str, hint: Any, value: Any) -> Any:
    """``value`` converted to ``hint`` (``int``, ``float``, ``str``, ``bool``,
    ``tuple[int, ...]``, ``tuple[float, ...]``, or one of these ``| None``).

    Raises
    ------
    ProtocolError
        If the value does not have that type (a bool is not an int; an int is a float).
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if args and type(None) in args:  # X | None
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(
                f"{cls_name}: key {key!r} must be a list, got {type(value).__name__} {value!r}"
            )
        return tuple(_check(cls_name, f"{key}[{i}]", args[0], v) for i, v in enumerate(value))
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ProtocolError(
            f"{cls_name}: key {key!r} must be {hint.__name__}, got {type(value).__name__} {value!r}"
        )
    return float(value) if hint is float else value


def _flat(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a flat dict: nested dataclasses are inlined, tuples become
    lists, ``None`` values are left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value))
        elif value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _build(cls: type, rec: Mapping[str, Any], where: str = "") -> Any:
    """Instance of dataclass ``cls`` from the flat mapping ``rec`` (see :func:`_flat`);
    a missing key takes the field's default, if it has one; extra keys are ignored.
    ``where`` names the record in errors (default: the class)."""
    where = where or cls.__name__
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, rec, f"{where}.{f.name}")
        elif f.name in rec:
            kwargs[f.name] = _check(where, f.name, hint, rec[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if type(None) in typing.get_args(hint):
                kwargs[f.name] = None
            else:
                raise ProtocolError(f"{where}: the record lacks key {f.name!r}")
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as err:  # the dataclass's own checks
        raise ProtocolError(f"{where}: {err}") from err


class Record:
    """Mixin for the protocol's frozen dataclasses: one flat record each way.

    ``record_type`` is the Flower record class the dataclass travels as (a
    ``ConfigRecord``, or a ``MetricRecord`` for figures). Nested dataclass fields are
    inlined into the same record (their keys must not collide).
    """

    record_type: ClassVar[type] = ConfigRecord

    def to_record(self) -> Any:
        """This config as a flat Flower record (``record_type``)."""
        return self.record_type(_flat(self))

    def to_config_record(self) -> ConfigRecord:
        """This config as a flat ``ConfigRecord``."""
        return ConfigRecord(_flat(self))

    @classmethod
    def from_config_record(cls: type[R], rec: Mapping[str, Any]) -> R:
        """Read a config back from a record (a ``ConfigRecord``, ``MetricRecord`` or any
        mapping). Keys the dataclass does not know are ignored.

        Raises
        ------
        ProtocolError
            Naming the class and the key that is missing or holds a value of the wrong
            type, or what the dataclass's own checks refuse.
        """
        if rec is None:
            raise ProtocolError(f"{cls.__name__}: no record")
        return _build(cls, rec)

    from_record = from_config_record

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key of the flat record, nested dataclasses' included."""
        return tuple(_keys(cls))


def _keys(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        out.extend(_keys(hint) if dataclasses.is_dataclass(hint) else [f.name])
    return out
