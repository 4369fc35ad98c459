"""Which names and values are secrets: credential names (is_secret_key), and the process-wide registry
of secret values (from this environment, and from code that forwards one) that every redaction masks
wherever it appears: as written, URL-encoded, JSON-escaped or base64-encoded (mask_known_secrets).
Standard library only: every Ray worker's tracking code imports it.
"""
from __future__ import annotations

import base64
import functools
import json
import os
import re
import threading
from urllib.parse import quote, quote_plus, unquote

REDACTED = "***"

# A key whose last component names a credential, as a whole word ("hf_token", "db_password",
# "aws_secret_access_key", "apiKey"), or ends in "_key" ("AZURE_STORAGE_KEY", "ssh_key"), "_pass"
# ("DB_PASS") or "_pat" ("GITHUB_PAT"), but not inside another word ("tokenizer", "author", "monkey",
# "passes", "pattern", "compass"). "password", "passphrase" and "connection string" count anywhere
# in the name: PGPASSWORD, KEY_PASSPHRASE, AZURE_STORAGE_CONNECTION_STRING; so do "accesstoken"
# (MYACCESSTOKEN) and "_jwt" (GitLab's CI_JOB_JWT); a webhook URL (SLACK_WEBHOOK_URL) is itself the
# credential that lets anyone post. docs/cluster.md promises *_SECRET_*, *_TOKEN, *_PASSWORD and
# *_KEY. Only *string* values are redacted by key.
_SECRET_WORD = re.compile(
    r"(^|_)(pwd|secrets?|tokens?|credentials?|auth|api_?key|access_?key|private_?key|secret_?key"
    r"|session_?key|account_?key|conn_?str)(_|$)|_key$|(^|_)(pass|pat)$"
    r"|passw(or)?d|passphrase|connection_?string"
    r"|accesstoken|_jwt|^jwts?$|(^|_)webhook_?url$"
)
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")


@functools.lru_cache(maxsize=4096)  # the same few hundred config keys and env names, again and again
def _names_credential(last: str) -> bool:
    words = _CAMEL.sub(r"\1_\2", last).lower().replace("-", "_")  # apiKey -> api_key
    return bool(_SECRET_WORD.search(words))


def is_secret_key(key: str) -> bool:
    """True when the last dotted component of `key` names a credential ("s3.secret_key", "PGPASSWORD")."""
    return _names_credential(str(key).rsplit(".", 1)[-1])


# scheme://user:password@host. The password runs to the *last* "@" of the word ("p@ss@host" holds the
# password "p@ss"): generated passwords hold "@", cloud secret keys "/" and "+", often not
# percent-encoded. The scheme starts a word: tried at every letter of a long word, it cost O(n^2).
URI_PASSWORD = re.compile(
    r"(?<![A-Za-z0-9+.-])(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@\"'<>]*)"
    r":(?P<pw>[^\s\"'<>]+)@(?=[^\s\"'<>@]*(?:[\s\"'<>]|$))"
)

# Values shorter than this are not masked wherever they appear: "1", "true" or "testing" (moto's fake
# keys) would be masked in every line. 8 is the usual least length of a password; shorter secrets are
# still masked where their key or shape says so.
MIN_SECRET_LEN = 8
_NOT_SECRET_VALUES = {"disabled", "enabled", "required", "optional", "password", "changeme"}
# Environment names that match a credential word but hold a place, not a secret: the working
# directory (PWD), a file or socket (RAY_AUTH_TOKEN_PATH, SSH_AUTH_SOCK, AWS_SHARED_CREDENTIALS_FILE).
_PLACE_NAME = re.compile(r"^(OLD)?PWD$|_(PATH|FILE|DIR|SOCK|SOCKET)$", re.IGNORECASE)


def names_a_place(name: str) -> bool:
    """True for a credential-like name that holds a place, not a secret (RAY_AUTH_TOKEN_PATH, PWD)."""
    return bool(_PLACE_NAME.search(name))


