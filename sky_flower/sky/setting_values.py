"""One setting's value read and checked (:mod:`sky_flower.sky.settings`): converted to
the field's type (``int``, ``float``, ``str``, ``bool``, a tuple of ints), against its
choices and rule, with an error naming the Hydra path or run-config key.

No torch, scipy or Flower is imported here (a ClientApp imports it on start).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def _run_config_error(name: str, value: Any, rule: str) -> ValueError:  # noqa: ANN401
    return ValueError(f"run config {name} must be {rule}, got {value}")


def _hydra_error(name: str, value: Any, rule: str) -> ValueError:  # noqa: ANN401
    return ValueError(f"{name} must be {rule}, got {value}")


_A = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _checked(
    name: str,
    raw: Any,  # noqa: ANN401 - a config value
    f: dataclasses.Field,
    error: Callable[[str, Any, str], ValueError],
) -> Any:  # noqa: ANN401 - the field's type
    """``raw`` converted to ``f``'s type and checked against its rule and choices."""
    run = error is _run_config_error
    if str(f.type).startswith("tuple"):
        try:
            return tuple(int(v) for v in raw)
        except (TypeError, ValueError) as err:
            raise error(name, raw, "a list of integers") from err
    kind = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)]
    prefix = "run config " if run else ""
    if kind is bool:  # true / false only (not 0 / 1, not "yes")
        if not isinstance(raw, bool):
            raise ValueError(f"{prefix}{name}={raw!r} must be {_A[kind]}")
        return raw
    if isinstance(raw, bool) or (run and kind is str and not isinstance(raw, str)):
        raise ValueError(f"{prefix}{name}={raw!r} must be {_A[kind]}")
    try:
        value = kind(raw)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{prefix}{name}={raw!r} must be {_A[kind]}") from err
    if kind is int and value != raw:
        raise ValueError(f"{prefix}{name}={raw!r} must be an integer")
    choices = f.metadata["choices"]
    if choices and value not in choices:
        if run:
            raise ValueError(
                f"run config {name}={value!r} is not valid: choose one of {', '.join(choices)} "
                f"(e.g. flwr run <app> --run-config \"{name}='{choices[0]}'\")"
            )
        raise ValueError(f"unknown {f.name} {value!r} ({name}): choose one of {', '.join(choices)}")
    rule = f.metadata["rule"]
    if rule is not None and not rule[1](value):
        raise error(name, value, rule[0])
    return value
