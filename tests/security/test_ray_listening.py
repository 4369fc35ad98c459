"""A local Ray (vitp.cluster.connect.connect_ray with no address) listens on loopback only: every
TCP port of the driver and of every process it starts (GCS, raylet, agents, metrics, dashboard,
autoscaler monitor, workers' gRPC servers), read from the sockets themselves; VITP_RAY_BIND
chooses otherwise and a value that is not an address is refused."""
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitp.cluster.connect import local_bind
from vitp.errors import ConfigError
from vitp.net import free_ports

ROOT = Path(__file__).resolve().parents[2]

# Every TCP port the local Ray's processes (the driver, and every process it started: GCS, raylet,
# agents, dashboard, autoscaler monitor, workers) listen on, named where Ray says what it is, once
# each named component listens (or 30 s have passed; "missing": those that never did).
LISTENERS = """
import json, os, time
import psutil, ray
from vitp.cluster.connect import connect_ray
from vitp.config import ExperimentConfig

connect_ray(ExperimentConfig())
ray.get(ray.remote(num_cpus=0)(lambda: os.getpid()).remote())  # a worker, with its own gRPC server
info = ray.nodes()[0]
named = {int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]): "GCS",
         info["NodeManagerPort"]: "raylet (node manager)", info["ObjectManagerPort"]: "raylet (object manager)",
         info["MetricsExportPort"]: "dashboard agent (metrics export)", info["MetricsAgentPort"]: "dashboard agent (gRPC)",
         info["DashboardAgentListenPort"]: "dashboard agent (HTTP)", info["RuntimeEnvAgentPort"]: "runtime-env agent",
         int(os.environ["AUTOSCALER_METRIC_PORT"]): "autoscaler monitor (metrics)",
         int(os.environ["DASHBOARD_METRIC_PORT"]): "dashboard (metrics)"}
# -1: a server that could not take its fixed port (the dashboard agent's HTTP on 52365, while the
# test session's Ray holds it) and so does not listen at all
named = {port: what for port, what in named.items() if port > 0}
me = psutil.Process()
deadline = time.time() + 30
while True:
    seen = []
    for p in [me] + me.children(recursive=True):
        try:
            seen += [{"process": p.name(), "pid": p.pid, "ip": c.laddr.ip, "port": c.laddr.port}
                     for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue  # gone meanwhile
    missing = set(named) - {s["port"] for s in seen}
    if not missing or time.time() > deadline:
        break
    time.sleep(0.5)
for s in seen:
    s["what"] = named.get(s["port"], "core worker gRPC" if s["pid"] == me.pid or "ray::" in s["process"] else "?")
print(json.dumps({"node_ip": info["NodeManagerAddress"], "listening": seen, "missing": sorted(named[p] for p in missing)}))
"""


def _run(probe: str, **env: str) -> dict:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}, **env}
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_ray_listens_on_loopback_only():
    """Read from the sockets themselves: GCS, raylet, agents, metrics, dashboard and every worker's
    gRPC server listen on 127.0.0.1 (or ::1), none on 0.0.0.0, :: or the machine's address."""
    # Ray's two fixed metrics ports (44217, 44227) are the session Ray's when it runs: free ones here
    autoscaler, dashboard = free_ports(2)
    got = _run(LISTENERS, VITP_RAY_BIND="", AUTOSCALER_METRIC_PORT=str(autoscaler), DASHBOARD_METRIC_PORT=str(dashboard))
    assert not got["missing"], got  # each component found listening: nothing checked by its absence
    exposed = [f"{s['what']} ({s['process']}) on {s['ip']}:{s['port']}" for s in got["listening"]
               if not _loopback(s["ip"])]
    assert not exposed, f"node ip {got['node_ip']}: " + "; ".join(exposed)
    assert got["node_ip"] == "127.0.0.1"
    assert any(s["what"] == "core worker gRPC" for s in got["listening"])


def test_the_bind_setting_is_loopback_unless_told_and_refuses_what_is_not_an_address(monkeypatch):
    for value in (None, "", "127.0.0.1", "localhost", "loopback", " 127.0.0.1 "):
        if value is None:
            monkeypatch.delenv("VITP_RAY_BIND", raising=False)
        else:
            monkeypatch.setenv("VITP_RAY_BIND", value)
        assert local_bind() == "127.0.0.1", value
    monkeypatch.setenv("VITP_RAY_BIND", "node")
    assert local_bind() is None  # Ray's own choice: this machine's routable address
    monkeypatch.setenv("VITP_RAY_BIND", "10.1.2.3")
    assert local_bind() == "10.1.2.3"
    for bad in ("0.0.0.0", "::", "my-host", "10.1.2"):
        monkeypatch.setenv("VITP_RAY_BIND", bad)
        with pytest.raises(ConfigError, match=r"VITP_RAY_BIND=.*127\.0\.0\.1.*node"):
            local_bind()
