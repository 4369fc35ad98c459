"""Secrets that redact_message masks by their form alone (issue 75, item 5).

Each row plants fresh random secrets that this process does not hold: no credential name is left
in os.environ and the registry of known secret values starts empty, so masking by value cannot
hide a form that the shape-based rules miss.
"""
import base64
import os
import secrets
from urllib.parse import quote

import pytest

from vitp.tracking import secret_values
from vitp.tracking.redact import REDACTED, is_secret_key, known_secrets, redact, redact_message

# form, text ({s}: a URL-safe secret, {b}: a base64 one, {q}: {b} URL-encoded), what must stay
FORMS = [
    ("authorization basic", "401 for Authorization: Basic {b} (user bob)",
     ["Authorization: Basic ***", "(user bob)"]),
    ("authorization bearer, lower case", "authorization: bearer {s}", ["authorization: bearer ***"]),
    ("authorization token in curl", 'curl -H "Authorization: token {s}" https://api.github.com/user',
     ['"Authorization: token ***" https://api.github.com/user']),
    ("authorization without a scheme", "Authorization: {s}", ["Authorization: ***"]),
    ("authorization digest", 'Authorization: Digest username="bob", response="{s}", nonce="{b}"',
     ["Authorization: Digest ***"]),
    ("authorization in a printed dict", "headers={{'Authorization': 'Bearer {s}', 'Accept': 'json'}}",
     ["{'Authorization': 'Bearer ***', 'Accept': 'json'}"]),
    ("proxy-authorization", "PROXY-AUTHORIZATION: Basic {b}\nHost: proxy.internal",
     ["PROXY-AUTHORIZATION: Basic ***\nHost: proxy.internal"]),
    ("cookie", "sent Cookie: sessionid={s}; theme=dark to web.internal", ["sent Cookie: ***", "to web.internal"]),
    ("set-cookie", "Set-Cookie: session={s}; Path=/; HttpOnly", ["Set-Cookie: ***"]),
    ("pem, multi-line", "-----BEGIN RSA PRIVATE KEY-----\n{b}\n{b}\n-----END RSA PRIVATE KEY-----\nnext line",
     ["-----BEGIN RSA PRIVATE KEY-----***-----END RSA PRIVATE KEY-----\nnext line"]),
    ("pem, one line", "key -----BEGIN PRIVATE KEY----- {b} {b} -----END PRIVATE KEY----- loaded",
     ["key -----BEGIN PRIVATE KEY-----***-----END PRIVATE KEY----- loaded"]),
    ("pem, CRLF", "-----BEGIN OPENSSH PRIVATE KEY-----\r\n{b}\r\n-----END OPENSSH PRIVATE KEY-----\r\n",
     ["-----BEGIN OPENSSH PRIVATE KEY-----***-----END OPENSSH PRIVATE KEY-----\r\n"]),
    ("pem, encrypted", "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"
     "DEK-Info: AES-128-CBC,6B0B3B7C6B3F4E2D0A9C8E7F6A5B4C3D\n\n{b}\n-----END RSA PRIVATE KEY-----",
     ["-----BEGIN RSA PRIVATE KEY-----***-----END RSA PRIVATE KEY-----"]),
    ("pem, cut before its END", "key: -----BEGIN EC PRIVATE KEY-----\n{b}",
     ["key: -----BEGIN EC PRIVATE KEY-----***"]),
    ("gcp service-account json", '{{"type": "service_account", "private_key_id": "{s}", "private_key": '
     '"-----BEGIN PRIVATE KEY-----\\n{b}\\n-----END PRIVATE KEY-----\\n", '
     '"client_email": "a@p.iam.gserviceaccount.com"}}',
     ['"type": "service_account", "private_key_id": "***", "private_key": "***", '
      '"client_email": "a@p.iam.gserviceaccount.com"']),
    ("pem, JSON-escaped", '{{"pem": "-----BEGIN PRIVATE KEY-----\\n{b}\\n{b}\\n-----END PRIVATE KEY-----\\n"}}',
     ['{"pem": "-----BEGIN PRIVATE KEY-----***-----END PRIVATE KEY-----\\n"}']),
    ("mysql -p", "mysql -h db.internal -uroot -p{s} mlflow", ["mysql -h db.internal -uroot -p*** mlflow"]),
    ("mysqldump --password=", "mysqldump --password=-{s} --host=db.internal mlflow",
     ["mysqldump --password=*** --host=db.internal mlflow"]),
    ("netrc, one line", "machine api.example.com login bob password {s}",
     ["machine api.example.com login bob password ***"]),
    ("netrc, multi-line", "machine api.example.com\n  login bob\n  password {s}\n",
     ["machine api.example.com\n  login bob\n  password ***\n"]),
    ("aws credentials file", "[default]\naws_secret_access_key = {b}\naws_session_token = {s}\nregion = eu-west-1",
     ["[default]\naws_secret_access_key = ***\naws_session_token = ***\nregion = eu-west-1"]),
    ("yaml password", "db:\n  host: db.internal\n  password: {s}\n", ["host: db.internal\n  password: ***\n"]),
    ("yaml client_secret in a list", "- client_id: app\n  client_secret: '{s}'",
     ["- client_id: app\n  client_secret: '***'"]),
    ("env line", "export GITLAB_TOKEN={s}", ["export GITLAB_TOKEN=***"]),
    ("uri password with a blank", "postgresql://mlflow:{s} {b}@db.internal:5432/mlflow failed",
     ["postgresql://mlflow:***@db.internal:5432/mlflow failed"]),
    ("uri password with a quote", "mysql://app:{s}\"{b}@h.internal/d", ["mysql://app:***@h.internal/d"]),
    ("azure AccountKey alone", "AccountKey={b}", ["AccountKey=***"]),
    ("azure AccountKey URL-encoded", "https://x.example/cb?conn=DefaultEndpointsProtocol%3Dhttps%3BAccountName%3Da"
     "%3BAccountKey%3D{q}%3BEndpointSuffix%3Dcore.windows.net&x=1",
     ["AccountName%3Da%3BAccountKey%3D***%3BEndpointSuffix%3Dcore.windows.net&x=1"]),
]

