"""Tracking fixtures: a real `mlflow server` (127.0.0.1, random port) per session and a SQLite store.

Every test that takes `tracking_uri` runs against both stores; `experiment` is unique per test.
"""
import uuid

import pytest

from vitp.tracking import start_server


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    handle = start_server(f"sqlite:///{root}/server.db", str(root / "artifacts"), host="127.0.0.1", port=0)
    yield handle
    handle.stop()
    assert not handle.alive(), "mlflow server still running after stop()"


@pytest.fixture(scope="session")
def sqlite_uri(tmp_path_factory):
    # One DB for the session: creating a fresh schema costs seconds on 2 cores.
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-sqlite')}/mlflow.db"


@pytest.fixture(params=["sqlite", "server"])
def tracking_uri(request):
    if request.param == "server":
        return request.getfixturevalue("mlflow_server").uri
    return request.getfixturevalue("sqlite_uri")


@pytest.fixture
def experiment(request):
    return f"{request.node.originalname}-{uuid.uuid4().hex[:8]}"
