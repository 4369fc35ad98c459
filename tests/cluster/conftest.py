"""Local Ray clusters for the cluster tests: `cluster/local.sh` on free ports, always stopped; the
rehearsal's cluster additionally shares nothing but an S3 bucket (moto) and an MLflow server."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vitp.net import free_ports

from netproxy import PortForward  # noqa: F401  (tests/netproxy.py; the cluster tests import it from here)

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SH = ROOT / "cluster" / "local.sh"


def vitp_env(env=None) -> dict[str, str]:
    """This process's environment without Ray's connection settings, plus `env`."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base["PATH"] = f"{Path(sys.executable).parent}:{base.get('PATH', '')}"
    return {**base, **(env or {})}


def vitp(*args, env=None, timeout=600):
    """Run `vitp ...` with this interpreter (the venv), returning the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "vitp.cli", *args], cwd=ROOT, env=vitp_env(env),
                          capture_output=True, text=True, timeout=timeout)


class LocalCluster:
    """`cluster/local.sh start` on free ports; `env` is added to the environment every node (and
    so every worker and job driver) inherits. Node i's own directories are node_dirs[i]."""

    def __init__(self, tmp: Path, workers: int, num_cpus: int, auth: bool, env: dict[str, str] | None = None,
                 fake_autoscaling: dict | None = None):
        self.port, self.dash_port = free_ports(2)
        # fresh and short (Ray's socket paths are length-limited), never a stale run's directory
        self.state_dir = Path(tempfile.mkdtemp(prefix="vitp-t", dir="/tmp"))
        self.address = f"http://127.0.0.1:{self.dash_port}"
        if fake_autoscaling is not None:  # Ray's fake multi-node provider finds the GCS by its address
            config = {**fake_autoscaling, "provider": {**fake_autoscaling["provider"],
                                                       "gcs_address": f"127.0.0.1:{self.port}"}}
            (self.state_dir / "autoscaling.json").write_text(json.dumps(config))
        cmd = [str(LOCAL_SH), "start", "--workers", str(workers), "--num-cpus", str(num_cpus),
               "--port", str(self.port), "--dashboard-port", str(self.dash_port),
               "--state-dir", str(self.state_dir),
               # nodes come up in seconds on an idle machine; the default 90 s has run out while
               # other tests loaded every core
               "--timeout", "300"] + (["--auth"] if auth else []) \
            + (["--fake-autoscaling", str(self.state_dir / "autoscaling.json")] if fake_autoscaling else [])
        env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"cluster/local.sh start failed:\n{out.stdout}\n{out.stderr}")
        self.token_path = self.state_dir / "auth_token" if auth else None
        # head first: Ray temp dir (ray/), working directory (work/) and TMPDIR (tmp/) of each node
        self.node_dirs = [self.state_dir / f"node-{i}" for i in range(workers + 1)]

    def add_node(self) -> int:
        """`cluster/local.sh add-node`: one more worker node joins; its index (node_dirs grows)."""
        out = subprocess.run([str(LOCAL_SH), "add-node", "--state-dir", str(self.state_dir), "--timeout", "300"],
                             capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
                             timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        index = len((self.state_dir / "pids").read_text().split()) - 1
        self.node_dirs.append(self.state_dir / f"node-{index}")
        return index

    def kill_node(self, index: int) -> None:
        """`cluster/local.sh kill-node`: node `index`'s processes SIGKILLed at once (a lost VM)."""
        out = subprocess.run([str(LOCAL_SH), "kill-node", str(index), "--state-dir", str(self.state_dir)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr

    def stop(self, keep_logs: bool = False) -> str:
        """`cluster/local.sh stop`; returns what it printed on stderr. The nodes' logs (Ray's temp
        dirs: every worker's output) stay when `keep_logs`, for a failed test's post-mortem."""
        out = subprocess.run([str(LOCAL_SH), "stop", "--state-dir", str(self.state_dir)],
                             capture_output=True, text=True, timeout=120)
        if keep_logs:
            print(f"\nthe cluster's logs are kept in {self.state_dir}")
        elif not (self.state_dir / "pids").exists():  # stopped: the logs and Ray's temp dir can go
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return out.stderr


@pytest.fixture(scope="module")
def two_node_cluster(request, tmp_path_factory):
    """Head + one worker node, 3 logical CPUs each (a 2-CPU Train worker per node + Ray Data)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), workers=1, num_cpus=3, auth=False)
    yield cluster
    stopped = cluster.stop(keep_logs=request.session.testsfailed > 0)
    assert not (cluster.state_dir / "pids").exists()
    # every node ended on SIGTERM (jobs that read data leave detached actors behind; Ray's
    # drain-on-SIGTERM waited for them: cluster/local.sh turns it off)
    assert "after SIGTERM" not in stopped, stopped


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory):
    """A head-only cluster with token authentication (RAY_AUTH_MODE=token)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("auth-cluster"), workers=0, num_cpus=2, auth=True)
    yield cluster
    stopped = cluster.stop()
    assert "after SIGTERM" not in stopped, stopped  # (see two_node_cluster)


# ----------------------------------------------------------------------------- rehearsal


@dataclass
class Rehearsal:
    """The rehearsal's world: a two-node cluster, its bucket and its MLflow server."""

    cluster: LocalCluster
    bucket: str  # s3://name
    mlflow: object  # vitp.tracking.server.ServerHandle
    env: dict[str, str] = field(default_factory=dict)  # what the user's shell exports
    forward: PortForward | None = None  # this machine's own address for the MLflow server

    @property
    def store(self) -> str:
        return self.env["VITP_STORE"]

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under `prefix`."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
        name = self.bucket.split("/")[-1]
        out: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


@pytest.fixture(scope="module")
def rehearsal(request, s3, tmp_path_factory):
    """Head + one worker node (3 logical CPUs each, like two_node_cluster), each with its own
    temp, working and TMPDIR directories; VITP_STORE=s3://<bucket>/vit and MLFLOW_TRACKING_URI (a
    real `mlflow server`: SQLite here, artifacts in s3://<bucket>/mlflow) in every node's
    environment. The submitting shell reaches that server at an address of its own, as through a
    `kubectl port-forward` (MLFLOW_TRACKING_URI), and names the nodes' (VITP_JOB_TRACKING_URI)."""
    from vitp.tracking.server import start_server

    bucket = s3.bucket("rehearsal")
    tmp = tmp_path_factory.mktemp("rehearsal-mlflow")
    server = start_server(f"sqlite:///{tmp}/mlflow.db", f"{bucket}/mlflow", log_path=tmp / "mlflow.log")
    env = {"VITP_STORE": f"{bucket}/vit", "MLFLOW_TRACKING_URI": server.uri}
    try:
        cluster = LocalCluster(tmp, workers=1, num_cpus=3, auth=False, env=env)
    except BaseException:
        server.stop()
        raise
    forward = PortForward(server.port)
    shell = {**env, "MLFLOW_TRACKING_URI": forward.uri, "VITP_JOB_TRACKING_URI": server.uri}
    try:
        yield Rehearsal(cluster, bucket, server, shell, forward)
    finally:
        forward.close()
        cluster.stop(keep_logs=request.session.testsfailed > 0)
        server.stop()
