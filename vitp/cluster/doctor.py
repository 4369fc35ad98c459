"""`vitp doctor`: preflight checks (cluster + token, storage from here and other nodes, MLflow, shards).

One line per check (each with a timeout): `ok   <check>: <detail>` or `FAIL <check>: <what failed> -> <fix>`.
Exit 0 when all pass, 3 (EXIT_FAILED) when any fails (2: bad recipe or --set). Must not train, print a
secret, or leave probes or runs behind. `python -m vitp.cluster.doctor` is the cluster-side probe job.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from vitp import storage
from vitp.cluster.checks import EXIT_FAILED, Check, exit_code, first_line, timed  # noqa: F401 - exit_code: cli
from vitp.cluster.doctor_mlflow import check_mlflow
from vitp.cluster.jobspec import DRIVER_RESOURCE
from vitp.config import Run
from vitp.errors import ClusterError

PROBE_DIR = ".vitp-doctor"
RESULT_TAG = "VITP_DOCTOR_PROBE "  # the probe job's result line in its logs
TRACKING_TAG = "VITP_DOCTOR_TRACKING "  # ... and its MLflow reachability line
TOKEN_FIX = "export RAY_AUTH_TOKEN_PATH=<the cluster's token file> (or RAY_AUTH_TOKEN=<the token>) and retry"
UNREACHABLE_FIX = ("start the cluster (cluster/local.sh start, ray up), port-forward the head's dashboard "
                   "port 8265, or pass --address http://<head>:8265")
DRIVER_FIX = (f"start the head with --resources '{{\"{DRIVER_RESOURCE}\": 16}}' (cluster/*.yaml, "
              "cluster/kuberay/raycluster.yaml and cluster/local.sh do), or drop entrypoint_resources from your "
              "spec (docs/cluster.md, 'Where drivers run')")
TIMEOUTS = {"cluster": 45.0, "storage here": 60.0, "storage on cluster": 240.0, "mlflow": 90.0,
            "mlflow from cluster": 5.0, "data": 30.0, "all-reduce": 900.0}


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


def _ray_nodes() -> list[dict]:
    import ray
    return [{"id": n["NodeID"], "ip": n.get("NodeManagerAddress", "?"), "cpus": n["Resources"].get("CPU", 0),
             "gpus": n["Resources"].get("GPU", 0), "drivers": n["Resources"].get(DRIVER_RESOURCE, 0)}
            for n in ray.nodes() if n.get("Alive")]


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
    found.append(Cluster(address, False, _ray_nodes()))
    if not any(n["drivers"] for n in found[0].nodes):
        return _no_driver_slot(address, ray.__version__)
    return Check("cluster", True, f"{address} answers (Ray {ray.__version__}): {_summary(found[0].nodes)}")


# ------------------------------------------------------------------------------ 2. storage
def _delete(path: str) -> None:
    fs, inner = storage.filesystem(path)  # local paths too (LocalFileSystem)
    fs.delete_file(inner)


def probe_storage(root: str, where: str, shared: str = "", expected: str = "") -> dict:
    """Read `shared` (the doctor's machine wrote it); write, list, read, delete root/.vitp-doctor/probe-*."""
    name, folder = f"probe-{uuid.uuid4().hex[:12]}", storage.join(root, PROBE_DIR)
    path, data, step = storage.join(folder, name), where.encode(), "read what this machine wrote"
    try:
        if shared and storage.read_bytes(shared).decode() != expected:
            raise OSError(f"{shared} holds other bytes than this machine wrote")
        step = "write"
        storage.write_bytes(path, data)
        step = "list"
        if name not in storage.listdir(folder):
            raise OSError(f"{path} was written but is not listed in {folder}")
        step = "read back"
        if storage.read_bytes(path) != data:
            raise OSError(f"{path} reads back other bytes than were written")
        step = "delete"
        _delete(path)
        if storage.exists(path):
            raise OSError(f"{path} is still there after deleting it")
        return {"where": where, "ok": True}
    except Exception as e:  # noqa: BLE001 - reported as this node's FAIL line
        return {"where": where, "ok": False, "step": step, "error": f"{type(e).__name__}: {first_line(str(e))}"}


def storage_fix(root: str, error: str, step: str = "") -> str:
    """The fix for a failed probe of `root`, from the error's text."""
    low, unshared = error.lower(), step.startswith("read what")
    if not storage.is_uri(root):
        return (f"{root} is not shared between the nodes: use object storage (--set work_dir=s3://<bucket>/<prefix>)"
                " or one filesystem mounted at the same path on every node") if unshared else \
            f"make {root} writable by this user (on every node), or use object storage (--set work_dir=s3://...)"
    bucket, endpoint = urlsplit(root).netloc, os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if any(k in low for k in ("no_such_bucket", "nosuchbucket", "bucket does not exist")) or (
            "bucket '" in low and "not found" in low):  # pyarrow: "Bucket 'x' not found."
        return (f"create the bucket (aws s3 mb s3://{bucket}) or fix work_dir / $VITP_STORE; the endpoint "
                f"is AWS_ENDPOINT_URL={endpoint or '(unset: AWS S3)'}")
    if any(k in low for k in ("access_denied", "accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
                              "invalid_access_key", "signature", "credentials", "expired")):
        return ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, the nodes' instance role) to "
                f"an identity allowed to put, list, get and delete objects in s3://{bucket} (on a cluster: in "
                "the nodes' own environment or role; doctor forwards none from this shell)")
    if any(k in low for k in ("connect", "resolve", "curl", "timed out", "timeout", "network")):
        return (f"the object store does not answer: set AWS_ENDPOINT_URL to it (now {endpoint or 'unset = AWS S3'})"
                " on this machine and the nodes")
    return "give every node the same storage settings as this machine (AWS_ENDPOINT_URL, credentials)" if unshared \
        else f"check work_dir={root} and AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"


