"""The real `mlflow server` we launch: bound to loopback, healthy, Host allow-list enforced, clear failures."""
import urllib.error
import urllib.request

import pytest

from vitp.tracking import TrackingError, start_server


def get(url, host=None):
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_server_is_healthy_on_loopback_and_rejects_foreign_host_headers(mlflow_server):
    assert mlflow_server.alive() and mlflow_server.host == "127.0.0.1"
    assert mlflow_server.uri.startswith("http://127.0.0.1:") and mlflow_server.port > 0
    assert "--workers" in mlflow_server.command and "--serve-artifacts" in mlflow_server.command
    api = f"{mlflow_server.uri}/api/2.0/mlflow/experiments/search?max_results=1"
    assert get(api) == 200
    # DNS-rebinding protection: a Host header outside the allow-list is refused.
    assert get(api, host="evil.example.com") in (400, 403)


@pytest.mark.slow  # mlflow server processes that fail to start (~11 s): make test, not test-fast
def test_start_server_failure_names_the_problem_and_shows_the_log(sqlite_uri, tmp_path):
    with pytest.raises(TrackingError, match=r"(?s)did not answer /health.*no-such-flag"):
        start_server(sqlite_uri, str(tmp_path / "art"),
                     extra_args=["--no-such-flag"], timeout=60)
