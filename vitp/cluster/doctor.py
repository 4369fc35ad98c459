"""`vitp doctor`: preflight checks (cluster + token, storage from here and other nodes, MLflow, shards).

One line per check (each with a timeout): `ok   <check>: <detail>` or `FAIL <check>: <what failed> -> <fix>`.
Exit 0 when all pass, 3 (EXIT_FAILED) when any fails (2: bad recipe or --set). Must not train, print a secret,
or leave probes or runs behind. Probes: doctor_storage.py (`python -m vitp.cluster.doctor` runs them on a cluster).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from vitp import storage
from vitp.cluster.checks import (EXIT_FAILED, TIMEOUTS, Check, exit_code, first_line,  # noqa: F401 - exit_code: cli
                                 timed)
from vitp.cluster.doctor_mlflow import check_mlflow
from vitp.cluster.doctor_storage import RESULT_TAG, TRACKING_TAG, live_nodes, check_storage
from vitp.cluster.jobspec import DRIVER_RESOURCE
from vitp.config import Run
from vitp.errors import ClusterError

TOKEN_FIX = "export RAY_AUTH_TOKEN_PATH=<the cluster's token file> (or RAY_AUTH_TOKEN=<the token>) and retry"
UNREACHABLE_FIX = ("start the cluster (cluster/local.sh start, ray up), port-forward the head's dashboard "
                   "port 8265, or pass --address http://<head>:8265")
DRIVER_FIX = (f"start the head with --resources '{{\"{DRIVER_RESOURCE}\": 16}}' (cluster/*.yaml, "
              "cluster/kuberay/raycluster.yaml and cluster/local.sh do), or drop entrypoint_resources from your "
              "spec (docs/cluster.md, 'Where drivers run')")


# ------------------------------------------------------------------------------ 1. cluster
@dataclass
class Cluster:  # what the cluster check found: its address, Jobs API or not, live nodes {"id", "ip", "cpus", "gpus"}
    address: str
    jobs_api: bool
    nodes: list[dict]


def _get(url: str, headers: dict, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _summary(nodes: list[dict]) -> str:
    return f"{len(nodes)} node(s) alive, {sum(n['cpus'] for n in nodes):g} CPUs, {sum(n['gpus'] for n in nodes):g} GPUs"


def _dashboard(address: str, found: list[Cluster]) -> Check:
    from vitp.cluster.jobs import auth_headers  # lazy: mlflow, via redaction
    try:
        headers = auth_headers()
    except ClusterError:
        return Check("cluster", False, f"RAY_AUTH_TOKEN_PATH={os.environ.get('RAY_AUTH_TOKEN_PATH')} cannot be "
                     "read", "point RAY_AUTH_TOKEN_PATH at the cluster's token file")
    try:
        mode = json.loads(_get(f"{address}/api/authentication_mode", {}, 5)[1] or b"{}")
        status, body = _get(f"{address}/api/version", headers, 5)
    except (OSError, ValueError) as e:  # URLError, refused, timeout; ValueError: not a dashboard
        reason = first_line(str(getattr(e, "reason", e)))
        return Check("cluster", False, f"no Ray dashboard answers at {address} ({reason})", UNREACHABLE_FIX)
    if status in (401, 403):
        return Check("cluster", False, f"{address} requires a token (token authentication is on) and none "
                     "was sent" if status == 401 else f"{address} rejected the token", TOKEN_FIX if status == 401
                     else "use the token the cluster was started with: RAY_AUTH_TOKEN_PATH=<its token file> "
                          "or RAY_AUTH_TOKEN")
    version = json.loads(body).get("ray_version", "?") if status == 200 else ""
    status, body = _get(f"{address}/api/v0/nodes?limit=10000", headers, 20) if version else (status, b"")
    if status != 200:
        return Check("cluster", False, f"{address} answered HTTP {status} to the Ray dashboard API",
                     "pass the Ray dashboard / Jobs API address (http://<head>:8265) as --address")
    nodes = [{"id": n["node_id"], "ip": n.get("node_ip", "?"), "cpus": n.get("resources_total", {}).get("CPU", 0),
              "gpus": n.get("resources_total", {}).get("GPU", 0),
              "drivers": n.get("resources_total", {}).get(DRIVER_RESOURCE, 0)}
             for n in json.loads(body)["data"]["result"]["result"] if n.get("state") == "ALIVE"]
    found.append(Cluster(address, True, nodes))
    if not any(n["drivers"] for n in nodes):
        return _no_driver_slot(address, version)
    auth = "token accepted" if mode.get("authentication_mode") == "token" else "token auth off"
    return Check("cluster", True, f"{address} answers (Ray {version}, {auth}): {_summary(nodes)}")


def _no_driver_slot(address: str, version: str) -> Check:
    return Check("cluster", False, f"{address} answers (Ray {version}) but no node offers {DRIVER_RESOURCE}, which "
                 "the shipped job specs' drivers ask for (they would wait until Ray gives up)", DRIVER_FIX)


def _join(address: str, cfg, found: list[Cluster]) -> Check:
    """A GCS host:port, ray:// or "auto" address: join the cluster as a driver (connect_ray)."""
    import ray

    from vitp.cluster.connect import connect_ray  # lazy: ray
    if address != "auto":
        u = urlsplit(address if storage.is_uri(address) else f"//{address}")
        try:  # fail in seconds where ray.init would retry for minutes
            socket.create_connection((u.hostname, u.port or 6379), timeout=5).close()
        except OSError as e:
            return Check("cluster", False, f"nothing answers at {address} ({e.strerror or e})",
                         "start the cluster or fix host/port (GCS :6379, ray://...:10001), or pass "
                         "the dashboard address --address http://<head>:8265")
    try:
        connect_ray(cfg, address)
    except Exception as e:  # noqa: BLE001 - Ray raises many kinds; auth failures are told apart by text
        text = first_line(str(e))
        return Check("cluster", False, f"cannot join the Ray cluster at {address} ({text})", TOKEN_FIX
                     if "auth" in text.lower() or "token" in text.lower() else
                     "check --address and that this machine's Ray and Python match the cluster's")
    found.append(Cluster(address, False, live_nodes()))
    if not any(n["drivers"] for n in found[0].nodes):
        return _no_driver_slot(address, ray.__version__)
    return Check("cluster", True, f"{address} answers (Ray {ray.__version__}): {_summary(found[0].nodes)}")


