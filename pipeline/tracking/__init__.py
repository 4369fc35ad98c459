"""MLflow tracking: runs (resume, dedup, status), redaction, run queries for compare, a local server.

A sink: imports pipeline.config and mlflow only, never torch or ray.
"""
from pipeline.tracking.compare import find_runs, metric_history
from pipeline.tracking.redact import REDACTED, redact
from pipeline.tracking.runs import (
    PARENT_TAG,
    ParamConflictError,
    RunLogger,
    TrackingError,
    get_client,
    get_or_create_experiment,
    params_for_mlflow,
    resolve_tracking_uri,
)
from pipeline.tracking.server import ServerHandle, start_server

__all__ = [
    "PARENT_TAG", "REDACTED", "ParamConflictError", "RunLogger", "ServerHandle", "TrackingError",
    "find_runs", "get_client", "get_or_create_experiment", "metric_history", "params_for_mlflow",
    "redact", "resolve_tracking_uri", "start_server",
]
