"""Local Ray clusters for tests and benchmarks: `cluster/local.sh` on free ports (head plus worker
nodes sharing no directory), nodes added and SIGKILLed as VMs come and go, always stopped."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vitp.net import free_ports

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SH = ROOT / "cluster" / "local.sh"


def vitp_env(env=None) -> dict[str, str]:
    """This process's environment without Ray's connection settings, plus `env`."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base["PATH"] = f"{Path(sys.executable).parent}:{base.get('PATH', '')}"
    return {**base, **(env or {})}


def sets(items: list[str]) -> list[str]:
    """KEY=VALUE items as `vitp` arguments: --set KEY=VALUE each."""
    return [a for item in items for a in ("--set", item)]


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
        # as local.sh says (DIR/pids may hold a node another add_node started meanwhile)
        index = int(re.search(r"^node (\d+) joined", out.stdout, re.M).group(1))
        self.node_dirs = [self.state_dir / f"node-{i}" for i in range(max(len(self.node_dirs), index + 1))]
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
