"""What MLflow is sent: params and tags as strings within its limits (flattened, redacted, truncated
with a note), a run's Source column. No torch or ray; no MLflow calls.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from vitp.config import flatten
from vitp.tracking.redact import redact, redact_value

log = logging.getLogger(__name__)

# mlflow's limits (mlflow.utils.validation); we truncate ourselves so the note says where the rest is.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
PARAMS_PER_BATCH = 100
TRUNCATION_NOTE = "...[truncated; full value in config.json]"


def to_str(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def truncate(key: str, text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    log.warning("%s: value of %d characters truncated to %d for MLflow", key, len(text), limit)
    return text[: limit - len(TRUNCATION_NOTE)] + TRUNCATION_NOTE


# Config keys that are not params: the run's own name is its MLflow name already, and as a param
# every run would differ in it (MLflow's comparison views, parallel coordinates among them, plot the
# params that differ between the runs compared)
NOT_PARAMS = ("tracking.run_name",)


def params_for_mlflow(cfg_dict: dict[str, Any]) -> dict[str, str]:
    """The exact param strings log_config writes: flattened, redacted, truncated to MLflow's limit."""
    flat = {k: v for k, v in flatten(cfg_dict).items() if k not in NOT_PARAMS}
    flat = redact(flat)
    return {k: truncate(k, to_str(v), MAX_PARAM_VALUE) for k, v in flat.items()}


def source_tags(command: str) -> dict[str, str]:
    """MLflow's Source column for a run: the vitp command that made it (not argv: a Tune trial's
    driver runs in a Ray worker)."""
    return {"mlflow.source.name": command, "mlflow.source.type": "JOB"}


def tags_for_mlflow(tags: dict[str, Any]) -> dict[str, str]:
    return {
        str(k): truncate(str(k), to_str(redact_value(str(k), v)), MAX_TAG_VALUE)
        for k, v in tags.items()
    }


def chunks(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i : i + n]
