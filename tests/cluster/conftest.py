"""Local Ray clusters for the cluster tests: `cluster/local.sh` on free ports, always stopped; the
rehearsal's cluster additionally shares nothing but an S3 bucket (moto) and an MLflow server."""
import os
from dataclasses import dataclass, field

import pytest

from localcluster import LOCAL_SH, ROOT, LocalCluster, sets, vitp, vitp_env  # noqa: F401  (tests/localcluster.py)
from netproxy import PortForward  # noqa: F401  (tests/netproxy.py; the cluster tests import it from here)

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
