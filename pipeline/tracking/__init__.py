"""MLflow tracking: the store (store.py), runs (resume, dedup, status), an outage spool (spool.py),
stale-run marking (stale.py), redaction, compare queries, a server.

A sink: imports pipeline.config, pipeline.errors, pipeline.storage, pipeline.net and mlflow only;
must never import torch or ray.
"""
from pipeline.tracking.compare import find_runs, metric_history
from pipeline.tracking.redact import REDACTED, redact
from pipeline.tracking.runs import ParamConflictError, RunLogger, params_for_mlflow
from pipeline.tracking.server import ServerHandle, start_server
from pipeline.tracking.stale import StaleRun, mark_stale_runs
from pipeline.tracking.store import (
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
