"""Cluster-facing commands: `vitp submit` (Ray Jobs API), `vitp jobs`, `vitp mlflow-server`.

`add_parsers(sub)` adds the subcommands to `vitp` and returns {name: handler}. Spec checks live
in `jobs_spec.py`; nothing here prints a secret value or binds beyond 127.0.0.1 by default.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Callable

from .config import ConfigError

# Exit codes beyond the CLI's 0 (ok) and 2 (bad input): the job failed / was stopped, or the
# cluster could not be reached or refused us.
EXIT_JOB_FAILED = 1
EXIT_JOB_STOPPED = 4
EXIT_CLUSTER = 3
_TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class ClusterError(RuntimeError):
    """The jobs API was unreachable or refused the request; the message says what to do."""


def _auth_headers() -> dict[str, str]:
    """Bearer token from $RAY_AUTH_TOKEN or the file $RAY_AUTH_TOKEN_PATH (Ray's own names).

    Passed explicitly so a submission carries the token whatever RAY_AUTH_MODE says here.
    """
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    if not token and path:
        try:
            with open(os.path.expanduser(path)) as f:
                token = f.read().strip()
        except OSError as e:
            raise ClusterError(f"RAY_AUTH_TOKEN_PATH={path}: cannot read the token ({e.strerror}): "
                               "point it at the cluster's token file") from None
    return {"Authorization": f"Bearer {token}"} if token else {}


def _address(args: argparse.Namespace) -> str:
    return (args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
            or "http://127.0.0.1:8265")


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    if "://" not in address:
        address = f"http://{address}"
    try:
        return JobSubmissionClient(address, headers=_auth_headers())
    except Exception as e:  # Ray raises ConnectionError / RuntimeError with HTTP details
        raise ClusterError(_explain(address, e)) from None


def _explain(address: str, e: Exception) -> str:
    text = str(e)
    low = text.lower()
    if "401" in text or "authentication required" in low or "missing authentication" in low:
        return (f"the Ray cluster at {address} requires a token (token authentication is on) and "
                "none was sent: export RAY_AUTH_TOKEN_PATH=<the cluster's token file> or "
                "RAY_AUTH_TOKEN, then retry")
    if "403" in text or "invalid authentication" in low or "authentication failed" in low:
        return (f"the Ray cluster at {address} rejected the token: use the token the cluster was "
                "started with (RAY_AUTH_TOKEN_PATH / RAY_AUTH_TOKEN)")
    if "connect" in low:
        return (f"cannot reach the Ray jobs API at {address}: start the cluster (cluster/local.sh "
                "start), port-forward the head's dashboard port, or pass --address")
    return f"Ray jobs API at {address}: {text.splitlines()[0] if text else type(e).__name__}"


# ------------------------------------------------------------------------------ submit


def cmd_submit(args: argparse.Namespace) -> int:
    from .jobs_spec import check_upload_size, load_spec

    spec = load_spec(args.spec, args.overrides)
    notes = check_upload_size(spec)
    address = _address(args)
    print(f"job spec {args.spec}: recipe(s) "
          f"{', '.join(c.recipe for c in spec.calls if c.recipe) or '(none)'} resolve")
    for line in spec.describe() + notes:
        print(f"  {line}")
    try:
        client = _client(address)
        job_id = submit_when_agent_ready(client, spec.kwargs)
    except ClusterError as e:
        print(f"vitp submit: {e}", file=sys.stderr)
        return EXIT_CLUSTER
    except Exception as e:
        print(f"vitp submit: {spec.mask(_explain(address, e))}", file=sys.stderr)
        return EXIT_CLUSTER
    print(f"submitted {job_id} to {address}")
    print(f"  logs: vitp jobs logs {job_id} --address {address}")
    print(f"  stop: vitp jobs stop {job_id} --address {address}")
    sys.stdout.flush()
    if args.no_wait:
        return 0
    if args.follow:
        asyncio.run(_stream_logs(client, job_id, spec.mask))
    return _wait_and_report(client, job_id, spec.mask)


# The head's job agent starts beside its raylet, after the dashboard answers: a submit right after
# `ray start` can be refused with this (Ray waits only ~10 s for the agent before refusing).
_NO_AGENT = "No available agent"


def submit_when_agent_ready(client, kwargs: dict, wait_s: float = 90.0, poll_s: float = 3.0,
                            log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> str:
    """client.submit_job(**kwargs), retried while the cluster says its job agent is not up yet.

    Only that refusal is retried (nothing was submitted); any other error is raised at once.
    """
    t0 = time.monotonic()
    while True:
        try:
            return client.submit_job(**kwargs)
        except RuntimeError as e:
            waited = time.monotonic() - t0
            if _NO_AGENT not in str(e) or waited + poll_s > wait_s:
                raise
            log(f"the cluster's job agent is not up yet (a node that just started?); "
                f"retrying ({waited:.0f}s of {wait_s:.0f}s)")
            time.sleep(poll_s)


async def _stream_logs(client, job_id: str, mask: Callable[[str], str]) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(mask(chunk))
        sys.stdout.flush()


def _wait_and_report(client, job_id: str, mask: Callable[[str], str], poll: float = 1.0) -> int:
    while True:
        info = client.get_job_info(job_id)
        status = str(getattr(info.status, "value", info.status))
        if status in _TERMINAL:
            break
        time.sleep(poll)
    if status == "SUCCEEDED":
        print(f"job {job_id} SUCCEEDED")
        return 0
    message = mask(info.message or "")
    print(f"vitp submit: job {job_id} {status}: {message}".rstrip(), file=sys.stderr)
    return EXIT_JOB_STOPPED if status == "STOPPED" else EXIT_JOB_FAILED


# -------------------------------------------------------------------------------- jobs


def cmd_jobs(args: argparse.Namespace) -> int:
    from .tracking.redact import redact_text

    address = _address(args)
    try:
        client = _client(address)
        if args.action == "list":
            jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
            if not jobs:
                print(f"no jobs on {address}")
            for j in jobs:
                status = str(getattr(j.status, "value", j.status))
                started = time.strftime("%Y-%m-%d %H:%M", time.localtime((j.start_time or 0) / 1000))
                print(f"{j.submission_id or j.job_id:28s} {status:10s} {started}  "
                      f"{redact_text(j.entrypoint or '')[:100]}")
            return 0
        if not args.job_id:
            raise ConfigError(f"vitp jobs {args.action}: name the job, e.g. vitp jobs {args.action} raysubmit_...")
        if args.action == "stop":
            stopped = client.stop_job(args.job_id)
            print(f"{args.job_id}: {'stop requested' if stopped else 'already finished'}")
            return 0
        if args.follow:
            asyncio.run(_stream_logs(client, args.job_id, redact_text))
        else:
            sys.stdout.write(redact_text(client.get_job_logs(args.job_id)))
        return 0
    except ClusterError as e:
        print(f"vitp jobs: {e}", file=sys.stderr)
        return EXIT_CLUSTER
    except RuntimeError as e:
        print(f"vitp jobs: {_explain(address, e)}", file=sys.stderr)
        return EXIT_CLUSTER


# ----------------------------------------------------------------------- mlflow-server


def cmd_mlflow_server(args: argparse.Namespace) -> int:
    from .tracking.runs import TrackingError
    from .tracking.server import AuthSettings, start_server

    allowed = [h for h in (args.allowed_hosts or "").split(",") if h]
    try:
        handle = start_server(
            args.backend_store_uri, args.artifacts_destination, host=args.host, port=args.port,
            allowed_hosts=allowed or None, workers=args.workers,
            auth=AuthSettings() if args.auth else None, log_path=args.log,
        )
    except TrackingError as e:
        print(f"vitp mlflow-server: {e}", file=sys.stderr)
        return 2
    print(f"mlflow server at {handle.uri} (backend {args.backend_store_uri}, artifacts "
          f"{args.artifacts_destination}, auth {'basic' if args.auth else 'off'}); log {handle.log_path}")
    print(f"  clients: export MLFLOW_TRACKING_URI={handle.uri}"
          + ("  MLFLOW_TRACKING_USERNAME=... MLFLOW_TRACKING_PASSWORD=..." if args.auth else ""))
    print("  Ctrl-C stops it", flush=True)
    try:
        while handle.alive():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
    return 0 if not handle.process.returncode else 1


# ----------------------------------------------------------------------------- parsers


def add_parsers(sub) -> dict[str, Callable[[argparse.Namespace], int]]:
    address_help = ("Ray jobs API (dashboard) address, e.g. http://127.0.0.1:8265 (default "
                    "$RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, then http://127.0.0.1:8265); a token "
                    "from $RAY_AUTH_TOKEN or $RAY_AUTH_TOKEN_PATH is sent when set")

    p = sub.add_parser("submit", help="submit a Ray job spec (jobs/*.yaml) through the Ray Jobs API",
                       description="Validate a job spec, resolve its recipe, check the working_dir "
                                   "size, submit it and wait. Exit 0 when the job SUCCEEDED, 1 "
                                   "FAILED, 4 STOPPED, 3 cluster unreachable or refused, 2 bad spec.")
    p.add_argument("spec", help="job spec YAML, e.g. jobs/pretrain_h14.yaml")
    p.add_argument("--address", help=address_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override appended to the spec's vitp command (repeatable)")
    p.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    p.add_argument("--no-wait", action="store_true", help="return once submitted")

    p = sub.add_parser("jobs", help="list Ray jobs, stop one, or print its logs")
    p.add_argument("action", nargs="?", choices=["list", "stop", "logs"], default="list")
    p.add_argument("job_id", nargs="?", help="submission id (for stop / logs)")
    p.add_argument("--address", help=address_help)
    p.add_argument("--follow", action="store_true", help="logs: stream until the job ends")

    p = sub.add_parser("mlflow-server", help="run an MLflow tracking server (SQL store, proxied artifacts)",
                       description="Binds 127.0.0.1 unless --host says otherwise; a non-loopback "
                                   "host needs --auth (basic auth; admin password from "
                                   "$MLFLOW_AUTH_ADMIN_PASSWORD, never the old default).")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--backend-store-uri", default="sqlite:///mlflow-server/mlflow.db",
                   help="SQL store: sqlite:///path.db or postgresql://... (default %(default)s)")
    p.add_argument("--artifacts-destination", default="mlflow-server/artifacts",
                   help="artifact store the server proxies: a directory or s3://, gs:// URI")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host header values to accept (DNS-rebinding guard), "
                        "e.g. mlflow.example.com,mlflow.mlflow.svc")
    p.add_argument("--auth", action="store_true", help="basic auth (MLflow's basic-auth app)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--log", help="server log file (default a temp file)")

    return {"submit": cmd_submit, "jobs": cmd_jobs, "mlflow-server": cmd_mlflow_server}
