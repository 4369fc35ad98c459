"""The Ray Jobs API client: address, token, submit (retried while the job agent starts), follow, wait.

Every failure to reach or be accepted by the cluster becomes a ClusterError (exit 3) whose message
says what to do. Must not print results (the CLI does), parse specs (jobspec.py) or import torch;
Ray is imported only when a client is made.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import urlsplit

from vitp.errors import ClusterError, ConfigError
from vitp.storage import is_uri
from vitp.tracking.redact import redact_text, remember_secret

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# The head's job agent starts beside its raylet, after the dashboard answers: a submit right after
# `ray start` can be refused with this (Ray waits only ~10 s for the agent before refusing).
_NO_AGENT = "No available agent"


def auth_headers() -> dict[str, str]:
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
    remember_secret(token)  # read from a file, not the environment: masked from now on all the same
    return {"Authorization": f"Bearer {token}"} if token else {}


def jobs_address(address: str | None = None) -> str:
    """--address, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else the local dashboard."""
    return (address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
            or DEFAULT_ADDRESS)


def explain(address: str, e: Exception) -> str:
    """What a Jobs API failure means for the user, and the fix."""
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


def client(address: str):
    """A JobSubmissionClient for `address` (http:// added when missing), with the token if set."""
    from ray.job_submission import JobSubmissionClient  # lazy: ray

    if not is_uri(address):
        address = f"http://{address}"
    try:
        return JobSubmissionClient(address, headers=auth_headers())
    except ClusterError:
        raise
    except Exception as e:  # Ray raises ConnectionError / RuntimeError with HTTP details
        raise ClusterError(explain(address, e)) from None


@contextmanager
def cluster_errors(address: str, mask: Callable[[str], str] = redact_text) -> Iterator[None]:
    """Turn the Jobs API's RuntimeErrors (HTTP failures) into a ClusterError saying what to do."""
    try:
        yield
    except ClusterError:
        raise
    except RuntimeError as e:
        raise ClusterError(mask(explain(address, e))) from None


def submit(address: str, kwargs: dict, mask: Callable[[str], str]):
    """(client, job id) of `kwargs` submitted to `address`; any refusal is a ClusterError, masked."""
    jobs = client(address)
    try:
        return jobs, submit_when_agent_ready(jobs, kwargs)
    except ClusterError:
        raise
    except Exception as e:  # HTTP errors arrive as RuntimeError, dropped connections as OSError
        raise ClusterError(mask(explain(address, e))) from None


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


def follow_logs(client, job_id: str, mask: Callable[[str], str], write: Callable[[str], None]) -> None:
    """Pass the job's log chunks, masked, to `write` until the job ends."""
    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            write(mask(chunk))

    asyncio.run(tail())


def status_of(info) -> str:
    """The job status as text ("SUCCEEDED", ...), whether Ray gives an enum or a string."""
    return str(getattr(info.status, "value", info.status))


def wait_for_job(client, job_id: str, poll: float = 1.0):
    """The job's JobDetails once its status is SUCCEEDED, FAILED or STOPPED."""
    while True:
        info = client.get_job_info(job_id)
        if status_of(info) in TERMINAL:
            return info
        time.sleep(poll)


def run_probe_job(address: str, entrypoint: str, timeout: float) -> str:
    """The logs of a short `vitp doctor` probe job running `entrypoint` on the cluster at `address`,
    once it SUCCEEDED; the job is then removed from the cluster's list. No runtime_env: the probe
    uses the nodes' own credentials. ClusterError if it fails, or is not done within `timeout` s."""
    client_ = client(address)
    with cluster_errors(address):
        job_id = submit_when_agent_ready(client_, {"entrypoint": entrypoint, "metadata": {"vitp": "doctor"},
                                                   "submission_id": f"vitp-doctor-{uuid.uuid4().hex[:8]}"},
                                         log=lambda m: None)
        try:
            deadline = time.monotonic() + timeout
            while status_of(info := client_.get_job_info(job_id)) not in TERMINAL:
                if time.monotonic() > deadline:
                    raise ClusterError(f"the probe job {job_id} did not finish within {timeout:.0f}s")
                time.sleep(1)
            logs = client_.get_job_logs(job_id)
        finally:
            _remove_job(client_, job_id)
    if status_of(info) != "SUCCEEDED":
        tail = [ln for ln in logs.splitlines() if ln.strip()][-1:] or [info.message or ""]
        raise ClusterError(f"the probe job {job_id} {status_of(info)}: {redact_text(tail[0].strip())[:300]}")
    return logs


def _remove_job(client_, job_id: str, wait_s: float = 15.0) -> None:
    """Stop the job if it still runs and delete it from the cluster's job list (best effort: the
    caller has said its outcome)."""
    with contextlib.suppress(Exception):
        deadline = time.monotonic() + wait_s
        while status_of(client_.get_job_info(job_id)) not in TERMINAL and time.monotonic() < deadline:
            client_.stop_job(job_id)
            time.sleep(1)
        client_.delete_job(job_id)


# ----------------------------------------------------------------- the jobs' MLflow address


def loopback_host(uri: str) -> str | None:
    """The host of an http(s) `uri` when it names this machine's loopback (localhost, 127.0.0.0/8,
    ::1, 0.0.0.0), else None."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname
    if host.lower() == "localhost":
        return host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return host if (ip.is_loopback or ip.is_unspecified) else None


def this_machines_addresses() -> set[str]:
    """Every IP address of this machine's interfaces (loopback included)."""
    import socket

    import psutil  # Ray's dependency

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


def node_ips(jobs_client) -> list[str]:
    """The IP address of each live node of the cluster behind `jobs_client`, from its dashboard's
    state API (Ray's own `ray list nodes` reads the same)."""
    response = jobs_client._do_request("GET", "/api/v0/nodes?limit=10000&detail=0")
    response.raise_for_status()
    nodes = response.json()["data"]["result"]["result"]
    return [n["node_ip"] for n in nodes if n.get("state") == "ALIVE"]


def check_job_tracking(spec_env: dict, address: str, nodes: Callable[[], list[str]]) -> None:
    """ConfigError, before anything is submitted, where the job would be sent this machine's
    loopback as its MLflow address (MLFLOW_TRACKING_URI in `spec_env`) and the cluster at `address`
    is not this machine: its drivers would log to themselves. A cluster is this machine when every
    node's address is one of this machine's (cluster/local.sh); `nodes()` (their addresses, e.g.
    node_ips of a client) is asked only where `address` itself is this machine."""
    uri = str(spec_env.get("MLFLOW_TRACKING_URI") or "")
    if not loopback_host(uri):
        return
    mine = this_machines_addresses()
    host = urlsplit(address if is_uri(address) else f"http://{address}").hostname or ""
    elsewhere: list[str] = []
    if loopback_host(f"http://{host}") or host in mine:
        try:
            elsewhere = [ip for ip in nodes() if ip not in mine]
        except ClusterError:
            raise
        except Exception as e:  # noqa: BLE001 - an older dashboard, a proxy: cannot tell, so refuse
            if "connect" in str(e).lower():
                raise ClusterError(explain(address, e)) from None
            elsewhere = [f"(cannot list its nodes: {type(e).__name__})"]
    else:
        elsewhere = [host]
    if elsewhere:
        raise ConfigError(
            f"the job would log to MLFLOW_TRACKING_URI={redact_text(uri)}, this machine's loopback, which the "
            f"cluster at {address} (nodes {', '.join(elsewhere[:3])}) cannot reach: pass --job-tracking-uri "
            "<MLflow as the cluster reaches it, e.g. http://mlflow.mlflow.svc.cluster.local:5000> or export "
            "VITP_JOB_TRACKING_URI")