def _worth_masking(value: str) -> bool:
    """Whether a secret value is masked wherever it appears (MIN_SECRET_LEN, not a number, a common
    word or an existing absolute path: those would mask innocent text everywhere)."""
    return (len(value) >= MIN_SECRET_LEN and not value.isdigit() and value.lower() not in _NOT_SECRET_VALUES
            and not (value.startswith(("/", "~")) and os.path.exists(os.path.expanduser(value))))


def _b64_forms(raw: bytes) -> set[str]:
    """Base64 of `raw` alone, and the part of it fixed by `raw` alone at each of the 3 alignments it
    can have inside a longer encoded string (e.g. "user:password" in a Basic auth header)."""
    out = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        whole = encode(raw).decode()
        out.update({whole, whole.rstrip("=")})
        for shift in range(3):
            text = encode(b"\0" * shift + raw).decode()
            out.add(text[-(-shift * 8 // 6):(shift + len(raw)) * 8 // 6])
    return out


def _forms(value: str) -> set[str]:
    """Every way `value` is written where it leaks: as is, URL-encoded (a URI, a form), JSON-escaped,
    base64."""
    forms = {value, quote(value, safe=""), quote(value), quote_plus(value),
             json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    forms |= _b64_forms(value.encode())
    return {f for f in forms if len(f) >= MIN_SECRET_LEN}


class _Registry:
    """The known secret values and one regex of all their forms, compiled on first use after a change."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # read_environ holds it while add() takes it
        self.values: set[str] = set()
        self.pattern: re.Pattern | None = None
        self.stale = False
        self.environ: object = None  # the environment last read (its items, as a tuple)

    def add(self, value: str) -> None:
        if isinstance(value, str) and _worth_masking(value) and value not in self.values:
            with self.lock:
                self.values.add(value)
                self.stale = True

    def read_environ(self) -> None:
        """Take the secrets of os.environ when it changed since the last call (a cheap comparison)."""
        data = getattr(os.environ, "_data", None)
        now = tuple(data.items()) if isinstance(data, dict) else tuple(os.environ.items())
        if now == self.environ:
            return
        with self.lock:  # another thread sees the new environment only once its secrets are in
            for name, value in list(os.environ.items()):
                if is_secret_key(name) and not names_a_place(name):
                    self.add(value)
                add_uri_passwords(value)  # MLFLOW_BACKEND_STORE_URI, DATABASE_URL, http_proxy, ...
            self.environ = now

    def compiled(self) -> re.Pattern | None:
        self.read_environ()
        if self.stale:
            with self.lock:
                forms = sorted({f for v in self.values for f in _forms(v)}, key=lambda f: (-len(f), f))
                self.pattern = re.compile("|".join(map(re.escape, forms))) if forms else None
                self.stale = False
        return self.pattern


_REGISTRY = _Registry()


def remember_secret(value: str) -> None:
    """Mask `value` (a password, token or key this process was given or forwards) in everything the
    redaction functions see from now on; values under MIN_SECRET_LEN, numbers and existing paths are
    not remembered."""
    _REGISTRY.add(value)


def add_uri_passwords(text: str) -> None:
    """Remember the password of every `scheme://user:password@host` in `text`, as written and
    percent-decoded (a URI holds it encoded, an error message may print it decoded)."""
    for m in URI_PASSWORD.finditer(text):
        _REGISTRY.add(m.group("pw"))
        _REGISTRY.add(unquote(m.group("pw")))


def known_secrets() -> frozenset[str]:
    """The secret values masked by value now (this environment's included)."""
    _REGISTRY.read_environ()
    with _REGISTRY.lock:
        return frozenset(_REGISTRY.values)


def mask_known_secrets(text: str) -> str:
    """`text` with every form of every known secret value replaced by ***."""
    pattern = _REGISTRY.compiled()
    return pattern.sub(REDACTED, text) if pattern is not None and text else text
