"""Names that become path components: a run, sweep, experiment, dataset or registered model name
ends up in <work_dir>/runs/<name>, <tmp>/vitp-<uid>/ckpt-staging/<name>, an S3 key, ... . Checked
where they enter (config validation, the CLI), so none can point outside the directory it names a part
of, hide what it says, or overflow a filesystem's component limit. Imports nothing from `vitp` but errors.
"""
from __future__ import annotations

import unicodedata

from .errors import ConfigError

MAX_LEN = 128  # bytes of UTF-8: many filesystems cap one path component at 255 bytes, not characters

# Unicode categories no name holds: controls (C0, DEL and C1), formatting characters (bidi marks and
# overrides, zero-width joiners, the BOM, soft hyphen), line and paragraph separators, and lone surrogates
# (not encodable). Formatting characters make a name read differently from the bytes it is.
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
# Named as well, so the rule holds should a Unicode version move one of them: the bidi marks, embeddings,
# overrides and isolates, the Arabic letter mark, and the zero-width characters.
REFUSED_CHARS = frozenset(
    "\u200e\u200f\u061c" + "".join(map(chr, range(0x202A, 0x202F))) + "".join(map(chr, range(0x2066, 0x206A)))
    + "\u200b\u200c\u200d\u2060\ufeff")


def _hidden(c: str) -> bool:
    """Whether character `c` is a control, invisible formatting or separator character."""
    return unicodedata.category(c) in REFUSED_CATEGORIES or c in REFUSED_CHARS


def _describe(c: str) -> str:
    return f"{c!r} (U+{ord(c):04X}{' ' + unicodedata.name(c) if unicodedata.name(c, '') else ''})"


def hidden_problem(value: str, what: str = "a name") -> str | None:
    """"contains ...: ..." naming up to three control, invisible formatting or separator characters
    of `value` (the characters no name holds; also refused in MLflow tags), or None."""
    hidden = sorted({c for c in value if _hidden(c)})
    if not hidden:
        return None
    return (f"contains {', '.join(_describe(c) for c in hidden[:3])}: {what} holds no control, invisible "
            "formatting (bidi, zero-width) or line-separator characters")


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a name, or None: no path separators, no leading dot (so neither "."
    nor "..") or dash (read as an option), no control, invisible formatting (bidi, zero-width) or
    line-separator characters, at most MAX_LEN bytes of UTF-8."""
    if not value:
        return "is empty"
    hidden = hidden_problem(value)
    if hidden:
        return hidden
    size = len(value.encode("utf-8"))
    if size > MAX_LEN:
        return f"is {size} bytes long in UTF-8 (at most {MAX_LEN}: a path component's limit is counted in bytes)"
    bad = sorted({c for c in value if c in "/\\"})
    if bad:
        return f"contains {', '.join(repr(c) for c in bad)}: a name is one path component"
    if value[0] in ".-":
        return f"starts with {value[0]!r}"
    return None


def name_error(what: str, value: str) -> str | None:
    """The one-line refusal of `value` as `what` (e.g. "--name", "tracking.run_name"), or None."""
    problem = name_problem(value)
    if problem is None:
        return None
    shown = value if len(value) <= 2 * MAX_LEN else value[:MAX_LEN] + "..."
    return f"{what}={shown!r} {problem}; use letters, digits, '.', '_' and '-' (e.g. b16-run_1)"


def check_name(what: str, value: str) -> str:
    """`value` if it is a valid name, else ConfigError (name_error)."""
    error = name_error(what, value)
    if error:
        raise ConfigError(error)
    return value
