"""The token of the local Rays that this user's vitp commands start (connect.py): a file only this
user can read, <tmp>/vitp-<uid>/ray/auth_token (0600 from its first byte, in the 0700 folder of
vitp.paths.private_dir), handed to Ray by its own RAY_AUTH_TOKEN_PATH, instead of the
~/.ray/auth_token Ray would write for any local user to read. No ray import.
"""
# Ray 2.60 turns token authentication on for every new local Ray (ray.init without an address) and,
# where it finds no token (RAY_AUTH_TOKEN, then RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token), writes
# a new one to ~/.ray/auth_token with a plain open(path, "w") (ray/_private/authentication/
# authentication_token_setup.py, generate_and_save_token): 0644 under the usual umask 022, in a 0755
# ~/.ray, so any user of the machine could read it and run code as you through that Ray. Ray's
# loader reads RAY_AUTH_TOKEN_PATH before the home folder and, that variable set, never writes one.
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
from typing import Mapping

from vitp.errors import InputError
from vitp.paths import private_dir, user_tmp
from vitp.tracking.redact import remember_secret

AUTH_MODE = "RAY_AUTH_MODE"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
TOKEN_VARS = ("RAY_AUTH_TOKEN", TOKEN_PATH)  # a token of the user's own choosing, where set


def token_path() -> str:
    """<tmp>/vitp-<uid>/ray/auth_token (its folder made and checked private; the file may not exist)."""
    return os.path.join(private_dir(os.path.join(user_tmp(), "ray")), "auth_token")


def private_token() -> str:
    """token_path(), made once: 64 hex digits (the kind of token Ray makes) written to a new 0600
    file (mkstemp: O_EXCL, mode 0600 whatever the umask) and hard-linked into place, so nobody ever
    reads a part-written token and a token already there is never replaced (a running Ray holds it).
    One already there must be a non-empty regular file of this user's (a link is not followed); any
    group or other permission on it is taken away. Anything else: InputError naming it and the fix."""
    path = token_path()
    if not os.path.lexists(path):
        _write_new(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise _refused(path, "is a symlink" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, "is not a regular file")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise _refused(path, f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
        if st.st_size == 0:
            raise _refused(path, "is empty")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)  # ours: made private (a chmod, a copy)
    finally:
        os.close(fd)
    return path


def _write_new(path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".auth_token-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another vitp command made it meanwhile: that one is the token
        except OSError:  # a file system without hard links: create it in place, still O_EXCL and 0600
            with contextlib.suppress(FileExistsError):
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with open(tmp) as src, os.fdopen(out, "w") as f:
                    f.write(src.read())
    finally:
        os.unlink(tmp)


def local_auth_env(environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The environment a new local Ray takes its token from (private_token()), and the one line that
    says so; ({}, "") where the user chose otherwise: RAY_AUTH_MODE set to anything but `token`
    (e.g. disabled), or a token of their own in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH."""
    environ = os.environ if environ is None else environ
    mode = environ.get(AUTH_MODE)
    if (mode is not None and mode.strip().lower() != "token") or any(environ.get(k, "").strip() for k in TOKEN_VARS):
        return {}, ""
    path = private_token()
    with open(path) as f:
        remember_secret(f.read().strip())  # masked in whatever this process prints or logs
    return {TOKEN_PATH: path}, f"local Ray: token auth on, its token in {path} (0600, in a 0700 folder: yours only)"


def _refused(path: str, problem: str) -> InputError:
    return InputError(f"{path} {problem}: vitp keeps the token of its local Ray there and needs a private "
                      "file of yours; remove it (vitp then writes a new one), or set TMPDIR to a directory of "
                      "your own")
