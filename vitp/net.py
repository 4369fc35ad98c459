"""Network helpers shared by the process launchers and the MLflow server: a free TCP port.

A sink: imports nothing from `vitp`, never torch or ray.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it; another process may take it
    before the caller binds it, so callers that can retry should)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
