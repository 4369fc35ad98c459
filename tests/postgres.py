"""A real PostgreSQL server on 127.0.0.1 for tests that need a tracking database with a password
(Debian's postgresql package: initdb, pg_ctl, psql). Run as root, the server runs as the
`postgres` user (initdb refuses root); otherwise as the current user.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from vitp.net import free_port

BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)  # newest major first


def _tool(name: str) -> str:
    for d in BIN_DIRS:
        if (d / name).exists():
            return str(d / name)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install PostgreSQL (apt-get install postgresql)")
    return found


class PostgresServer:
    """`PostgresServer(dir)`: a fresh cluster in `dir`, started; `.create(user, password, db)` adds a
    login role (the password goes over psql's stdin, never argv) owning a new database; `.stop()`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.data, self.log = self.root / "data", self.root / "postgres.log"
        self.root.mkdir(parents=True, exist_ok=True)
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.root, "postgres", "postgres")
        self.port = free_port()
        self._run(_tool("initdb"), "-D", str(self.data), "-A", "scram-sha-256", "--auth-local=trust",
                  "-U", "postgres")
        # TCP on loopback with passwords; the admin connects through the socket in root (trust)
        self._run(_tool("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start", "-o",
                  f"-p {self.port} -h 127.0.0.1 -k {self.root}")

    def _run(self, *cmd: str, stdin: str | None = None) -> str:
        p = subprocess.run([*self._as, *cmd], input=stdin, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {p.stderr[-2000:]}")
        return p.stdout

    def create(self, user: str, password: str, database: str) -> None:
        quoted = password.replace("'", "''")
        self._run(_tool("psql"), "-h", str(self.root), "-p", str(self.port), "-U", "postgres", "-v",
                  "ON_ERROR_STOP=1", "-q", stdin=f"CREATE ROLE {user} LOGIN PASSWORD '{quoted}';\n"
                                                 f"CREATE DATABASE {database} OWNER {user};\n")

    def stop(self) -> None:
        subprocess.run([*self._as, _tool("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)
