"""Start and stop a real `mlflow server` subprocess (SQL backend, proxied artifacts) and wait for /health.

Binds 127.0.0.1 unless told otherwise; beyond loopback it needs basic auth (MLflow's `basic-auth`
app) with a non-default admin password, whose generated config lives in a private temp directory
until the server stops; its telemetry off (vitp.net). Used by tests and `vitp mlflow-server`; no torch, no ray.
"""
from __future__ import annotations

import configparser
import io
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from vitp.net import free_port, telemetry_env
from vitp.storage import is_uri, rmtree
from vitp.tracking.redact import redact_text
from vitp.tracking.store import TrackingError, get_client, normalise_uri

log = logging.getLogger(__name__)

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The admin password older MLflow releases shipped in basic_auth.ini (GHSA-gq3w-7jj3-x7gr).
DEFAULT_ADMIN_PASSWORD = "password1234"


@dataclass
class AuthSettings:
    """MLflow basic auth: the admin account and the user store.

    The password is handed to the server through MLFLOW_AUTH_ADMIN_PASSWORD, never written to
    the generated auth config file. It only bootstraps the admin user on an empty user store.
    """

    admin_password: str = ""  # "" = take $MLFLOW_AUTH_ADMIN_PASSWORD
    admin_username: str = "admin"
    # "" = $MLFLOW_AUTH_DATABASE_URI (a URI with a password belongs in the environment, e.g. from a
    # Kubernetes Secret), else auth.db beside a SQLite tracking store, else ./mlflow-server/auth.db
    database_uri: str = ""
    default_permission: str = "READ"  # what a signed-in user may do to others' experiments
    # How long a verified login is trusted without hashing the password again. Each check is a
    # scrypt hash by design (about 0.2 s of server CPU on 2 cores): uncached, 200 metric posts
    # took 45 s of server CPU, cached 2 s (benchmarks/tracking_auth.py, docs/security.md). A
    # password change or user deletion made through the API takes effect at once on the worker
    # that served it, on the others within this time. 0 = check every request.
    cache_ttl_s: int = 60


def check_admin_password(password: str | None) -> str:
    """The admin password to use; TrackingError naming the fix when it is missing or the default."""
    if not password:
        raise TrackingError(
            "basic auth needs an admin password: export MLFLOW_AUTH_ADMIN_PASSWORD=<a long random "
            "password> (e.g. `openssl rand -base64 24`); it is never written to disk or logged"
        )
    if password == DEFAULT_ADMIN_PASSWORD:
        raise TrackingError(
            f"refusing to start: the admin password is MLflow's old published default "
            f"{DEFAULT_ADMIN_PASSWORD!r} (GHSA-gq3w-7jj3-x7gr): set MLFLOW_AUTH_ADMIN_PASSWORD to "
            "a password of your own"
        )
    return password


def _check_external_auth_config(path: str) -> None:
    # A user-supplied MLFLOW_AUTH_CONFIG_PATH may still carry the old default in admin_password.
    cp = configparser.ConfigParser()
    cp.read(path)
    if cp.has_section("mlflow") and cp["mlflow"].get("admin_password", "").strip() == DEFAULT_ADMIN_PASSWORD:
        raise TrackingError(
            f"refusing to start: {path} (MLFLOW_AUTH_CONFIG_PATH) sets admin_password to the "
            f"published default {DEFAULT_ADMIN_PASSWORD!r}: remove it and export "
            "MLFLOW_AUTH_ADMIN_PASSWORD=<your password> instead"
        )


def _auth_db(auth: AuthSettings, backend: str, env: dict[str, str]) -> str:
    """Where the users live: AuthSettings.database_uri, else $MLFLOW_AUTH_DATABASE_URI, else
    `auth.db` beside a SQLite tracking store, else ./mlflow-server/auth.db. Never a temp file:
    users must survive a restart."""
    if auth.database_uri or env.get("MLFLOW_AUTH_DATABASE_URI"):
        return auth.database_uri or env["MLFLOW_AUTH_DATABASE_URI"]
    if backend.startswith("sqlite:///"):
        return f"sqlite:///{Path(backend[len('sqlite:///'):]).resolve().parent / 'auth.db'}"
    return f"sqlite:///{Path('mlflow-server').resolve() / 'auth.db'}"


