"""What each dotted config key is: its type, default and meaning (`vitp config --keys RECIPE`).

The meanings are the comments beside (or just above) each field in schema.py, read from that file
once: the schema stays the one place a key is described. Must not import torch or ray.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import io
import json
import tokenize
import typing
from pathlib import Path
from typing import Any, Literal

from . import schema
from .coerce import hints
from .rules import RULES, Each, Name, Number
from .schema import ExperimentConfig

_LONGEST_CHOICE_TYPE = 40  # a Literal longer than this is shown as "choice" and listed in the meaning


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, e.g. "optim.lr"
    type: str  # "float", "int", "uint8|jpeg", "choice", "list[str]" ...
    value: Any  # the recipe's value
    default: Any  # the schema's
    meaning: str  # the schema's comment; "" where it has none
    allowed: str = ""  # a number's range ("8..4096", "(0, 1]"), "name": its rule in rules.py, shown after the type


@functools.lru_cache(maxsize=1)
def _comments() -> dict[tuple[str, str], str]:
    """{(class name, field name): comment} from schema.py: the comment on the field's line, else
    the block of comment lines right above it."""
    source = Path(schema.__file__).read_text()
    by_line = {tok.start[0]: tok.string.lstrip("#").strip()
               for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            text = by_line.get(stmt.end_lineno, "")
            if not text:  # a comment block above, line by line up to the previous statement
                above, n = [], stmt.lineno - 1
                while n >= 1 and lines[n - 1].lstrip().startswith("#"):
                    above.insert(0, by_line.get(n, ""))
                    n -= 1
                text = " ".join(above)
            out[(node.name, stmt.target.id)] = text
    return out


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is typing.Union:
        return "|".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin is dict:
        return f"dict[{','.join(_type_name(a) for a in args)}]"
    if origin in (tuple, list):
        return f"list[{'|'.join(dict.fromkeys(_type_name(a) for a in args if a is not Ellipsis))}]"
    return getattr(tp, "__name__", str(tp))


def key_docs(cfg: ExperimentConfig) -> list[KeyDoc]:
    """Every key `--set` accepts, in schema order, with `cfg`'s value beside the default."""
    comments = _comments()
    out: list[KeyDoc] = []

    def walk(cls: type, value: Any, default: Any, prefix: str) -> None:
        types = hints(cls)
        for f in dataclasses.fields(cls):
            tp, v, d = types[f.name], getattr(value, f.name), getattr(default, f.name)
            if dataclasses.is_dataclass(tp):
                walk(tp, v, d, f"{prefix}{f.name}.")
                continue
            kind, meaning = _type_name(tp), comments.get((cls.__name__, f.name), "")
            if len(kind) > _LONGEST_CHOICE_TYPE:
                meaning = f"{meaning} (one of: {kind.replace('|', ', ')})".strip()
                kind = "choice"
            out.append(KeyDoc(prefix + f.name, kind, v, d, meaning, _allowed(prefix + f.name)))

    walk(ExperimentConfig, cfg, ExperimentConfig(), "")
    return out


def _allowed(key: str) -> str:
    rule = RULES.get(key)
    each = isinstance(rule, Each)
    rule = rule.rule if isinstance(rule, Each) else rule
    if isinstance(rule, Number):
        return f"{'each ' if each else ''}{rule.allowed}"
    return "name" if isinstance(rule, Name) else ""


def _text(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def key_table(cfg: ExperimentConfig) -> str:
    """One line per key: key, type, the recipe's value (and the default where it differs), meaning."""
    docs = key_docs(cfg)
    rows = [(d.key, f"{d.type} {d.allowed}".strip(), _text(d.value) + ("" if d.value == d.default else f" (default {_text(d.default)})"),
             d.meaning) for d in docs]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    head = ("key", "type", f"value in {cfg.recipe}", "meaning")
    widths = [max(w, len(h)) for w, h in zip(widths, head)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]  # noqa: E731
    return "\n".join([fmt(head).rstrip(), *(fmt(r).rstrip() for r in rows)])
