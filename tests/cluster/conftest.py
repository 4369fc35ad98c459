"""Local Ray clusters for the cluster tests: `cluster/local.sh` on free ports, always stopped."""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SH = ROOT / "cluster" / "local.sh"


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (all held open until every one is chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def vitp(*args, env=None, timeout=600):
    """Run `vitp ...` with this interpreter (the venv), returning the CompletedProcess."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base["PATH"] = f"{Path(sys.executable).parent}:{base.get('PATH', '')}"
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


class LocalCluster:
    def __init__(self, tmp: Path, workers: int, num_cpus: int, auth: bool):
        self.port, self.dash_port = free_ports(2)
        # fresh and short (Ray's socket paths are length-limited), never a stale run's directory
        self.state_dir = Path(tempfile.mkdtemp(prefix="vitp-t", dir="/tmp"))
        self.address = f"http://127.0.0.1:{self.dash_port}"
        cmd = [str(LOCAL_SH), "start", "--workers", str(workers), "--num-cpus", str(num_cpus),
               "--port", str(self.port), "--dashboard-port", str(self.dash_port),
               "--state-dir", str(self.state_dir)] + (["--auth"] if auth else [])
        env = {**os.environ, "PYTHON": sys.executable}
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"cluster/local.sh start failed:\n{out.stdout}\n{out.stderr}")
        self.token_path = self.state_dir / "auth_token" if auth else None

    def stop(self):
        subprocess.run([str(LOCAL_SH), "stop", "--state-dir", str(self.state_dir)],
                       capture_output=True, text=True, timeout=120)
        if not (self.state_dir / "pids").exists():  # stopped: the logs and Ray's temp dir can go
            shutil.rmtree(self.state_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """Head + one worker node, 3 logical CPUs each (a 2-CPU Train worker per node + Ray Data)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), workers=1, num_cpus=3, auth=False)
    yield cluster
    cluster.stop()
    assert not (cluster.state_dir / "pids").exists()


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory):
    """A head-only cluster with token authentication (RAY_AUTH_MODE=token)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("auth-cluster"), workers=0, num_cpus=2, auth=True)
    yield cluster
    cluster.stop()
