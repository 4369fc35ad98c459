"""MLflow tracking: the store (store.py), runs (resume, dedup, status), an outage spool (spool.py),
stale-run marking (stale.py), redaction, compare queries, a server.

A sink: imports vitp.config, vitp.errors, vitp.storage, vitp.net and mlflow only; never torch or ray.
"""
from __future__ import annotations

import importlib
from typing import Any

# The names below load their module on first use: a submodule that needs no MLflow (redact,
# spoolfile) is imported without it, 0.8 s of CPU that every Ray Train worker but rank 0, and Train's
# controller, would otherwise pay at each start.
_WHERE = {
    "find_runs": "compare", "metric_history": "compare",
    "REDACTED": "redact", "redact": "redact",
    "ParamConflictError": "params", "RunLogger": "runs", "params_for_mlflow": "values",
    "ServerHandle": "server", "start_server": "server",
    "StaleRun": "stale", "mark_stale_runs": "stale",
    "PARENT_TAG": "store", "TrackingError": "store", "get_client": "store",
    "get_or_create_experiment": "store",
    "through_mlflow_outages": "store",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
