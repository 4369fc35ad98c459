"""MLflow tracking: the store (store.py), runs (resume, dedup, status), an outage spool (spool.py),
stale-run marking (stale.py), redaction, compare queries, a server.

A sink: imports vitp.config, vitp.errors, vitp.storage, vitp.net and mlflow only;
must never import torch or ray.
"""
from vitp.tracking.compare import find_runs, metric_history
from vitp.tracking.redact import REDACTED, redact
from vitp.tracking.runs import ParamConflictError, RunLogger, params_for_mlflow
from vitp.tracking.server import ServerHandle, start_server
from vitp.tracking.stale import StaleRun, mark_stale_runs
from vitp.tracking.store import (
    PARENT_TAG,
    TrackingError,
    get_client,
    get_or_create_experiment,
    resolve_tracking_uri,
)

__all__ = [
    "PARENT_TAG", "REDACTED", "ParamConflictError", "RunLogger", "ServerHandle", "StaleRun",
    "TrackingError", "find_runs", "get_client", "get_or_create_experiment", "mark_stale_runs",
    "metric_history", "params_for_mlflow", "redact", "resolve_tracking_uri", "start_server",
]
