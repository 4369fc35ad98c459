"""`vitp doctor`'s storage checks: a probe written, listed, read back and deleted under work_dir from
this machine, then from every other node (as a Ray job on the cluster, or tasks where this process
joined it), each node first reading what this machine wrote; the same job asks whether MLflow answers
from the cluster. The fix of a failed probe is read from its error. Leaves no probe behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import urllib.error
import urllib.request
import uuid
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit

from vitp import storage
from vitp.cluster.checks import TIMEOUTS, Check, first_line, timed
from vitp.cluster.jobspec import DRIVER_RESOURCE
from vitp.errors import ClusterError

if TYPE_CHECKING:
    from vitp.cluster.doctor import Cluster

PROBE_DIR = ".vitp-doctor"
RESULT_TAG = "VITP_DOCTOR_PROBE "  # the probe job's result line in its logs
TRACKING_TAG = "VITP_DOCTOR_TRACKING "  # ... and its MLflow reachability line


def live_nodes() -> list[dict]:
    import ray
    return [{"id": n["NodeID"], "ip": n.get("NodeManagerAddress", "?"), "cpus": n["Resources"].get("CPU", 0),
             "gpus": n["Resources"].get("GPU", 0), "drivers": n["Resources"].get(DRIVER_RESOURCE, 0)}
            for n in ray.nodes() if n.get("Alive")]


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
    me, nodes = ray.get_runtime_context().get_node_id(), live_nodes()
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
