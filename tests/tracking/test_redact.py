"""Credential redaction: what is masked, and what must stay readable."""
import pytest

from vitp.tracking.redact import REDACTED, is_secret_key, redact, redact_message, redact_text


def test_secret_keys_are_whole_words():
    for key in ("hf_token", "db.password", "aws_secret_access_key", "apiKey", "s3.secret_key",
                "MLFLOW_TRACKING_PASSWORD", "basic_auth", "credentials"):
        assert is_secret_key(key), key
    for key in ("tokenizer", "author", "data.path", "model.variant", "optim.lr", "keep_checkpoints"):
        assert not is_secret_key(key), key


def test_secret_values_are_masked_wherever_they_are():
    text = ("https://alice:hunter2@mlflow.example.com/api?token=abc123&page=2 "
            "key=AKIAIOSFODNN7EXAMPLE Authorization: Bearer eyJhbGciOiJIUzI1NiJ9 "
            "ghp_0123456789abcdefghijABCDEFGHIJ")
    out = redact_text(text)
    for secret in ("hunter2", "abc123", "AKIAIOSFODNN7EXAMPLE", "eyJhbGciOiJIUzI1NiJ9", "ghp_0123"):
        assert secret not in out, secret
    # The non-secret parts stay: the user, the host, other query params.
    assert "https://alice:***@mlflow.example.com/api?token=***&page=2" in out


def test_redact_keeps_numbers_and_plain_strings_and_recurses():
    d = {"max_tokens": 512, "hf_token": "hf_abcdefghijklmnopqrstuvwxyz", "path": "/data/x",
         "tags": {"owner": "bob", "github_token": "x"}, "uris": ["s3://k:s@bucket/a"]}
    out = redact(d)
    assert out["max_tokens"] == 512 and out["path"] == "/data/x"
    assert out["hf_token"] == REDACTED
    assert out["tags"] == {"owner": "bob", "github_token": REDACTED}
    assert out["uris"] == ["s3://k:***@bucket/a"]
    assert d["hf_token"].startswith("hf_"), "redact must not modify its input"


def test_names_ending_in_key_are_secret_as_the_readme_promises():
    # README: values whose key names a credential (*_SECRET_*, *_TOKEN, *_PASSWORD, *_KEY) print as ***.
    for key in ("AZURE_STORAGE_KEY", "SSH_KEY", "AWS_SECRET_ACCESS_KEY", "runtime_env.env_vars.GCS_HMAC_KEY",
                "signingKey", "MY_SECRET_VALUE", "GITHUB_TOKEN", "DB_PASSWORD"):
        assert is_secret_key(key), key
    for key in ("monkey", "key_id", "keep_checkpoints", "tune.metric", "KEY"):
        assert not is_secret_key(key), key
    out = redact({"AZURE_STORAGE_KEY": "abc123secret", "SSH_KEY": "-----BEGIN", "PLAIN": "visible"})
    assert out == {"AZURE_STORAGE_KEY": REDACTED, "SSH_KEY": REDACTED, "PLAIN": "visible"}


def test_key_pairs_inside_text_are_masked():
    out = redact_text("AZURE_STORAGE_KEY=abc123secret ssh_key: zzz monkey=3")
    assert "abc123secret" not in out and "zzz" not in out
    assert "AZURE_STORAGE_KEY=***" in out and "monkey=3" in out


def test_uri_passwords_with_slashes_and_pluses_are_masked_whole():
    """Cloud secret keys hold "/" and "+" and are often pasted into a URI unencoded."""
    from vitp.tracking.redact import redact_text

    secret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY/EXAMPLEKEY"
    out = redact_text(f"postgresql://mlflow:{secret}@db.internal:5432/mlflow and s3://bucket/a/b.db")
    assert out == "postgresql://mlflow:***@db.internal:5432/mlflow and s3://bucket/a/b.db"
    assert not any(part in out for part in secret.split("/"))


# --- issue 62: secret names outside the old patterns, and one planted secret per text pattern

def test_more_credential_names_are_secret_and_innocent_words_are_not():
    for key in ("PGPASSWORD", "DB_PASS", "AZURE_STORAGE_CONNECTION_STRING", "GITHUB_PAT", "KEY_PASSPHRASE",
                "MYSQL_PWD", "MYSQL_ROOT_PASSWORD", "ssh_passphrase", "db.connectionString", "SERVICEBUS_CONN_STR",
                "storage.account_key"):
        assert is_secret_key(key), key
    for key in ("tokenizer", "author", "monkey", "passes", "pattern", "path", "compass", "PATH", "bypass",
                "passenger", "patience", "spatial", "pass_through", "PGPASSFILE", "data.pattern", "num_passes"):
        assert not is_secret_key(key), key
    out = redact({"PGPASSWORD": "s3cr3t-pg", "DB_PASS": "s3cr3t-db", "GITHUB_PAT": "s3cr3t-gh",
                  "tokenizer": "bert-base", "pattern": "*.tar", "passes": "3"})
    assert out == {"PGPASSWORD": REDACTED, "DB_PASS": REDACTED, "GITHUB_PAT": REDACTED,
                   "tokenizer": "bert-base", "pattern": "*.tar", "passes": "3"}


