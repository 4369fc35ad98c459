"""Network helpers shared by the process launchers and the MLflow server: free TCP ports.

A sink: imports nothing from `vitp`, never torch or ray. `python -m vitp.net [TAKEN...]` prints
one port (cluster/local.sh uses it).
"""
from __future__ import annotations

import random
import socket
import sys

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


if __name__ == "__main__":
    print(free_port(taken={int(p) for p in sys.argv[1:]}))
