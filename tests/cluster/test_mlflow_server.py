"""`vitp mlflow-server` / start_server with basic auth: refuses the default admin password,
requires a login, rejects Host headers outside --allowed-hosts; with its artifact store on S3
(moto), what clients log lands in the bucket. Real mlflow server processes."""
import shutil

import pytest

from vitp.tracking.store import TrackingError
from vitp.tracking.server import AuthSettings, _artifact_store_env, start_server

from httpcalls import request  # tests/httpcalls.py

from .conftest import vitp

pytestmark = pytest.mark.slow


def status(url, host=None, user=None, password=None, method="GET", body=None) -> int:
    """The HTTP status of one request (basic auth when `user` is given, a JSON `body` if any)."""
    return request(url, host, user, password, method, body, timeout=10)[0]


def get(url, host=None, user=None, password=None) -> int:
    return status(url, host, user, password)


def _group_cmdlines(pgid: int) -> list[str]:
    """The command lines of every process in process group `pgid` (the server and its workers)."""
    import os

    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def test_refuses_the_default_admin_password(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_AUTH_ADMIN_PASSWORD", "password1234")
    with pytest.raises(TrackingError, match="refusing to start.*password1234"):
        start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "a"), auth=AuthSettings())
    out = vitp("mlflow-server", "--auth", "--port", "0", "--backend-store-uri", f"sqlite:///{tmp_path}/m.db",
               "--artifacts-destination", str(tmp_path / "a"), env={"MLFLOW_AUTH_ADMIN_PASSWORD": "password1234"},
               timeout=60)
    assert out.returncode == 2 and "refusing to start" in out.stderr
    # ... and a missing password, and an exposed host without auth.
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_PASSWORD")
    with pytest.raises(TrackingError, match="MLFLOW_AUTH_ADMIN_PASSWORD"):
        start_server(f"sqlite:///{tmp_path}/new/m.db", str(tmp_path / "new" / "a"), auth=AuthSettings(),
                     log_path=tmp_path / "new" / "server.log")
    assert not (tmp_path / "new").exists()  # refused before anything was written
    with pytest.raises(TrackingError, match="without a login"):
        start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "a"), host="0.0.0.0")


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
def test_basic_auth_server_requires_login_and_rejects_foreign_hosts(tmp_path):
    password = "a-long-test-password-7f3k"
    handle = start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "art"), host="127.0.0.1",
                          allowed_hosts=["127.0.0.1:*", "localhost:*"], auth=AuthSettings(admin_password=password),
                          log_path=tmp_path / "server.log")
    try:
        assert "basic-auth" in handle.command and password not in " ".join(handle.command)
        # the backend store URI (a database password in production) is in no process's argv
        cmdlines = _group_cmdlines(handle.process.pid)
        assert cmdlines and not any(str(tmp_path / "m.db") in c for c in cmdlines), cmdlines
        api = f"{handle.uri}/api/2.0/mlflow/experiments/search?max_results=1"
        assert get(api) == 401
        assert get(api, user="admin", password="wrong-password-123") == 401
        assert get(api, user="admin", password=password) == 200
        assert get(api, host="evil.example.com", user="admin", password=password) in (400, 403)
        ini = handle.auth_config.read_text()  # a private temp file while the server runs
        assert password not in ini and password not in handle.log_tail(200)
        # a verified login is cached (AuthSettings.cache_ttl_s): no other password rides on it,
        # and a password changed through the API is refused at once (one server worker here)
        assert "auth_cache_ttl_seconds = 60" in ini
        assert get(api, user="admin", password="wrong-password-123") == 401
        changed = "a-changed-password-4h8d"
        assert status(f"{handle.uri}/api/2.0/mlflow/users/update-password", user="admin", password=password,
                      method="PATCH", body={"username": "admin", "password": changed,
                                            "current_password": password}) == 200
        assert get(api, user="admin", password=password) == 401
        assert get(api, user="admin", password=changed) == 200
    finally:
        handle.stop()
    assert not handle.alive() and not handle.auth_config.parent.exists()  # the config went with it
    # the users live beside the tracking store, not in a temp file: a restart (another log file,
    # another bootstrap password, which only seeds an empty user store) keeps the admin's login
    assert (tmp_path / "auth.db").exists()
    handle = start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "art"), host="127.0.0.1",
                          auth=AuthSettings(admin_password="another-long-password-9q2w", cache_ttl_s=0),
                          log_path=tmp_path / "server2.log")
    try:
        assert "auth_cache_ttl_seconds = 0" in handle.auth_config.read_text()
        api = f"{handle.uri}/api/2.0/mlflow/experiments/search?max_results=1"
        assert get(api, user="admin", password=changed) == 200
        assert get(api, user="admin", password=password) == 401
        assert get(api, user="admin", password="another-long-password-9q2w") == 401
    finally:
        handle.stop()


