"""The kinds of rule a config key's value follows (rules.py holds the table of which key follows which):
a number in a range, a choice, a flag, a name, a path, free text or a check of its own (MLflow tags: tags.py).
Each says why a value is refused in one line naming the key, and gives values it refuses and accepts.
No torch or ray.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import unicodedata
from typing import Any, Callable

from ..names import name_error
from ..storage import has_credentials, is_uri


class Rule:
    """One key's rule: `problem` is the one-line refusal of a value (None when it passes); `outside`
    and `inside` are values it refuses and accepts (the tests plant them)."""

    what = ""

    def problem(self, key: str, value: Any) -> str | None:
        raise NotImplementedError

    def outside(self) -> list:
        return []

    def inside(self) -> list:
        return []


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else f"{x:g}"


def _exact(x: float) -> str:
    """_num, or the float's repr where the short form would be another number (2.22507e-308)."""
    return _num(x) if float(_num(x)) == x else repr(x)


NORMAL_MIN = sys.float_info.min  # 2.2e-308, the smallest normal float64: below it digits are lost (subnormals)


@dataclasses.dataclass(frozen=True)
class Number(Rule):
    """A finite int or float in [lo, hi] (either end open). `below`/`above` say what a value under or
    over the range must be (default: the range); `why` follows the message for a value below it.
    A float other than 0 must be at least `least` in magnitude: by default the smallest normal float
    (optim.lr=1e-320 is in (0, 10], and a subnormal), or a rule's own sane minimum (`least_why` says
    why)."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    below: str = ""
    above: str = ""
    why: str = ""
    optional: bool = False  # None allowed
    least: float = NORMAL_MIN
    least_why: str = "(the smallest normal float; a smaller one is subnormal)"

    @property
    def span(self) -> str:
        """"8..4096" for an int range, "[0, 1)" for a float one (also an int's with an infinite end)."""
        if self.integer and math.isfinite(self.lo) and math.isfinite(self.hi):  # an open end: the next int
            return f"{_num(self.lo + self.lo_open)}..{_num(self.hi - self.hi_open)}"
        return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"

    @property
    def allowed(self) -> str:
        """The span, and a float's own minimum where it has one: "(0, 10], at least 1e-10"."""
        if self.integer or self.least == NORMAL_MIN:
            return self.span
        return f"{self.span}, {'0 or ' if self._zero_ok else ''}at least {_exact(self.least)}"

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"{'int' if self.integer else 'float'} in {self.allowed}{' or none' if self.optional else ''}"

    @property
    def _zero_ok(self) -> bool:
        return not self._out_of_range(0.0)

    def _out_of_range(self, value: float) -> bool:
        return (value < self.lo or (self.lo_open and value == self.lo)
                or value > self.hi or (self.hi_open and value == self.hi))

    def problem(self, key: str, value: Any) -> str | None:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return f"{key}={value!r}: expected {'an integer' if self.integer else 'a number'}"
        if isinstance(value, float) and not math.isfinite(value):  # (an int is finite, and may not fit a float)
            return f"{key}={value}: must be a finite number"
        low = value < self.lo or (self.lo_open and value == self.lo)
        high = value > self.hi or (self.hi_open and value == self.hi)
        if not (low or high):
            if isinstance(value, float) and value != 0 and abs(value) < self.least:
                return (f"{key}={value}: must be {'0 or ' if self._zero_ok else ''}at least {_exact(self.least)}"
                        f"{' in magnitude' if self.lo < 0 else ''} {self.least_why}")
            return None
        says = (self.below if low else self.above) or f"must be in {self.span}"
        why = f" {self.why}" if self.why and not (high and self.above) else ""
        return f"{key}={value}: {says}{why}"

    def _step(self, x: float, up: bool) -> float:
        return x + (1 if up else -1) if self.integer else math.nextafter(x, math.inf if up else -math.inf)

    def _tiny(self) -> list:
        """Floats inside the range but nearer 0 than `least` (the smallest subnormal among them)."""
        if self.integer:
            return []
        under = math.nextafter(self.least, 0.0)
        return [v for v in dict.fromkeys((under, 5e-324, -under)) if not self._out_of_range(v)]

    def outside(self) -> list:
        out = [math.nan] if not self.integer else []
        if math.isfinite(self.lo):
            out.append(self.lo if self.lo_open else self._step(self.lo, False))
        if math.isfinite(self.hi):
            out.append(self.hi if self.hi_open else self._step(self.hi, True))
        return out + self._tiny()

    def inside(self) -> list:
        ends = []
        if math.isfinite(self.lo):
            low = self._step(self.lo, True) if self.lo_open else self.lo
            ends.append(self.least if not self.integer and 0 < low < self.least else low)
        if math.isfinite(self.hi):
            ends.append(self._step(self.hi, False) if self.hi_open else self.hi)
        if not self.integer and self.least != NORMAL_MIN and not self._out_of_range(self.least):
            ends.append(self.least)
        return list(dict.fromkeys(ends)) + ([None] if self.optional else [])


def ints(lo: int, hi: int, why: str = "", say: str = "") -> Number:
    """An int whose whole range is its meaning: "must be in lo..hi"."""
    return Number(lo, hi, integer=True, why=why, below=say, above=say)


def _least(least: float | None, least_why: str) -> dict:
    return {} if least is None else {"least": least, "least_why": least_why}


def floats(span: str, why: str = "", least: float | None = None, least_why: str = "") -> Number:
    """A float in an interval written as it reads: "[0, 1)", "(0, 1]", "[0, inf)"; other than 0, at
    least `least` (default: the smallest normal float)."""
    m = re.fullmatch(r"([\[(])\s*(\S+),\s*(\S+)\s*([\])])", span)
    assert m, span
    return Number(float(m[2]), float(m[3]), lo_open=m[1] == "(", hi_open=m[4] == ")", why=why,
                  **_least(least, least_why))


def positive(cap: float, integer: bool = False, say: str = "must be > 0", least: float | None = None,
             least_why: str = "") -> Number:
    """Above 0 (`say` for a value at or below it) and at most `cap`, a guard against absurd values; a
    float at least `least` (default: the smallest normal float), a sane minimum."""
    return Number(0, cap, lo_open=True, integer=integer, below=say, above=f"must be at most {_num(cap)}",
                  **_least(least, least_why))


def count(cap: int, lo: int = 0, why: str = "") -> Number:
    """An int from `lo` (0 often meaning off / derived: `why`) to `cap`, a guard against absurd values."""
    return Number(lo, cap, integer=True, below=f"must be >= {lo}", above=f"must be at most {cap}", why=why)


@dataclasses.dataclass(frozen=True)
class Choice(Rule):
    """One of a fixed set (a Literal key's choices)."""

    values: tuple

    @property
    def what(self) -> str:  # type: ignore[override]
        return "one of " + ", ".join(repr(v) for v in self.values)

    def problem(self, key: str, value: Any) -> str | None:
        return None if value in self.values else f"{key}={value!r} is not allowed: use {self.what}"

    def outside(self) -> list:
        return ["no-such-choice"]

    def inside(self) -> list:
        return list(self.values)


class Flag(Rule):
    what = "true or false"

    def problem(self, key: str, value: Any) -> str | None:
        return None if isinstance(value, bool) else f"{key}={value!r}: expected true or false"

    def outside(self) -> list:
        return ["yes"]

    def inside(self) -> list:
        return [True, False]


def _control(text: str) -> str | None:
    return next((c for c in text if unicodedata.category(c) == "Cc"), None)


@dataclasses.dataclass(frozen=True)
class Name(Rule):
    """A name that becomes a path component (vitp/names.py); "" allowed where it means "derived"."""

    empty_ok: bool = False

    @property
    def what(self) -> str:  # type: ignore[override]
        return "a name (one path component, vitp/names.py)" + (" or ''" if self.empty_ok else "")

    def problem(self, key: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"{key}={value!r}: expected a string"
        return None if self.empty_ok and value == "" else name_error(key, value)

    def outside(self) -> list:
        return ["../x", "a\u202eb", "\u00e9" * 65] + ([] if self.empty_ok else [""])

    def inside(self) -> list:
        return ["b16-run_1"] + ([""] if self.empty_ok else [])


MAX_PATH_BYTES = 4096  # Linux PATH_MAX; object-storage keys are shorter still (S3: 1024)
CREDENTIALS = ("a storage URI with credentials in it (user:password@) is refused: give the bucket as s3://bucket/path "
               "and the credentials through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the nodes' own role)")


@dataclasses.dataclass(frozen=True)
class Path(Rule):
    """A local path or URI: printed, logged and recorded with every run, so no credentials in it
    (refused without repeating it) and no control characters; "" = unset unless `required`."""

    required: bool = False
    not_root: bool = False  # a folder vitp writes into (work_dir): never the filesystem root
    what = "a local path or URI, no credentials or control characters"

    def problem(self, key: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"{key}={value!r}: expected a string"
        if has_credentials(value):
            return f"{key}: {CREDENTIALS}"
        if self.required and not value.strip():
            return f"{key}={value!r}: give a path or URI"
        c = _control(value)
        if c is not None:
            return f"{key}={value!r} contains the control character {c!r}: give the path as it is"
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_PATH_BYTES:
            return f"{key}: a path of {size} bytes (at most {MAX_PATH_BYTES})"
        if self.not_root and filesystem_root(value):
            return (f"{key}={value!r} is the filesystem root: vitp writes synth/, shards/, runs/ and mlflow.db "
                    "straight into it; give a folder of its own, e.g. /data/vitp-work")
        return None

    def outside(self) -> list:
        return (["s3://KEY:SECRET@bucket/x", "a\x00b", "/" + "p" * MAX_PATH_BYTES]
                + (["", " "] if self.required else []) + (["/", "//", "/tmp/..", "file:///"] if self.not_root else []))

    def inside(self) -> list:
        return (["/data/x", "s3://bucket/x"] + ([] if self.required else [""])
                + (["s3://bucket"] if self.not_root else []))  # a bucket's root is a folder of its own


def filesystem_root(path: str) -> bool:
    """Whether local `path` (or a file:// URI) is the filesystem root once symlinks, `.` and `..` are
    resolved ("/", "//", "/tmp/..", a link to "/"); a bucket (s3://bucket) is not."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif is_uri(path) or not path.strip():
        return False
    real = os.path.realpath(path)
    return os.path.dirname(real) == real


class NameOrPath(Path):
    """A few-shot dataset: a bare name (<work_dir>/shards/<name>) or, with a "/", a path or URI."""

    what = "a name, or (with a '/') a path or URI"

    def problem(self, key: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"{key}={value!r}: expected a string"
        if "/" in value:
            return super().problem(key, value)
        return name_error(key, value.strip()) if value.strip() else None  # "" entries are skipped

    def outside(self) -> list:
        return ["..", "-x", "a\u200bb", "s3://KEY:SECRET@bucket/x"]

    def inside(self) -> list:
        return ["digits", "/data/shards/pets", ""]


@dataclasses.dataclass(frozen=True)
class Each(Rule):
    """Every element of a tuple follows `rule`; `length` when the schema fixes it. `indexed`: an
    element's message names it as key[i]."""

    rule: Rule
    length: int | None = None
    indexed: bool = True

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"each {self.rule.what}"

    def problem(self, key: str, value: Any) -> str | None:
        if not isinstance(value, (tuple, list)):
            return f"{key}={value!r}: expected a list"
        if self.length is not None and len(value) != self.length:
            return f"{key}={value!r}: expected exactly {self.length} values"
        for i, v in enumerate(value):
            problem = self.rule.problem(f"{key}[{i}]" if self.indexed else key, v)
            if problem:
                return problem
        return None

    def outside(self) -> list:
        n, good = self.length or 1, self.rule.inside()[0]
        return [tuple([good] * (n - 1) + [bad]) for bad in self.rule.outside()]

    def inside(self) -> list:
        return [tuple([v] * (self.length or 1)) for v in self.rule.inside()]


@dataclasses.dataclass(frozen=True)
class Text(Rule):
    """Free text, documented as free: only control characters (they garble logs) and a length limit."""

    max_bytes: int
    nonempty: bool = False

    @property
    def what(self) -> str:  # type: ignore[override]
        return f"free text, at most {self.max_bytes} bytes{', not empty' if self.nonempty else ''}"

    def problem(self, key: str, value: Any) -> str | None:
        if not isinstance(value, str):
            return f"{key}={value!r}: expected a string"
        if self.nonempty and not value.strip():
            return f"{key}={value!r}: must not be empty"
        c = _control(value)
        if c is not None:
            return f"{key}={value!r} contains the control character {c!r}"
        size = len(value.encode("utf-8", "surrogatepass"))
        return f"{key}: {size} bytes long (at most {self.max_bytes})" if size > self.max_bytes else None

    def outside(self) -> list:
        return ["a\x00b", "x" * (self.max_bytes + 1)] + (["", " "] if self.nonempty else [])

    def inside(self) -> list:
        return ["x"] + ([] if self.nonempty else [""])


@dataclasses.dataclass(frozen=True)
class Check(Rule):
    """A rule of its own: `check(key, value)` gives the refusal; `bad` and `good` are examples."""

    check: Callable[[str, Any], "str | None"]
    what: str = ""  # type: ignore[misc]
    bad: tuple = ()
    good: tuple = ()

    def problem(self, key: str, value: Any) -> str | None:
        return self.check(key, value)

    def outside(self) -> list:
        return list(self.bad)

    def inside(self) -> list:
        return list(self.good)


@dataclasses.dataclass(frozen=True)
class Elsewhere(Check):
    """A key checked by a named function outside this table (its message is that function's)."""

    check: Callable[[str, Any], "str | None"] = lambda key, value: None
