"""Credential redaction: what is masked, and what must stay readable."""
from vitp.tracking.redact import REDACTED, is_secret_key, redact, redact_text


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