# Ordinary text that must come back unchanged.
INNOCENT = [
    "password: export MLFLOW_TRACKING_PASSWORD and run again",
    "tokenizer: bpe\nauthor: me\npasses: 3\npath: /data\nPGPASSFILE=/home/u/.pgpass",
    "auth: true\ntoken: 5 of 10 used\nsecret: none",
    "http://localhost:5000 or mail bob@example.com; http://h:8080, bob@example.com",
    "ssh -p2222 host; mkdir -pv /tmp/x; docker run -p8080:80 img",
    "the password for the login page is reset by an admin",
    "Set the Authorization header; Cookie policy: see the docs",
    "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----",
    "export RAY_AUTH_TOKEN_PATH=/tmp/vitp/auth_token\nRAY_AUTH_MODE=disabled",
    "env:\n  MLFLOW_TRACKING_PASSWORD: ${MLFLOW_TRACKING_PASSWORD:-}",
]


@pytest.fixture(autouse=True)
def no_known_secrets(monkeypatch):
    """An environment without credential names, and an empty registry of secret values."""
    for name in list(os.environ):
        if is_secret_key(name):
            monkeypatch.delenv(name)
    monkeypatch.setattr(secret_values, "_REGISTRY", secret_values._Registry())


def pieces(secret: str, n: int = 8) -> list[str]:
    """Every n-character piece of `secret`: a partly masked secret leaks too."""
    return [secret[i:i + n] for i in range(len(secret) - n + 1)]


@pytest.mark.parametrize("form, template, kept", FORMS, ids=[f[0] for f in FORMS])
def test_a_planted_secret_is_masked_by_its_form(form, template, kept):
    s = "Pl" + secrets.token_urlsafe(18)
    b = base64.b64encode(secrets.token_bytes(45)).decode()
    planted = {"s": s, "b": b, "q": quote(b, safe="")}
    assert not set(planted.values()) & known_secrets()  # only the shape-based rules can mask these
    text = template.format(**planted)
    for out in (redact_message(text), redact({"note": text})["note"]):
        leaked = [p for secret in planted.values() for p in pieces(secret) if p in out]
        assert not leaked, (form, out)
        assert REDACTED in out
        for part in kept:
            assert part in out, (form, out)


@pytest.mark.parametrize("text", INNOCENT)
def test_ordinary_text_stays_as_it_is(text):
    assert redact_message(text) == text


@pytest.mark.parametrize("name", ["GITLAB_ACCESSTOKEN", "MYACCESSTOKEN", "CI_JOB_JWT", "CI_JOB_JWT_V2",
                                  "SLACK_WEBHOOK_URL", "webhookUrl"])
def test_more_secret_names_are_masked_by_value(monkeypatch, name):
    assert is_secret_key(name)
    secret = "https://hooks.example.com/" + secrets.token_urlsafe(18)
    monkeypatch.setenv(name, secret)
    assert redact_message(f"posting to {secret} failed") == f"posting to {REDACTED} failed"


@pytest.mark.parametrize("name", ["tokenizer", "author", "passes", "path", "PGPASSFILE", "jwt_algorithm",
                                  "WEBHOOK_TIMEOUT", "jwt_issuer"])
def test_names_near_them_are_not_secret(name):
    assert not is_secret_key(name)
