"""Secrets by value: a value this process holds as a secret (an environment variable with a credential's
name, a URI's password, what `vitp submit` forwards) is masked wherever it appears, in any form.

Each test plants a fresh random value: the registry is process-wide and never forgets one.
"""
import base64
import json
import secrets
from urllib.parse import quote, quote_plus

import pytest

from vitp.tracking.redact import REDACTED, known_secrets, redact, redact_message, redact_text, redact_value
from vitp.tracking.secret_values import MIN_SECRET_LEN, remember_secret


def planted(prefix: str = "") -> str:
    """A fresh secret with the '/', '+', '%' and '@' that generated passwords and cloud keys hold."""
    return f"{prefix}{secrets.token_hex(4)}/p+w%41@{secrets.token_hex(3)}"


def test_an_env_var_named_pgpassword_is_masked_by_value_everywhere(monkeypatch):
    secret = planted("pg")
    monkeypatch.setenv("PGPASSWORD", secret)
    assert secret in known_secrets()
    message = f"connection to server failed for {secret}: wrong?"
    assert redact_message(message) == f"connection to server failed for {REDACTED}: wrong?"
    for form in (quote(secret, safe=""), quote_plus(secret), json.dumps(secret)[1:-1],
                 base64.b64encode(secret.encode()).decode(), base64.urlsafe_b64encode(secret.encode()).decode()):
        out = redact_text(f"before {form} after")
        assert out == f"before {REDACTED} after", (form, out)
    # inside params and tags: under any key, in any string
    assert redact({"data.path": f"/data/{secret}/x", "n": 3}) == {"data.path": f"/data/{REDACTED}/x", "n": 3}
    assert redact_value("note", [f"x {secret}"]) == [f"x {REDACTED}"]


def test_base64_inside_a_longer_encoding_is_masked(monkeypatch):
    """An HTTP Basic auth header holds base64("user:password"): the password at any alignment."""
    secret = planted("b64")
    monkeypatch.setenv("DB_PASS", secret)
    for user in ("a", "ab", "abc"):
        header = "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode()
        out = redact_message(f"sent Authorization: {header} to the server")
        core = base64.b64encode(f"{user}:{secret}".encode()).decode()[4:-4]
        assert core not in out and "to the server" in out, out


@pytest.mark.parametrize("name", ["DB_PASS", "AZURE_STORAGE_CONNECTION_STRING", "GITHUB_PAT", "KEY_PASSPHRASE",
                                  "MLFLOW_TRACKING_PASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD", "HF_TOKEN"])
def test_each_credential_name_in_the_environment_is_masked(monkeypatch, name):
    secret = planted(name.lower()[:3])
    monkeypatch.setenv(name, secret)
    assert REDACTED in redact_message(f"x{secret}x") and secret not in redact_message(f"x{secret}x")


def test_a_uri_password_in_the_environment_is_masked_decoded_too(monkeypatch):
    """MLFLOW_BACKEND_STORE_URI holds the database password percent-encoded; an error may print it decoded."""
    secret = planted("uri")
    monkeypatch.setenv("MLFLOW_BACKEND_STORE_URI", f"postgresql://mlflow:{quote(secret, safe='')}@db:5432/mlflow")
    out = redact_message(f"password authentication failed ({secret}) and ({quote(secret, safe='')})")
    assert secret not in out and quote(secret, safe="") not in out and out.count(REDACTED) == 2


def test_innocent_values_of_credential_names_are_not_masked_everywhere(monkeypatch, tmp_path):
    """Short values, numbers, common words and paths (RAY_AUTH_TOKEN_PATH, PWD) would mask innocent text."""
    monkeypatch.setenv("MY_TOKEN", "abc12")  # shorter than MIN_SECRET_LEN
    monkeypatch.setenv("SESSION_TOKEN_TTL", "86400000")  # a number
    monkeypatch.setenv("X_AUTH", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/home/someone/.ray/token")  # names a file
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path))  # an existing path
    monkeypatch.chdir(tmp_path)  # PWD is not a password
    monkeypatch.setenv("PWD", str(tmp_path / "work"))
    text = f"abc12 step 86400000 disabled /home/someone/.ray/token {tmp_path}/work"
    assert redact_message(text) == text
    assert len("abc12") < MIN_SECRET_LEN


def test_a_value_remembered_by_code_is_masked_and_short_ones_are_refused():
    secret = planted("fwd")
    remember_secret(secret)
    remember_secret("true")
    assert secret in known_secrets() and "true" not in known_secrets()
    assert redact_message(f"job log: {secret} true") == f"job log: {REDACTED} true"


def test_a_forwarded_secret_is_remembered_by_vitp_submit(tmp_path):
    """`vitp submit --forward-env NAME` and a spec's secret env_vars: masked in whatever vitp prints later."""
    from vitp.cluster.jobspec import load_spec

    forwarded, expanded = planted("fe"), planted("sp")
    spec = tmp_path / "job.yaml"
    spec.write_text("entrypoint: vitp config debug\nruntime_env:\n  env_vars:\n    DB_PASS: ${DB_PASS}\n")
    load_spec(str(spec), environ={"DB_PASS": expanded, "STATIC_NAME_TOKEN": forwarded},
              forward_env=["STATIC_NAME_TOKEN"], check_recipe=False)
    assert {forwarded, expanded} <= known_secrets()
    assert REDACTED in redact_message(forwarded) and REDACTED in redact_message(expanded)


def test_the_store_uri_password_is_remembered(tmp_path):
    from vitp.tracking.store import get_client

    secret = planted("st")
    get_client(f"http://alice:{quote(secret, safe='')}@127.0.0.1:9/")  # no request is made
    assert secret in known_secrets()


def test_vitp_error_lines_mask_known_secrets(monkeypatch, capsys):
    """What `vitp` prints on an error (one line, redact_message) masks every known secret value."""
    from vitp import cli
    from vitp.cli import experiment
    from vitp.errors import ConfigError

    secret = planted("cli")
    monkeypatch.setenv("PGPASSWORD", secret)
    b64 = base64.b64encode(secret.encode()).decode()

    def handler(args):
        raise ConfigError(f"--set data.path=/x/{secret}: no such path ({b64})")

    monkeypatch.setattr(experiment, "cmd_export", handler)
    assert cli.main(["export", "ckpt"]) == 2
    err = capsys.readouterr().err
    assert secret not in err and b64 not in err and f"--set data.path=/x/{REDACTED}: no such path" in err


def test_many_params_are_redacted_fast_with_secrets_known(monkeypatch):
    """Redaction runs on every MLflow param: one regex, compiled once per change of the secrets."""
    import time

    for i in range(20):
        remember_secret(planted(f"many{i}"))
    params = {f"section{i}.key{i}": f"/data/set-{i}/value {i}" for i in range(500)}
    redact(params)
    t0 = time.perf_counter()
    assert redact(params) == params
    assert time.perf_counter() - t0 < 1.0