def test_server_with_artifacts_on_s3_stores_what_clients_log_in_the_bucket(s3, tmp_path):
    from mlflow.tracking import MlflowClient

    bucket = s3.bucket("mlflow")
    handle = start_server(f"sqlite:///{tmp_path}/m.db", f"{bucket}/mlflow", log_path=tmp_path / "server.log")
    try:
        assert handle.command[handle.command.index("--artifacts-destination") + 1] == f"{bucket}/mlflow"
        client = MlflowClient(handle.uri)
        run = client.create_run(client.create_experiment("s3-artifacts")).info
        (tmp_path / "note.txt").write_text("logged through the server")
        client.log_artifact(run.run_id, str(tmp_path / "note.txt"), "docs")
        client.set_terminated(run.run_id)
        # The client never saw the bucket: the server proxied the upload (mlflow-artifacts:/ URI).
        assert client.get_run(run.run_id).info.artifact_uri.startswith("mlflow-artifacts:")
        assert [f.path for f in client.list_artifacts(run.run_id, "docs")] == ["docs/note.txt"]
    finally:
        handle.stop()
    name = bucket.split("/")[-1]
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=name).get("Contents", [])]
    assert any(k.startswith("mlflow/") and k.endswith(f"{run.run_id}/artifacts/docs/note.txt") for k in keys), keys
    body = s3.client().get_object(Bucket=name, Key=next(k for k in keys if k.endswith("note.txt")))["Body"].read()
    assert body == b"logged through the server"


def test_an_s3_artifact_store_gets_the_pipelines_endpoint_when_mlflows_is_unset(monkeypatch):
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert _artifact_store_env("s3://b/mlflow", {}) == {"MLFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:9"}
    assert _artifact_store_env("s3://b/mlflow", {"MLFLOW_S3_ENDPOINT_URL": "http://h:1"}) == {}
    assert _artifact_store_env("/local/artifacts", {}) == {}


def test_the_user_store_uri_comes_from_the_environment_with_any_characters(tmp_path, monkeypatch):
    """$MLFLOW_AUTH_DATABASE_URI (a Kubernetes Secret's value) reaches the auth app exactly, as
    MLflow itself reads the generated file: %, &, |, #, ; and quotes in the password included."""
    from mlflow.server.auth.config import read_auth_config

    from vitp.tracking.server import _auth_env

    uri = "postgresql://mlflow:p%40ss&w|rd%x#1;'\"@postgres.mlflow.svc:5432/mlflow_auth"
    env, private = _auth_env(AuthSettings(admin_password="a-long-test-password-7f3k"), "postgresql://x/y",
                             {"MLFLOW_AUTH_DATABASE_URI": uri})
    try:
        monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", env["MLFLOW_AUTH_CONFIG_PATH"])
        assert read_auth_config().database_uri == uri
        assert "a-long-test-password-7f3k" not in (private / "auth.ini").read_text()
    finally:
        shutil.rmtree(private)
