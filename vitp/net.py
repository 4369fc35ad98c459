"""Network helpers shared by the process launchers and the MLflow server: free TCP ports, and the
switches that keep MLflow's and Ray's usage reports on this machine (`no_telemetry`).

A sink: imports nothing from `vitp`, never torch or ray. `python -m vitp.net [TAKEN...]` prints
one port (cluster/local.sh uses it).
"""
from __future__ import annotations

import os
import random
import socket
import sys
from typing import Mapping

# Ports below the OS's ephemeral range are never handed to an outgoing connection, so a port
# chosen there stays free until its server binds it (a port from the range, e.g. one `bind(0)`
# returned, can be taken meanwhile by any client's connect: a dashboard failed to start that way).
_LOWEST = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # IANA's dynamic range, which macOS and Windows use


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1", taken: frozenset[int] | set[int] = frozenset()) -> int:
    """A TCP port on `host` that is free now, below the ephemeral range where one exists, and not
    in `taken` (another server may still bind it first: callers that can retry should)."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            p = rng.randrange(_LOWEST, low)
            if p not in taken and _bindable(host, p):
                return p
    while True:  # no room below the range (or all tried ports busy): the OS picks
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p not in taken:
            return p


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports on `host`."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(free_port(host, set(ports)))
    return ports


# Nothing leaves the machine unasked. MLflow 3 sends usage telemetry from every process that imports
# it (mlflow/__init__.py starts a client whose thread fetches config.mlflow-telemetry.io and posts
# events where that says); MLFLOW_DISABLE_TELEMETRY=true stops it (mlflow/telemetry/utils.py
# is_telemetry_disabled, read at import). Ray reports a cluster's usage from its head
# (usage-stats.ray.io) unless RAY_USAGE_STATS_ENABLED=0 (ray/_common/usage/usage_lib.py
# _usage_stats_enabledness). Set in this process they reach every process it starts: a local Ray's
# workers, Train workers and trials, an `mlflow server`. A value the user set is theirs:
# MLFLOW_DISABLE_TELEMETRY=false or RAY_USAGE_STATS_ENABLED=1 opts in.
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0"}


def telemetry_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """TELEMETRY_OFF, with the value `environ` (default os.environ) gives where it gives one."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name, "").strip() or off for name, off in TELEMETRY_OFF.items()}


def no_telemetry() -> dict[str, str]:
    """Turn MLflow's telemetry and Ray's usage stats off in this process and all it starts, unless
    the user set them (an opt-in); call before mlflow is imported. Returns the values in force."""
    env = telemetry_env()
    os.environ.update(env)
    return env


if __name__ == "__main__":
    print(free_port(taken={int(p) for p in sys.argv[1:]}))