# ------------------------------------------------------------------------------ 3. MLflow, 4. shards
def check_data(run: Run) -> Check:
    """The shards the recipe trains on are finished (manifest.json present)."""
    cfg, root = run.cfg, run.shards
    if storage.isfile(manifest := storage.join(root, "manifest.json")):
        counts = storage.read_json(manifest).get("counts", {})
        return Check("data", True, f"shards at {root} ({', '.join(f'{k} {v}' for k, v in counts.items())})")
    if cfg.data.source in ("synthetic", "digits"):
        return Check("data", True, f"no shards at {root} yet: training makes them from the bundled "
                     f"{cfg.data.source} corpus")
    return Check("data", False, f"no finished shards at {root} (no manifest.json)",
                 f"run `vitp preprocess {cfg.recipe} --set data.path=<corpus>` with the same work_dir (on a "
                 "cluster: vitp submit jobs/preprocess_*.yaml), or set data.shards to existing shards")


def run_checks(run: Run, address: str | None, emit: Callable[[Check], None], job_uri: str | None = None,
               allreduce: float | None = None) -> list[Check]:
    """Every check in order, each line passed to `emit` as soon as it is known; with `allreduce` (the
    least bus bandwidth in GB/s to accept, 0: any) also the Train gang's all-reduce (allreduce.py)."""
    from vitp.cluster.jobs import jobs_address  # lazy: mlflow, via redaction
    cfg = run.cfg
    # MLflow retries a dead server for minutes (here: once, 20 s a request) and prints "View run" lines.
    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20", **os.environ,
                       "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"})
    address, found = jobs_address(address), []
    # A dashboard (http) address through its REST API, others (GCS host:port, ray://) by joining.
    dashboard = storage.is_uri(address) and urlsplit(address).scheme in ("http", "https")
    checks = [timed("cluster", lambda: _dashboard(address.rstrip("/"), found) if dashboard else
                    _join(address, cfg, found), TIMEOUTS["cluster"],
                    "check --address and that the head is up")]
    emit(checks[0])
    job_uri = job_tracking_uri(run, job_uri)
    tracking: dict = {}
    checks += check_storage(cfg.work_dir, found[0] if checks[0].ok and found else None, emit, job_uri, tracking)
    if allreduce is not None:
        checks.append(_allreduce_line(cfg, found[0] if checks[0].ok and found else None, allreduce))
        emit(checks[-1])
    later = [("mlflow", lambda: check_mlflow(run), "check --tracking-uri and the server's log")]
    if job_uri:
        later.append(("mlflow from cluster", lambda: _tracking_line(job_uri, tracking), JOB_URI_FIX))
    later.append(("data", lambda: check_data(run), f"check data.shards / work_dir={cfg.work_dir}"))
    for name, fn, fix in later:
        checks.append(timed(name, fn, TIMEOUTS[name], fix))
        emit(checks[-1])
    return checks


