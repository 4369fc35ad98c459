"""Dotted config keys ("optim.lr"): their types, `--set KEY=VALUE` text parsing, and typed edits.

Owns `parse_value` (the one text -> typed-value parser, for `--set` and `--space`), `apply_overrides`
(people: CLI and job specs) and `set_values` (code: already-typed values, checked). Must not
validate cross-field rules (validate.py does) or import torch or ray.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from typing import Any, Literal, Mapping

from ..errors import ConfigError
from .coerce import coerce, hints
from .schema import ExperimentConfig


def valid_keys(cfg: ExperimentConfig | None = None) -> list[str]:
    """Every dotted key `--set` accepts, e.g. 'optim.lr'."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        types = hints(cls)
        for f in dataclasses.fields(cls):
            tp = types[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)

    walk(ExperimentConfig, "")
    return out


def unknown_key(key: str) -> ConfigError:
    """The error for a key no config has: the closest valid keys (a typo, or the right name in the
    wrong section), else the keys of its section, else where to find them all."""
    keys = valid_keys()
    last = key.rsplit(".", 1)[-1]
    close = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    close += [k for k in difflib.get_close_matches(key, keys, n=3, cutoff=0.75) if k not in close]
    lasts = difflib.get_close_matches(last, {k.rsplit(".", 1)[-1] for k in keys}, n=2, cutoff=0.8)
    close += [k for k in keys if k.rsplit(".", 1)[-1] in lasts and k not in close]
    if close:
        hint = "did you mean " + " or ".join(repr(k) for k in close[:3]) + "?"
    elif "." in key and any(k.startswith(key.rsplit(".", 1)[0] + ".") for k in keys):
        section = key.rsplit(".", 1)[0]
        hint = f"keys of {section}: " + ", ".join(k for k in keys if k.startswith(section + "."))
    else:
        hint = "`vitp config --keys` lists them all"
    return ConfigError(f"unknown config key {key!r}; {hint}")


def field_type(key: str) -> Any:
    """The declared type of a dotted key; ConfigError naming the closest keys if unknown."""
    parts = key.split(".")
    cls: Any = ExperimentConfig
    for i, part in enumerate(parts):
        types = hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in types:
            raise unknown_key(key)
        cls = types[part]
        if i < len(parts) - 1 and not dataclasses.is_dataclass(cls):
            raise unknown_key(key)
    if dataclasses.is_dataclass(cls):
        raise ConfigError(f"{key!r} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(cls)[0].name}=...")
    return cls


def parse_value(key: str, text: str) -> Any:
    """The right-hand side of `--set key=text` as a value of the key's declared type.

    "0.003" -> 0.003 for a float, "true"/"off" for a bool, "none" for an Optional, JSON or
    "a,b,c" for lists and tuples, a JSON object for dicts. ConfigError names the key and the type.
    """
    return _parse_text(text, field_type(key), key)


def _parse_text(text: str, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    low = text.strip().lower()
    if origin is typing.Union and type(None) in args:
        if low in ("none", "null", ""):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _parse_text(text, inner, key)
    if tp is bool:
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--set {key}={text}: expected true or false")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
            raise ConfigError(f"--set {key}={text}: expected an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--set {key}={text}: expected a number") from None
    if tp is str or origin is Literal:
        return coerce(text, tp, key)
    if origin in (tuple, list, dict) or tp in (list, dict):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if origin is tuple or origin is list or tp is list:  # also accept "a,b,c"
                parts = [p.strip() for p in text.split(",") if p.strip()]
                inner = args[0] if args else str
                value = [_parse_text(p, inner, key) for p in parts]
            else:
                raise ConfigError(f"--set {key}={text}: expected a JSON object") from None
        return coerce(value, tp, key)
    raise ConfigError(f"--set {key}: unsupported field type {tp}")


def set_values(cfg: ExperimentConfig, values: Mapping[str, Any]) -> ExperimentConfig:
    """A copy of cfg with each dotted key set to its already-typed value, e.g.
    `set_values(cfg, {"optim.lr": 0.01, "model.head": "finetune"})`.

    Each value is checked against the key's declared type (ConfigError on an unknown key or a
    wrong type); not validated across fields. For code; people's `--set` text goes through
    apply_overrides.
    """
    d = cfg.to_dict()
    for key, value in values.items():
        value = coerce(value, field_type(key), key)
        node = d
        parts = key.split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = json.loads(json.dumps(value))  # plain JSON types, as in to_dict()
    return ExperimentConfig.from_dict(d)


def set_value(cfg: ExperimentConfig, key: str, value: Any) -> ExperimentConfig:
    """A copy of cfg with dotted `key` set to an already-typed value (checked); see set_values."""
    return set_values(cfg, {key: value})


def apply_overrides(cfg: ExperimentConfig, overrides: list[str] | tuple[str, ...]) -> ExperimentConfig:
    """Apply `a.b=v` strings, type-checked against the dataclasses; returns a new config."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=0.003")
        key, text = item.split("=", 1)
        key = key.strip()
        cfg = set_value(cfg, key, parse_value(key, text))
    return cfg
