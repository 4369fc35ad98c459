"""Search spaces: what a `tune.space` value means, parsed and checked without Ray. A value is a
list (a grid axis under grid search, a choice otherwise) or one expression: a range (uniform,
loguniform, quniform, qloguniform, randint, lograndint, qrandint), choice([...]), grid([...]) or
when(KEY, {VALUE: ...}). Expressions are read as a tree of literals, never evaluated; `probe_trials`
gives the values validation tries (a range's ends and middle, every choice). docs/transfer.md."""
from __future__ import annotations

import ast
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..config import ConfigError

RANGES = {"uniform": 2, "loguniform": 2, "quniform": 3, "qloguniform": 3,
          "randint": 2, "lograndint": 2, "qrandint": 3}
SETS = ("choice", "grid")
INTEGER = ("randint", "lograndint", "qrandint")
MAX_TEXT = 2000  # an expression longer than this is refused before it is parsed
MAX_PROBES = 512  # joint probe trials; beyond it each key is probed alone


@dataclass(frozen=True)
class Dist:
    """One key's values: kind "list" (the space's plain list), "choice", "grid", or a range kind
    with args (LOW, HIGH[, Q])."""

    kind: str
    args: tuple

    @property
    def values(self) -> list:
        return list(self.args[0]) if self.kind in ("list", *SETS) else []

    def text(self) -> str:
        if self.kind == "list":
            return repr(self.values)
        if self.kind in SETS:
            return f"{self.kind}({self.values!r})"
        return f"{self.kind}({', '.join(repr(a) for a in self.args)})"

    def probes(self) -> list:
        """The values validation tries: every listed value; a range's ends and middle."""
        if self.kind in ("list", *SETS):
            return self.values
        low, high = self.args[0], self.args[1]
        q = self.args[2] if len(self.args) == 3 else None
        if self.kind == "randint" or self.kind == "lograndint":
            return sorted({low, high - 1})
        if self.kind == "qrandint":  # Tune's qrandint includes HIGH, but excludes it at Q=1
            return sorted({int(round(low / q) * q), int(round((high - 1 if q == 1 else high) / q) * q)})
        mid = math.sqrt(low * high) if "log" in self.kind else (low + high) / 2
        out = [low, mid, math.nextafter(high, low)]
        return [round(v / q) * q for v in out] if q else out


@dataclass(frozen=True)
class When:
    """A key whose value (a constant or a Dist) is picked by another key's sampled value."""

    key: str
    cases: tuple  # ((parent value, constant or Dist), ...)

    def case(self, parent_value: Any) -> Any:
        for value, out in self.cases:
            if value == parent_value:
                return out
        raise KeyError(parent_value)

    def text(self) -> str:
        inner = ", ".join(f"{v!r}: {c.text() if isinstance(c, Dist) else repr(c)}" for v, c in self.cases)
        return f"when({self.key}, {{{inner}}})"


def is_expression(text: str) -> bool:
    """Whether `--space KEY=TEXT` gives a distribution (NAME(...)) rather than comma-separated values."""
    return re.fullmatch(r"\s*[A-Za-z_]\w*\s*\(.*\)\s*", text, re.S) is not None