def _allreduce_line(cfg, cluster: Cluster | None, min_busbw: float) -> Check:
    from vitp.cluster import allreduce  # lazy: ray

    if cluster is None:
        return Check("all-reduce", False, "not checked: no cluster", "fix the cluster line above")
    limit = TIMEOUTS["all-reduce"]
    return timed("all-reduce", lambda: allreduce.check(cluster.address, cluster.jobs_api, allreduce.Gang.of(cfg),
                                                       cfg.work_dir, min_busbw, limit - 30), limit,
                 f"the recipe's {cfg.parallel.num_workers} Train workers must fit the cluster (vitp jobs list: "
                 "is a job holding them?); then " + allreduce.FIX)


JOB_URI_FIX = ("pass --job-tracking-uri (or export VITP_JOB_TRACKING_URI) with the address the cluster's "
               "pods reach the server at, e.g. http://mlflow.mlflow.svc.cluster.local:5000, while "
               "MLFLOW_TRACKING_URI stays what this machine uses (a port-forward)")


def job_tracking_uri(run: Run, given: str | None) -> str:
    """The MLflow address the jobs use: `given` (--job-tracking-uri, default $VITP_JOB_TRACKING_URI),
    else this machine's when it is a server's (jobs on the cluster cannot read a local SQLite file)."""
    if given:
        return given
    with contextlib.suppress(Exception):  # the mlflow check says what is wrong with it
        uri = run.tracking_uri
        return uri if urlsplit(uri).scheme in ("http", "https") else ""
    return ""


def _tracking_line(uri: str, tracking: dict) -> Check:
    if not tracking:
        return Check("mlflow from cluster", False, "not checked: the probe job did not run",
                     "fix the storage on cluster line above")
    if tracking["ok"]:
        return Check("mlflow from cluster", True, f"the jobs' address: {tracking['detail']}")
    return Check("mlflow from cluster", False, f"the jobs' address: {tracking['detail']} from the head", JOB_URI_FIX)


if __name__ == "__main__":  # the probe job: python -m vitp.cluster.doctor ROOT SHARED EXPECTED [TRACKING_URI]
    import sys
    from vitp.cluster import doctor_storage  # the importable module, so Ray pickles its functions by name
    if len(sys.argv) > 4:
        print(TRACKING_TAG + json.dumps(doctor_storage.probe_tracking(sys.argv[4])), flush=True)
    print(RESULT_TAG + json.dumps(doctor_storage.cluster_probe(*sys.argv[1:4], include_self=True)), flush=True)
