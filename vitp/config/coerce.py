"""Check already-parsed values (JSON, dicts, Python objects) against declared dataclass field types.

Owns `coerce` (one value) and `from_mapping` (a nested dict -> dataclasses, unknown keys rejected).
Must not parse `--set` text (overrides.py does) or know any particular config field.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from ..errors import ConfigError


def hints(cls: type) -> dict[str, Any]:
    """The resolved type annotations of a dataclass (strings under `from __future__` evaluated)."""
    return typing.get_type_hints(cls)


def type_name(tp: Any) -> str:
    """How an error message names a type: "one of 'a', 'b'", "int or none", ..."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def from_mapping(cls: type, d: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys raise ConfigError listing the valid ones."""
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(d).__name__}")
    types = hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys here: {', '.join(prefix + n for n in names)}"
        )
    kwargs = {}
    for name in names:
        if name not in d:
            continue
        tp = types[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_mapping(tp, d[name], prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = coerce(d[name], tp, f"{prefix}{name}")
    return cls(**kwargs)


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert an already-parsed value (from JSON or a dict) to the field's type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed: use {type_name(tp)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    if origin is tuple:
        variable = len(args) == 2 and args[1] is Ellipsis
        if variable and args[0] is str and isinstance(value, str):  # "a, b" in a file, as --set reads it
            value = [p.strip() for p in value.split(",") if p.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list" + ("" if variable else f" of {len(args)} values"))
        if variable:
            return tuple(coerce(v, args[0], key) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key}={value!r}: expected exactly {len(args)} values")
        return tuple(coerce(v, a, key) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping (JSON object)")
        vt = args[1] if args else Any
        if vt is Any or typing.get_origin(vt) is list or vt is list:
            return {str(k): (list(v) if isinstance(v, (list, tuple)) else v) for k, v in value.items()}
        return {str(k): coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return list(value)
    return value