def _auth_env(auth: AuthSettings, backend: str, env: dict[str, str]) -> tuple[dict[str, str], Path | None]:
    """Environment for the basic-auth app (generated config file, password and CSRF key) and the
    private directory the config file was written to (None: the user's own MLFLOW_AUTH_CONFIG_PATH)."""
    merged = {**os.environ, **env}
    password = check_admin_password(auth.admin_password or merged.get("MLFLOW_AUTH_ADMIN_PASSWORD"))
    out = {"MLFLOW_AUTH_ADMIN_PASSWORD": password}
    private = None
    if merged.get("MLFLOW_AUTH_CONFIG_PATH"):
        _check_external_auth_config(merged["MLFLOW_AUTH_CONFIG_PATH"])
    else:
        db = _auth_db(auth, backend, merged)
        if db.startswith("sqlite:///"):
            Path(db[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        # MLflow reads this file with configparser's %-interpolation: a literal % (in a database
        # password, say) is written %%; any other character is taken as it is
        cp = configparser.ConfigParser(interpolation=None)
        cp["mlflow"] = {
            "default_permission": auth.default_permission,
            "database_uri": db.replace("%", "%%"),
            "admin_username": auth.admin_username,
            "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
            "auth_cache_ttl_seconds": str(auth.cache_ttl_s),
        }
        text = io.StringIO()
        cp.write(text)
        private = Path(tempfile.mkdtemp(prefix="vitp-mlflow-auth-"))  # 0700, a fresh name
        try:
            ini = _write_private(private / "auth.ini", text.getvalue())
        except BaseException:
            rmtree(str(private), str(private))
            raise
        out["MLFLOW_AUTH_CONFIG_PATH"] = str(ini)
    # The CSRF key must be the same in every worker of this server: one random key per start.
    out["MLFLOW_FLASK_SERVER_SECRET_KEY"] = merged.get("MLFLOW_FLASK_SERVER_SECRET_KEY") or secrets.token_hex(32)
    return out, private


def _write_private(path: Path, text: str) -> Path:
    """`text` in a new file at `path` that only this user can read: created here (a file or link
    already at `path` fails the call, nothing is written through it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as e:  # only this user (or root) can write into the fresh 0700 directory
        raise TrackingError(f"{path}: the basic-auth config could not be created afresh ({e.strerror}): "
                            "another process wrote there first; start the server again") from None
    with open(fd, "w") as f:
        f.write(text)
    return path


def _artifact_store_env(artifact_root: str, env: dict[str, str]) -> dict[str, str]:
    """What the server needs to proxy an s3:// artifact store: boto3, and the endpoint.

    MLflow reads an S3-compatible endpoint (MinIO, Ceph, a test server) only from
    MLFLOW_S3_ENDPOINT_URL; the rest of the pipeline reads AWS_ENDPOINT_URL. Without the former,
    the pipeline's (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL) is handed on, so one setting
    serves both.
    """
    if not artifact_root.startswith("s3:"):
        return {}
    try:
        import boto3  # noqa: F401  (the server's S3 artifact repository needs it)
    except ImportError:
        raise TrackingError(
            f"artifacts destination {artifact_root} needs boto3 in this environment: "
            "pip install boto3 (or use a local --artifacts-destination)"
        ) from None
    merged = {**os.environ, **env}
    endpoint = merged.get("AWS_ENDPOINT_URL_S3") or merged.get("AWS_ENDPOINT_URL")
    if not merged.get("MLFLOW_S3_ENDPOINT_URL") and endpoint:
        return {"MLFLOW_S3_ENDPOINT_URL": endpoint}
    return {}


@dataclass
class ServerHandle:
    """A running `mlflow server`; `.uri` is what MlflowClient / RunLogger take."""

    uri: str
    host: str
    port: int
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)
    # The generated basic-auth config (it names the user store, a password in its URI perhaps), in
    # a directory of its own that only this user can read. MLflow reads it in the `mlflow server`
    # process and again in each uvicorn worker it starts, and restarts a worker that dies, so it
    # stays while the server runs: it goes when stop() is called or this process exits.
    auth_config: Path | None = None
    _remove: weakref.finalize | None = field(default=None, init=False, repr=False, compare=False)

    def _own(self, private: Path | None) -> None:
        """Remove `private` (the auth config's directory) when the server stops or this process exits."""
        if private is not None:
            self.auth_config = private / "auth.ini"
            self._remove = weakref.finalize(self, rmtree, str(private), str(private))

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server and the worker processes it spawned (its own process group); its
        generated auth config goes too (also when the server had already exited)."""
        try:
            self._terminate(timeout)
        finally:
            if self._remove is not None:
                self._remove()

    def _terminate(self, timeout: float) -> None:
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
    auth: AuthSettings | None = None,
    allow_unauthenticated: bool = False,
) -> ServerHandle:
    """Launch `python -m mlflow server` from this interpreter and return once /health answers.

    backend_store_uri: a DB URI or a path (".db" -> SQLite). artifact_root: local dir or object-store
    URI (s3://bucket/prefix: credentials and endpoint from the environment, see
    _artifact_store_env) that the server proxies artifacts to (--serve-artifacts), so clients
    need no storage credentials. port=0 picks a free port. jobs=False turns off MLflow's GenAI job executor
    (8 extra processes that this pipeline never uses; on 2 cores it triples start-up time).
    auth: basic auth (refuses the old default admin password). A host beyond loopback needs
    auth unless allow_unauthenticated=True (e.g. behind an authenticating proxy).
    """
    if host not in _LOOPBACK and auth is None and not allow_unauthenticated:
        raise TrackingError(
            f"mlflow server on host {host!r} would be reachable beyond this machine without a "
            "login: turn on basic auth (vitp mlflow-server --auth, with MLFLOW_AUTH_ADMIN_PASSWORD "
            "set) or bind --host 127.0.0.1"
        )
    if auth is not None:  # a bad setting, a missing or default password: refused before anything is written
        if auth.cache_ttl_s < 0:
            raise TrackingError(f"auth cache time {auth.cache_ttl_s} s is negative: give seconds >= 0 "
                                "(0 checks the password on every request)")
        check_admin_password(auth.admin_password or {**os.environ, **(env or {})}.get("MLFLOW_AUTH_ADMIN_PASSWORD"))
    backend = normalise_uri(backend_store_uri)
    if backend.startswith("sqlite:"):
        # Create/migrate the schema here, under our file lock: on a fresh DB the server's own
        # processes can race each other through the migrations and die.
        get_client(backend)
    if not is_uri(artifact_root):
        artifact_root = str(Path(artifact_root).expanduser().resolve())
        Path(artifact_root).mkdir(parents=True, exist_ok=True)
    store_env = _artifact_store_env(artifact_root, env or {})
    if host not in _LOOPBACK and not allowed_hosts:
        log.warning(
            "mlflow server binds %s with the default Host allow-list: pass allowed_hosts "
            "(the names clients use) when exposing it beyond this machine", host
        )
    log_file = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="mlflow-server-", suffix=".log")[1])
    auth_env, private = _auth_env(auth, backend, env or {}) if auth is not None else ({}, None)
    try:
        return _launch(backend, artifact_root, host, port, allowed_hosts, workers, jobs, timeout, log_file,
                       extra_args, {**store_env, **(env or {}), **auth_env}, auth is not None, private)
    except BaseException:  # not started (or interrupted): nothing will read the auth config
        if private is not None:
            rmtree(str(private), str(private))
        raise


def _launch(backend: str, artifact_root: str, host: str, port: int, allowed_hosts, workers: int, jobs: bool,
            timeout: float, log_file: Path, extra_args: Sequence[str], env: dict[str, str], basic_auth: bool,
            private: Path | None) -> ServerHandle:
    """start_server's launch: up to 3 tries where a port we picked was taken before the server bound it."""
    last_error = ""
    for _ in range(3):  # a picked port can be taken before the server binds it
        p = port or free_port(host)  # another process can take it first: retried below
        cmd = [
            sys.executable, "-m", "mlflow", "server",  # the backend URI (a password?) goes by env, not argv
            "--serve-artifacts", "--artifacts-destination", artifact_root,
            "--host", host, "--port", str(p),
            "--workers", str(workers),
        ]
        if allowed_hosts:
            cmd += ["--allowed-hosts", ",".join(allowed_hosts)]
        if basic_auth:
            cmd += ["--app-name", "basic-auth"]
        cmd += list(extra_args)
        out = open(log_file, "ab")
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so stop() reaches its workers too
            env={
                **os.environ,
                # MLflow's telemetry (the server's and its UI's) off unless the user opted in
                **telemetry_env({**os.environ, **env}),
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true" if jobs else "false",
                "MLFLOW_BACKEND_STORE_URI": backend,  # `mlflow server --backend-store-uri`'s envvar
                **env,
            },
        )
        out.close()
        url_host = f"[{host}]" if ":" in host else host
        handle = ServerHandle(f"http://{url_host}:{p}", host, p, proc, log_file, cmd)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and handle.alive():
                if _healthy(handle.uri):
                    handle._own(private)
                    return handle
                time.sleep(0.25)
        except BaseException:  # interrupted (Ctrl-C, a SIGTERM made one): stop what was started
            handle.stop()
            raise
        timed_out = handle.alive()
        last_error = handle.log_tail()
        handle.stop()
        if timed_out or port or "address already in use" not in last_error.lower():
            break  # only a port we picked and lost to another process is worth a retry
    raise TrackingError(
        f"mlflow server (backend {redact_text(backend)}, artifacts {artifact_root}) did not answer /health on "
        f"{host}:{p} within {timeout:.0f}s: check the flags and that the port is free; "
        f"log {log_file}:\n{last_error}"
    )
