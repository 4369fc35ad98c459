"""Credential redaction for everything that leaves the process through MLflow (params, tags, config.json).

Owns the patterns that decide what looks like a secret; must not import torch or ray.
"""
from __future__ import annotations

import re
from typing import Any

REDACTED = "***"

# A key whose last component names a credential, as a whole word ("hf_token", "db_password",
# "aws_secret_access_key", "apiKey"), or ends in "_key" ("AZURE_STORAGE_KEY", "ssh_key"), but not
# inside another word ("tokenizer", "author", "monkey"). docs/cluster.md promises *_SECRET_*, *_TOKEN,
# *_PASSWORD and *_KEY. Only *string* values under such keys are redacted: numbers stay visible.
_SECRET_WORD = re.compile(
    r"(^|_)(passw(or)?d|pwd|secrets?|tokens?|credentials?|auth|api_?key|access_?key|private_?key"
    r"|secret_?key|session_?key)(_|$)|_key$"
)
# Values that are credentials whatever their key is called.
_SECRET_VALUES = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),  # GitHub tokens
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),  # Hugging Face tokens
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),  # Slack tokens
    re.compile(r"\bsk-[A-Za-z0-9_-]{20,}\b"),  # OpenAI-style API keys
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),  # Authorization header values
]
# scheme://user:password@host -> scheme://user:***@host (keeps the host, which is useful). The
# password runs to the next "@": cloud secret keys hold "/" and "+", often not percent-encoded.
_URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<pw>[^@\s]+)@")
# key=value pairs inside a string, e.g. a command line or query string: "...&token=abc".
_INLINE_PAIR = re.compile(
    r"(?P<k>[A-Za-z0-9_.-]*(?:passw(?:or)?d|secret|token|api[_-]?key|access[_-]?key|_key))"
    r"(?P<sep>\s*[=:]\s*)(?P<v>[^\s&,;\"']+)",
    re.IGNORECASE,
)


def is_secret_key(key: str) -> bool:
    """True when the last dotted component of `key` names a credential ("s3.secret_key")."""
    last = str(key).rsplit(".", 1)[-1]
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", last).lower().replace("-", "_")  # apiKey -> api_key
    return bool(_SECRET_WORD.search(words))


def redact_text(text: str) -> str:
    """Mask credentials embedded in a string; everything else is returned unchanged."""
    return redact_message(_INLINE_PAIR.sub(lambda m: f"{m.group('k')}{m.group('sep')}{REDACTED}", text))


def redact_message(text: str) -> str:
    """Mask the credentials a message can carry from its input (URI passwords, token shapes), not
    `key: value` pairs: a message's own prose says "password: export MLFLOW_..."."""
    out = _URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)
    for pat in _SECRET_VALUES:
        out = pat.sub(REDACTED, out)
    return out


def redact_value(key: str, value: Any) -> Any:
    """Redact one value given the key it is stored under; recurses into dicts and lists."""
    if isinstance(value, dict):
        return {k: redact_value(f"{key}.{k}" if key else str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(key, v) for v in value]
    if isinstance(value, str):
        if value and is_secret_key(key):
            return REDACTED
        return redact_text(value)
    return value


def redact(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of `d` (flat or nested) with every credential-looking value replaced by "***"."""
    return {k: redact_value(str(k), v) for k, v in d.items()}
