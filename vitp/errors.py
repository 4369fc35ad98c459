"""The failures a user can cause, and the exit code each one ends `vitp` with.

Every message names the input and the fix, in one line; `vitp` prints it without a traceback
(`--debug` shows one). Anything else that escapes a command is a bug in this package.
Must not import anything from `vitp` (every layer raises these).
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix: a config value, a path, a file. `vitp` exits with `exit_code`."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config value is wrong; the message names the field and how to fix it."""


class InputError(UserError, ValueError):
    """A path or file given by the user is missing, unreadable or of the wrong kind."""


class ClusterError(UserError, RuntimeError):
    """The Ray cluster (or its Jobs API) cannot be reached or refused the request."""

    exit_code = 3