def _storage_line(name: str, root: str, results: list[dict], note: str = "") -> Check:
    bad = [r for r in results if not r["ok"]]
    if bad:
        r, more = bad[0], f" (and {len(bad) - 1} more node(s))" if len(bad) > 1 else ""
        return Check(name, False, f"{r['where']}: {r['step']} under {root} failed: {r['error']}{more}",
                     storage_fix(root, r["error"], r["step"]))
    return Check(name, True, f"wrote, listed, read back and deleted a probe under {root} from "
                             f"{', '.join(r['where'] for r in results)}{note}")


def cluster_probe(root: str, shared: str, expected: str, include_self: bool, timeout: float = 120.0) -> list[dict]:
    """probe_storage in a task on every other live node (this one if it is alone), and (include_self) here."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    if not ray.is_initialized():
        ray.init(logging_level="WARNING")
    me, nodes = ray.get_runtime_context().get_node_id(), _ray_nodes()
    targets = [n for n in nodes if n["id"] != me] or [n for n in nodes if n["id"] == me]
    task = ray.remote(num_cpus=0, max_retries=0)(probe_storage)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["id"], soft=False)).remote(
                root, f"{'only node' if n['id'] == me else 'node'} {n['ip']} ({n['id'][:8]})", shared, expected)
            for n in targets]
    here = [probe_storage(root, f"job driver ({me[:8]})", shared, expected)] if include_self else []
    return here + ray.get(refs, timeout=timeout)


def probe_tracking(uri: str) -> dict:
    """Whether an MLflow server answers at `uri` from where this runs ({"ok", "detail"}): its /health,
    which needs no login. Not a server (sqlite:, a path): nothing to reach, ok."""
    from vitp.tracking.redact import redact_text  # lazy: mlflow
    shown = redact_text(uri)  # a URI with a password in it is printed without it
    if urlsplit(uri).scheme not in ("http", "https"):
        return {"ok": True, "detail": f"{shown} is not a server: nothing to reach"}
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10) as r:
            return {"ok": r.status == 200, "detail": f"{shown} answers (HTTP {r.status})"}
    except urllib.error.HTTPError as e:
        return {"ok": False, "detail": f"{shown} answered HTTP {e.code} to /health"}
    except (OSError, ValueError) as e:  # URLError: its reason (connection refused, no such host, ...)
        why = first_line(str(getattr(e, "reason", e)))
        return {"ok": False, "detail": f"no MLflow server answers at {shown} ({redact_text(why)})"}


def _probe_job(cluster: Cluster, root: str, shared: str, expected: str, timeout: float,
               tracking_uri: str = "") -> tuple[list[dict], dict | None]:
    """cluster_probe (and probe_tracking of the jobs' MLflow address) run as a Ray job, its driver on
    the head, with the nodes' own credentials: none are forwarded from this shell (a runtime_env is
    stored by the Jobs API and written into Ray's runtime-env agent log on every node it reaches)."""
    from vitp.cluster import jobs  # lazy: ray, mlflow
    entrypoint = shlex.join(["python", "-m", "vitp.cluster.doctor", root, shared, expected]
                            + ([tracking_uri] if tracking_uri else []))
    logs = jobs.run_probe_job(cluster.address, entrypoint, timeout)
    lines = [ln for ln in logs.splitlines() if ln.startswith(RESULT_TAG)]
    if not lines:
        raise ClusterError(f"the probe job printed no result: {first_line((logs.strip().splitlines() or [''])[-1])}")
    tracking = [json.loads(ln[len(TRACKING_TAG):]) for ln in logs.splitlines() if ln.startswith(TRACKING_TAG)]
    return json.loads(lines[-1][len(RESULT_TAG):]), (tracking[-1] if tracking else None)


def _cleanup(root: str, shared: str = "") -> None:
    with contextlib.suppress(Exception):  # best effort: a leftover probe is harmless, the checks said what failed
        if shared and storage.exists(shared):
            _delete(shared)
        if not [n for n in storage.listdir(storage.join(root, PROBE_DIR)) if n.startswith(("probe-", "shared-"))]:
            storage.rmtree(storage.join(root, PROBE_DIR), root)


def check_storage(root: str, cluster: Cluster | None, emit: Callable[[Check], None],
                  tracking_uri: str = "", tracking: dict | None = None) -> list[Check]:
    """Probe `root` from this machine, then from the cluster's nodes (reading what this machine wrote);
    the same probe job asks whether MLflow answers at `tracking_uri` from the cluster (into `tracking`)."""
    emit(here := timed("storage here", lambda: _storage_line("storage here", root, [probe_storage(root, "here")]),
                       TIMEOUTS["storage here"], storage_fix(root, "timeout")))
    if cluster is None:
        _cleanup(root)
        emit(out := Check("storage on cluster", False, "not checked: no cluster", "fix the cluster line above"))
        return [here, out]
    shared, expected = storage.join(root, PROBE_DIR, f"shared-{uuid.uuid4().hex[:12]}"), uuid.uuid4().hex

    def on_cluster() -> Check:
        try:
            storage.write_bytes(shared, expected.encode())
            share = (shared, expected)
        except Exception:  # noqa: BLE001 - "storage here" says why; jobs only need the nodes' access
            share = ("", "")
        try:
            if cluster.jobs_api:
                results, found = _probe_job(cluster, root, *share, TIMEOUTS["storage on cluster"] - 30, tracking_uri)
                if found is not None and tracking is not None:
                    tracking.update(found)
            else:  # this process joined the cluster: it asks MLflow from here
                results = cluster_probe(root, *share, include_self=False)
                if tracking_uri and tracking is not None:
                    tracking.update(probe_tracking(tracking_uri))
        except ClusterError as e:
            return Check("storage on cluster", False, first_line(str(e)),
                         f"see `vitp jobs logs <that id> --address {cluster.address}`; the cluster's image needs "
                         "this package (cluster/Dockerfile) so `python -m vitp.cluster.doctor` runs there")
        finally:
            _cleanup(root, shared)
        note = " (a one-node cluster: no other node to test)" if len(cluster.nodes) == 1 else ""
        note += "" if share[0] else "; not checked: that they see this machine's writes"
        return _storage_line("storage on cluster", root, results, note)

    out = timed("storage on cluster", on_cluster, TIMEOUTS["storage on cluster"],
                "check the cluster's free resources and `vitp jobs list`: the probe job may be queued")
    emit(out)
    return [here, out]


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
    from vitp.cluster import doctor  # the importable module, so Ray pickles its functions by name
    if len(sys.argv) > 4:
        print(TRACKING_TAG + json.dumps(doctor.probe_tracking(sys.argv[4])), flush=True)
    print(RESULT_TAG + json.dumps(doctor.cluster_probe(*sys.argv[1:4], include_self=True)), flush=True)
