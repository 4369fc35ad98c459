"""Names that become path components: a run, sweep, experiment, dataset or registered model name
ends up in <work_dir>/runs/<name>, <tmp>/vitp-ckpt-staging/<name>, an S3 key, ... . Checked where
they enter (config validation, the CLI), so none can point outside the directory it names a part
of. Must not import anything from `vitp` but errors.
"""
from __future__ import annotations

from .errors import ConfigError

MAX_LEN = 128


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a name, or None: no path separators, no leading dot (so neither "."
    nor "..") or dash (read as an option), no control characters, at most MAX_LEN characters."""
    if not value:
        return "is empty"
    if len(value) > MAX_LEN:
        return f"is {len(value)} characters long (at most {MAX_LEN})"
    bad = sorted({c for c in value if c in "/\\" or ord(c) < 32 or ord(c) == 127})
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
    return f"{what}={value!r} {problem}; use letters, digits, '.', '_' and '-' (e.g. b16-run_1)"


def check_name(what: str, value: str) -> str:
    """`value` if it is a valid name, else ConfigError (name_error)."""
    error = name_error(what, value)
    if error:
        raise ConfigError(error)
    return value