def parse(key: str, value: Any) -> Dist | When:
    """tune.space[key]'s value -> Dist or When; ConfigError naming the key and the forms allowed."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"tune.space[{key!r}] is an empty list: give at least one value")
        return Dist("list", (tuple(value),))
    if not isinstance(value, str):
        raise ConfigError(f"tune.space[{key!r}]={value!r}: give a list of values or an expression "
                          "such as loguniform(1e-4, 1e-1) (docs/transfer.md, Search spaces)")
    if len(value) > MAX_TEXT:
        raise ConfigError(f"tune.space[{key!r}]: an expression of {len(value)} characters; at most {MAX_TEXT}")
    try:
        tree = ast.parse(value.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ConfigError(f"tune.space[{key!r}]={value!r} is not an expression; e.g. loguniform(1e-4, 1e-1), "
                          "randint(1, 10), choice([0.0, 0.1])") from None
    return _node(key, value, tree, top=True)


def _fail(key: str, text: str, why: str) -> ConfigError:
    return ConfigError(f"tune.space[{key!r}]={text!r}: {why}")


def _call_name(node: ast.AST) -> str | None:
    return node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None


def _node(key: str, text: str, node: ast.AST, top: bool) -> Dist | When:
    name = _call_name(node)
    if name is None or node.keywords:
        raise _fail(key, text, "expected one of " + ", ".join(f"{n}(...)" for n in (*RANGES, *SETS, "when")))
    if name == "when":
        if not top:
            raise _fail(key, text, "when(...) cannot be nested in another expression")
        return _when(key, text, node)
    if name in SETS:
        if len(node.args) != 1:
            raise _fail(key, text, f"{name}(...) takes one list, e.g. {name}([0.1, 0.3])")
        values = _literal(key, text, node.args[0])
        if not isinstance(values, (list, tuple)) or not values:
            raise _fail(key, text, f"{name}(...) takes a non-empty list")
        return Dist(name, (tuple(values),))
    if name not in RANGES:
        raise _fail(key, text, f"unknown distribution {name!r}; use one of {', '.join((*RANGES, *SETS, 'when'))}")
    args = [_literal(key, text, a) for a in node.args]
    if len(args) != RANGES[name] or not all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                            and math.isfinite(a) for a in args):
        shape = "LOW, HIGH, Q" if RANGES[name] == 3 else "LOW, HIGH"
        raise _fail(key, text, f"{name} takes {RANGES[name]} finite numbers ({shape})")
    low, high = args[0], args[1]
    if not low < high:
        raise _fail(key, text, f"LOW ({low}) must be below HIGH ({high})")
    if "log" in name and low <= 0:
        raise _fail(key, text, f"{name} needs LOW > 0 (a logarithm of {low})")
    if len(args) == 3 and args[2] <= 0:
        raise _fail(key, text, "Q must be > 0")
    if name in INTEGER and not all(isinstance(a, int) for a in args):
        raise _fail(key, text, f"{name} takes integers; for a real range use "
                               f"{'loguniform' if 'log' in name else 'uniform'}")
    if name in ("randint", "lograndint") and high - low < 1:
        raise _fail(key, text, f"{name} excludes HIGH: it needs HIGH > LOW")
    return Dist(name, tuple(args))


def _literal(key: str, text: str, node: ast.AST) -> Any:
    """A literal (number, string, bool, None, list/tuple/dict of them), never evaluated code."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise _fail(key, text, f"{ast.get_source_segment(text, node) or '?'!s} is not a literal value") from None


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _when(key: str, text: str, node: ast.Call) -> When:
    if len(node.args) != 2 or not isinstance(node.args[1], ast.Dict):
        raise _fail(key, text, "when takes a key and a mapping: when(optim.name, {'sgd': uniform(0, 0.9), "
                               "'adamw': 0.0})")
    parent = _dotted(node.args[0])
    if not parent or parent == key:
        raise _fail(key, text, "when's first argument is another key of the space, e.g. optim.name")
    cases = []
    for k, v in zip(node.args[1].keys, node.args[1].values):
        if k is None:
            raise _fail(key, text, "when's mapping cannot unpack another (**)")
        case = _node(key, text, v, top=False) if _call_name(v) else _literal(key, text, v)
        cases.append((_literal(key, text, k), case))
    if not cases:
        raise _fail(key, text, "when's mapping is empty")
    return When(parent, tuple(cases))


def parse_space(space: Mapping[str, Any]) -> dict[str, Dist | When]:
    """Every key parsed, and each when(...) checked against the key it depends on: that key is in
    the space, takes a finite set of values (a list, choice or grid, not itself a when), and every
    one of them has a case."""
    out = {k: parse(k, v) for k, v in space.items()}
    for key, d in out.items():
        if not isinstance(d, When):
            continue
        parent = out.get(d.key)
        if parent is None:
            raise ConfigError(f"tune.space[{key!r}]: when({d.key}, ...) names a key that is not in the space; "
                              f"add tune.space[{d.key!r}]")
        if not isinstance(parent, Dist) or parent.kind not in ("list", *SETS):
            raise ConfigError(f"tune.space[{key!r}]: when({d.key}, ...) needs {d.key!r} to take a list of "
                              f"values, not {parent.text()}")
        missing = [v for v in parent.values if all(v != c for c, _ in d.cases)]
        if missing:
            raise ConfigError(f"tune.space[{key!r}]: when({d.key}, ...) has no case for {d.key}={missing[0]!r}")
    return out


def ordered(space: Mapping[str, Dist | When]) -> list[str]:
    """The keys with every when(...) after the key it depends on (a when never names a when)."""
    return sorted(space, key=lambda k: isinstance(space[k], When))


def _key_probes(d: Dist | When, chosen: Mapping[str, Any]) -> list:
    if isinstance(d, When):
        case = d.case(chosen[d.key])
        return case.probes() if isinstance(case, Dist) else [case]
    return d.probes()


def probe_trials(space: Mapping[str, Dist | When]) -> Iterator[dict[str, Any]]:
    """Trials whose configs validation checks: every combination of the keys' probe values when
    there are at most MAX_PROBES, else each key's probes with the other keys at their first."""
    keys = ordered(space)

    def expand(i: int, chosen: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if i == len(keys):
            yield dict(chosen)
            return
        for v in _key_probes(space[keys[i]], chosen):
            yield from expand(i + 1, {**chosen, keys[i]: v})

    joint = list(itertools.islice(expand(0, {}), MAX_PROBES + 1))
    if len(joint) <= MAX_PROBES:
        yield from joint
        return
    base: dict[str, Any] = {}
    for k in keys:
        base[k] = _key_probes(space[k], base)[0]
    for k in keys:
        for v in _key_probes(space[k], base):
            trial = {**base, k: v}
            for dependent in keys:  # a when that depends on k follows its new value
                d = space[dependent]
                if isinstance(d, When) and d.key == k:
                    trial[dependent] = _key_probes(d, trial)[0]
            yield trial


def grid_size(space: Mapping[str, Dist | When], search: str) -> int:
    """Grid points Tune expands: the product of the grid axes (plain lists under grid search, and
    grid(...) under any search that has axes); each is sampled num_samples times."""
    n = 1
    for d in space.values():
        if isinstance(d, Dist) and (d.kind == "grid" or (d.kind == "list" and search == "grid")):
            n *= len(d.values)
    return n
