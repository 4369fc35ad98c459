"""`vitp mlflow-server` / start_server with basic auth: refuses the default admin password,
requires a login, rejects Host headers outside --allowed-hosts. Real mlflow server processes."""
import base64
import urllib.error
import urllib.request

import pytest

from pipeline.tracking.store import TrackingError
from pipeline.tracking.server import AuthSettings, start_server

from .conftest import vitp

pytestmark = pytest.mark.slow


def get(url, host=None, user=None, password=None):
    headers = {"Host": host} if host else {}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


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
        start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "a"), auth=AuthSettings())
    with pytest.raises(TrackingError, match="without a login"):
        start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "a"), host="0.0.0.0")


def test_basic_auth_server_requires_login_and_rejects_foreign_hosts(tmp_path):
    password = "a-long-test-password-7f3k"
    handle = start_server(f"sqlite:///{tmp_path}/m.db", str(tmp_path / "art"), host="127.0.0.1",
                          allowed_hosts=["127.0.0.1:*", "localhost:*"], auth=AuthSettings(admin_password=password),
                          log_path=tmp_path / "server.log")
    try:
        assert "basic-auth" in handle.command and password not in " ".join(handle.command)
        api = f"{handle.uri}/api/2.0/mlflow/experiments/search?max_results=1"
        assert get(api) == 401
        assert get(api, user="admin", password="wrong-password-123") == 401
        assert get(api, user="admin", password=password) == 200
        assert get(api, host="evil.example.com", user="admin", password=password) in (400, 403)
        ini = (tmp_path / "server.auth.ini").read_text()
        assert password not in ini and password not in handle.log_tail(200)
    finally:
        handle.stop()
    assert not handle.alive()