PLANTED = "Pl4nted+Secret/9"  # the secret in every case below; each case's other words must stay


@pytest.mark.parametrize("text, kept", [
    (f"https://b.s3.amazonaws.com/k?X-Amz-Date=20240101T000000Z&X-Amz-Signature={PLANTED}&x-id=GetObject",
     ["https://b.s3.amazonaws.com/k?X-Amz-Date=20240101T000000Z&X-Amz-Signature=***&x-id=GetObject"]),
    (f"https://a.blob.core.windows.net/c/b?sv=2021-08-06&sp=r&sig={PLANTED}&spr=https",
     ["https://a.blob.core.windows.net/c/b?sv=2021-08-06&sp=r&sig=***&spr=https"]),
    (f"DefaultEndpointsProtocol=https;AccountName=a;AccountKey={PLANTED}==;EndpointSuffix=core.windows.net",
     ["DefaultEndpointsProtocol=https;AccountName=a;AccountKey=***;EndpointSuffix=core.windows.net"]),
    (f'connect password="{PLANTED} with spaces" user="bob"', ['connect password="***" user="bob"']),
    (f"password='{PLANTED} x' user=bob", ["password='***' user=bob"]),
    (f'{{"password": "{PLANTED}", "user": "bob"}}', ['{"password": "***", "user": "bob"}']),
    (f"{{'db_password': '{PLANTED}', 'host': 'db'}}", ["{'db_password': '***', 'host': 'db'}"]),
    (f'tags={{\\"api_token\\": \\"{PLANTED}\\"}}', ['tags={\\"api_token\\": \\"***\\"}']),
    (f"psql --password {PLANTED} --host db.internal", ["psql --password *** --host db.internal"]),
    (f"tool --token {PLANTED} --verbose", ["tool --token *** --verbose"]),
    (f"tool --db-password '{PLANTED} x' --token={PLANTED} -v", ["tool --db-password '***' --token=*** -v"]),
    (f"postgresql://mlflow:p@ss{PLANTED}@db.internal:5432/mlflow ok", ["postgresql://mlflow:***@db.internal:5432/mlflow ok"]),
    (f"token=ab;{PLANTED} next=1", ["token=*** next=1"]),
    (f"DB_PASS={PLANTED} GITHUB_PAT={PLANTED} KEY_PASSPHRASE={PLANTED} PGPASSWORD={PLANTED} rest",
     ["DB_PASS=*** GITHUB_PAT=*** KEY_PASSPHRASE=*** PGPASSWORD=*** rest"]),
    (f"AZURE_STORAGE_CONNECTION_STRING='AccountName=a;AccountKey={PLANTED}' x", ["AZURE_STORAGE_CONNECTION_STRING='***' x"]),
])
def test_each_secret_pattern_masks_a_planted_secret(text, kept):
    out = redact_text(text)
    assert PLANTED not in out and PLANTED.split("/")[0] not in out, out
    for part in kept:
        assert part in out, out


@pytest.mark.parametrize("text", [
    "mlflow-server --auth --port 5000 --tokenizer bert --token-file /run/token",
    "design=3 monkey=3 passes=2 pattern=*.tar path=/data compass=north author=me tokenizer=bpe",
    "postgresql://db.internal:5432/mlflow user@example.com s3://bucket/a@b",
    "https://host/a?x-id=GetObject&sv=2021&design=1",
])
def test_innocent_text_is_left_alone(text):
    assert redact_text(text) == text


def test_error_lines_mask_unambiguous_secrets_but_not_prose():
    """redact_message (vitp's error lines) masks signatures, flags and URI passwords, not `key: value`."""
    out = redact_message(f"cannot read https://a/b?sig={PLANTED} (psql --password {PLANTED}); "
                         "password: export MLFLOW_TRACKING_PASSWORD")
    assert PLANTED not in out and "password: export MLFLOW_TRACKING_PASSWORD" in out


def test_long_words_are_redacted_in_linear_time():
    """A URI scheme was tried at every letter of a long word: 20,000 letters took a second."""
    import time

    text = "a" * 200_000 + " " + "b/" * 50_000
    t0 = time.perf_counter()
    assert redact_text(text) == text
    assert time.perf_counter() - t0 < 2.0
