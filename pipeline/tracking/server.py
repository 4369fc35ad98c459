"""Start and stop a real `mlflow server` subprocess (SQL backend, proxied artifacts) and wait for /health.

Binds 127.0.0.1 unless told otherwise; used by tests and by `vitp mlflow-server`. No torch, no ray.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.tracking.runs import TrackingError, _normalise_uri, get_client

log = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _free_port(host: str) -> int:
    # The OS picks a free port; another process could take it before the server binds, which
    # start_server handles by retrying on a fresh port.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    """A running `mlflow server`; `.uri` is what MlflowClient / RunLogger take."""

    uri: str
    host: str
    port: int
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server and the worker processes it spawned (its own process group)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def start_server(
    backend_store_uri: str,
    artifact_root: str,
    host: str = "127.0.0.1",
    port: int = 0,
    allowed_hosts: Sequence[str] | None = None,
    *,
    workers: int = 1,
    jobs: bool = False,
    timeout: float = 90.0,
    log_path: str | os.PathLike | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> ServerHandle:
    """Launch `python -m mlflow server` from this interpreter and return once /health answers.

    backend_store_uri: a DB URI or a path (".db" -> SQLite). artifact_root: local dir or object-store
    URI that the server proxies artifacts to (--serve-artifacts), so clients need no storage
    credentials. port=0 picks a free port. jobs=False turns off MLflow's GenAI job executor
    (8 extra processes that this pipeline never uses; on 2 cores it triples start-up time).
    """
    backend = _normalise_uri(backend_store_uri)
    if backend.startswith("sqlite:"):
        # Create/migrate the schema here, under our file lock: on a fresh DB the server's own
        # processes can race each other through the migrations and die.
        get_client(backend)
    if "://" not in artifact_root:
        artifact_root = str(Path(artifact_root).expanduser().resolve())
        Path(artifact_root).mkdir(parents=True, exist_ok=True)
    if host not in _LOOPBACK and not allowed_hosts:
        log.warning(
            "mlflow server binds %s with the default Host allow-list: pass allowed_hosts "
            "(the names clients use) when exposing it beyond this machine", host
        )
    log_file = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="mlflow-server-", suffix=".log")[1])
    last_error = ""
    for _ in range(3):  # a picked port can be taken before the server binds it
        p = port or _free_port(host)
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", backend,
            "--serve-artifacts", "--artifacts-destination", artifact_root,
            "--host", host, "--port", str(p),
            "--workers", str(workers),
        ]
        if allowed_hosts:
            cmd += ["--allowed-hosts", ",".join(allowed_hosts)]
        cmd += list(extra_args)
        out = open(log_file, "ab")
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so stop() reaches its workers too
            env={
                **os.environ,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true" if jobs else "false",
                **(env or {}),
            },
        )
        out.close()
        url_host = f"[{host}]" if ":" in host else host
        handle = ServerHandle(f"http://{url_host}:{p}", host, p, proc, log_file, cmd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and handle.alive():
            if _healthy(handle.uri):
                return handle
            time.sleep(0.25)
        timed_out = handle.alive()
        last_error = handle.log_tail()
        handle.stop()
        if timed_out or port or "address already in use" not in last_error.lower():
            break  # only a port we picked and lost to another process is worth a retry
    raise TrackingError(
        f"mlflow server (backend {backend}, artifacts {artifact_root}) did not answer /health on "
        f"{host}:{p} within {timeout:.0f}s: check the flags and that the port is free; "
        f"log {log_file}:\n{last_error}"
    )
