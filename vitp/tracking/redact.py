"""Credential redaction for everything that leaves the process through MLflow (params, tags, config.json)
and for what vitp prints: the patterns that decide what text looks like a secret, and, through
secret_values.py, every known secret value in any of its forms. Must not import torch, ray or mlflow.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from vitp.tracking.secret_values import (REDACTED, URI_PASSWORD, is_secret_key, known_secrets,
                                         mask_known_secrets, names_a_place, remember_secret)

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
# an Azure SAS `sig=`, an Azure connection string's AccountKey. The value stops at "&" or ";", and
# also at their URL-encoded forms: a connection string or URL passed inside another URL's query
# reads `%3BAccountKey%3Dxxx%3B...`.
_SIGNED_PARAM = re.compile(
    r"(?:(?<![A-Za-z0-9_.-])|(?<=%3B|%26|%3F))"
    r"(?P<k>X-(?:Amz|Goog)-(?:Signature|Credential|Security-Token)|sig|AccountKey|SharedAccessKey)"
    r"(?P<sep>=|%3D)(?P<v>(?:(?!%3B|%26)[^\s&;\"'<>])+)", re.IGNORECASE)
# A command-line flag naming a credential, and its value: `--password x`, `--token=x`, `--db-password "a b"`
# (not `--token-file x`, `--tokenizer x`, nor the next flag: `--auth --port 5000`; after "=" a value
# may start with "-": `--password=-x` is one word).
_FLAG = re.compile(
    r"(?<![\w-])(?P<k>--?[A-Za-z0-9_-]*(?:passw(?:or)?d|passphrase|token|secret|api[_-]key|access[_-]key"
    r"|secret[_-]key))(?P<sep>=|\s+)(?P<v>\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|(?:(?<==)|(?!-))\S+)", re.IGNORECASE)
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

# Forms that give a secret away by their shape alone, for redact_message: the secret need not be
# one this process knows (a line of a credentials file in an error, a header in a library's log).

# A PEM private key, whole: multi-line, squashed onto one line, CRLF, or JSON-escaped ("\n" as two
# characters, as in a GCP service-account key's "private_key"). The body (base64, blanks, escaped
# line ends, an encrypted key's "Proc-Type: 4,ENCRYPTED" headers) is masked up to the END line, or
# as far as it goes when the text was cut before it.
_PEM_KEY = re.compile(
    r"(?P<begin>-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----)(?:[A-Za-z0-9+/=\s,:.]|\\+[nr]|-(?!----))*"
    r"(?P<end>-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----)?")
# A URI password holding a blank or a quote (`postgresql://u:pa ss@host/db`), where URI_PASSWORD
# stops. It runs to the first "@" on its line and does not start as a port does, so a port and a
# later e-mail address are not read as one (`http://host:8080 or bob@example.com`); nor does it run
# past another "://" (which would make a line of many URIs cost O(n^2)).
_URI_ODD_PASSWORD = re.compile(
    r"(?<![A-Za-z0-9+.-])(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@\"'<>]*)"
    r":(?!\d+[^\w@])(?=(?:(?!://)[^\r\n@\s\"'])*[\s\"'])(?:(?!://)[^\r\n@])+"
    r"@(?=[A-Za-z0-9.\[\]-]+(?:[:/?#\s\"'<>]|$))")
# HTTP credential headers, their value up to where the header's own syntax ends (a blank, a quote
# closing it in a curl command or a printed dict), so the rest of a log line stays readable.
# Authorization keeps a known scheme word and masks its credentials: one token ("Basic ***",
# "token ***") and any `, name=value` parameters after it (Digest, AWS SigV4). Without a known
# scheme the whole rest of the value is masked: its first word may be the secret, or a scheme
# before it. A cookie header is masked as its `name=value; ...` list.
_AUTH_SCHEMES = (r"Basic|Bearer|Digest|token|Negotiate|NTLM|OAuth|ApiKey|Key|JWT|SSWS"
                 r"|AWS4-HMAC-SHA256|GOOG4-HMAC-SHA256")
_CREDENTIAL = r"(?:[^\s\"'\\,]|(?<==)\"[^\"\r\n]*\")+"  # a token, or name="quoted value"
_HEADER_SEP = r"(?P<sep>\\?[\"']?[ \t]*:[ \t]*\\?[\"']?)"
_AUTH_HEADER = re.compile(
    rf"(?<![\w-])(?P<k>(?:Proxy-)?Authorization){_HEADER_SEP}"
    rf"(?:(?P<scheme>(?:{_AUTH_SCHEMES})[ \t]+){_CREDENTIAL}(?:,[ \t]*[\w-]+={_CREDENTIAL})*"
    r"|[^\s\"'\\](?:[^\r\n\"'\\]*[^\s\"'\\])?)", re.IGNORECASE)
_COOKIE_HEADER = re.compile(
    rf"(?<![\w-])(?P<k>(?:Set-)?Cookie){_HEADER_SEP}[^\s\"'\\;]+(?:;[ \t]*[^\s\"'\\;]+)*", re.IGNORECASE)
# The password glued to mysql's -p (`mysql -uroot -pSECRET db`), only after a MySQL or MariaDB
# client's name on the same command: elsewhere -p is a port or a flag (`ssh -p2222`, `mkdir -pv`).
# The command ends at the next client name too: each name scans only its own command.
_MYSQL_P = re.compile(
    r"(?P<head>\b(?:mysql\w*|mariadb[\w-]*)\b(?:(?!mysql|mariadb)[^\r\n|;&])*?[ \t]-p)"
    r"(?P<v>\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|[^\s\"']+)")
# A netrc entry's password: after another netrc keyword's value (`machine h login u password X`),
# or alone on its line (a multi-line entry). "the password for ..." in prose is neither.
_NETRC = re.compile(
    r"(?m)(?P<head>(?:(?<![\w-])(?:machine|login|account)[ \t]+\S+[ \t]+|(?P<own>^[ \t]*))password[ \t]+)"
    r"(?P<v>\S+)(?(own)(?=[ \t]*\r?$))")
# A line that sets a credential: `aws_secret_access_key = X` (an AWS credentials file), YAML
# `password: X` (indented, or a list item), `export GITHUB_TOKEN=X`. The key must name a credential
# (is_secret_key) and its value be the rest of the line, one word or one quoted string: words after
# the colon ("password: export MLFLOW_TRACKING_PASSWORD") are a sentence, not a setting.
_SETTING_LINE = re.compile(
    r"(?m)^(?P<head>[ \t]*(?:-[ \t]+|export[ \t]+)?(?P<q>[\"']?)(?P<k>[A-Za-z_][\w.-]*)(?P=q)[ \t]*[:=][ \t]*)"
    r"(?P<v>\"(?:[^\"\\\r\n]|\\.)*\"|'[^'\r\n]*'|[^\s\"']+)(?=[ \t]*,?[ \t]*\r?$)")
# A quoted key naming a credential and its quoted value, anywhere: JSON (a GCP service-account
# key's "private_key" and "private_key_id"), a printed Python dict, JSON escaped inside JSON.
_QUOTED_PAIR = re.compile(rf"(?P<head>(?P<q>\\?[\"'])(?P<k>[A-Za-z_][\w.-]*)(?P=q)[ \t]*:[ \t]*)(?P<v>{_QUOTED})")
# Values of a credential-named key that are not secrets: YAML's and JSON's literals, an empty value,
# a mode (RAY_AUTH_MODE=disabled).
_PLAIN_SCALARS = {"", "true", "false", "null", "none", "~", "yes", "no", "on", "off", "enabled", "disabled"}


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


def _is_setting_of_a_secret(key: str, value: str) -> bool:
    """Whether `key: value` sets a secret: a credential's name, not a place's, and no literal or ${VAR}."""
    bare = value.strip("\\\"'")
    return (is_secret_key(key) and not names_a_place(key) and bare.lower() not in _PLAIN_SCALARS
            and not (bare.startswith("${") and bare.endswith("}")))


def _setting(m: re.Match) -> str:
    """A `key: value` match with its value masked when it sets a secret."""
    if not _is_setting_of_a_secret(m.group("k"), m.group("v")):
        return m.group(0)
    return f"{m.group('head')}{_masked(m.group('v'))}"


# What redact_message replaces after the known secret values, in order: a PEM key first (the rules
# after it would cut its JSON string or base64 body apart), the token shapes last.
_MESSAGE_RULES: list[tuple[re.Pattern, Callable[[re.Match], str]]] = [
    (_PEM_KEY, lambda m: f"{m.group('begin')}{REDACTED}{m.group('end') or ''}"),
    (URI_PASSWORD, lambda m: f"{m.group('head')}:{REDACTED}@"),
    (_URI_ODD_PASSWORD, lambda m: f"{m.group('head')}:{REDACTED}@"),
    (_SIGNED_PARAM, lambda m: f"{m.group('k')}{m.group('sep')}{REDACTED}"),
    (_AUTH_HEADER, lambda m: f"{m.group('k')}{m.group('sep')}{m.group('scheme') or ''}{REDACTED}"),
    (_COOKIE_HEADER, lambda m: f"{m.group('k')}{m.group('sep')}{REDACTED}"),
    (_FLAG, lambda m: f"{m.group('k')}{m.group('sep')}{_masked(m.group('v'))}"),
    (_MYSQL_P, lambda m: f"{m.group('head')}{_masked(m.group('v'))}"),
    (_NETRC, lambda m: f"{m.group('head')}{REDACTED}"),
    (_SETTING_LINE, _setting),
    (_QUOTED_PAIR, _setting),
    *((pat, lambda m: REDACTED) for pat in _SECRET_VALUES),
]


def redact_message(text: str) -> str:
    """Mask known secret values and the forms of _MESSAGE_RULES; prose ("password: export ...") stays."""
    out = mask_known_secrets(text)
    for pattern, replace in _MESSAGE_RULES:
        out = pattern.sub(replace, out)
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
