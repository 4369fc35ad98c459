"""Credential redaction for everything that leaves the process through MLflow (params, tags, config.json)
and for what vitp prints: the patterns that decide what text looks like a secret, and, through
secret_values.py, every known secret value in any of its forms. Must not import torch, ray or mlflow.
"""
from __future__ import annotations

import re
from typing import Any

from vitp.tracking.secret_values import (REDACTED, URI_PASSWORD, is_secret_key, known_secrets,
                                         mask_known_secrets, remember_secret)

__all__ = ["REDACTED", "is_secret_key", "known_secrets", "redact", "redact_message", "redact_text",
           "redact_value", "remember_secret"]

# Values that are credentials whatever their key is called.
_SECRET_VALUES = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),  # GitHub tokens
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}\b"),  # GitHub fine-grained tokens
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),  # Hugging Face tokens
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),  # Slack tokens
    re.compile(r"\bsk-[A-Za-z0-9_-]{20,}\b"),  # OpenAI-style API keys
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),  # Authorization header values
]
# Query and connection-string parameters that are never prose: a presigned S3/GCS URL's signature,
# an Azure SAS `sig=`, an Azure connection string's AccountKey. The value stops at "&" or ";".
_SIGNED_PARAM = re.compile(
    r"(?<![A-Za-z0-9_.-])(?P<k>X-(?:Amz|Goog)-(?:Signature|Credential|Security-Token)|sig|AccountKey"
    r"|SharedAccessKey)=(?P<v>[^\s&;\"'<>]+)", re.IGNORECASE)
# A command-line flag naming a credential, and its value: `--password x`, `--token=x`, `--db-password "a b"`
# (not `--token-file x`, `--tokenizer x`, nor the next flag: `--auth --port 5000`).
_FLAG = re.compile(
    r"(?<![\w-])(?P<k>--?[A-Za-z0-9_-]*(?:passw(?:or)?d|passphrase|token|secret|api[_-]key|access[_-]key"
    r"|secret[_-]key))(?P<sep>=|\s+)(?P<v>\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|(?!-)\S+)", re.IGNORECASE)
# key=value / key: value pairs inside text (a command line, a query string, an env dump, a config
# printed as JSON or a Python dict), the key a whole word of the text. A quoted value is masked whole
# (`password="a b"`, `"password": "x"`); an unquoted one runs to a blank, "&", ",", a quote, or a ";"
# that starts another pair (`token=ab;cd` is one value, `AccountKey=x;EndpointSuffix=y` two pairs).
_PAIR_WORDS = (r"passw(?:or)?d|passphrase|secret|token|api[_-]?key|access[_-]?key|account[_-]?key|_key"
               r"|signature|connection[_-]?string|_pass|_pat")
_QUOTED = r"\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|\\\"(?:(?!\\\").)*\\\""
_INLINE_PAIR = re.compile(
    rf"(?<![A-Za-z0-9_.-])(?P<k>[A-Za-z0-9_.-]*(?:{_PAIR_WORDS}))(?P<kq>\\?[\"']?)(?P<sep>\s*[=:]\s*)"
    rf"(?P<v>{_QUOTED}|[\"']?(?:[^\s&,;\"']|;(?![A-Za-z_][\w.-]*\s*=))+)",
    re.IGNORECASE,
)


def _masked(value: str) -> str:
    """A matched value as *** inside the quotes it was written with."""
    for q in ('\\"', '"', "'"):
        if value.startswith(q):
            return f"{q}{REDACTED}{q}" if len(value) >= 2 * len(q) and value.endswith(q) else f"{q}{REDACTED}"
    return REDACTED


def redact_text(text: str) -> str:
    """Mask credentials embedded in a string; everything else is returned unchanged."""
    text = redact_message(text)
    return _INLINE_PAIR.sub(lambda m: f"{m.group('k')}{m.group('kq')}{m.group('sep')}{_masked(m.group('v'))}", text)


def redact_message(text: str) -> str:
    """Mask the credentials a message can carry from its input (every known secret value, URI
    passwords, token shapes, signatures, `--password x` flags), not `key: value` pairs: a message's
    own prose says "password: export MLFLOW_..."."""
    out = mask_known_secrets(text)
    out = URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{REDACTED}@", out)
    out = _SIGNED_PARAM.sub(lambda m: f"{m.group('k')}={REDACTED}", out)
    out = _FLAG.sub(lambda m: f"{m.group('k')}{m.group('sep')}{_masked(m.group('v'))}", out)
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
