"""Reading runs back out of MLflow for `vitp compare`: runs as plain dicts, metric histories.

Read-only; imports pipeline.tracking and mlflow only (no torch, no ray, no plotting).
"""
from __future__ import annotations

from typing import Any, Iterable

from pipeline.tracking.runs import PARENT_TAG, TrackingError, get_client

_PAGE = 1000


def _experiment_ids(client, experiments: str | Iterable[str]) -> list[str]:
    names = [experiments] if isinstance(experiments, str) else list(experiments)
    ids, missing = [], []
    for name in names:
        exp = client.get_experiment_by_name(name)
        (ids.append(exp.experiment_id) if exp is not None else missing.append(name))
    if missing:
        known = sorted(e.name for e in client.search_experiments(max_results=200))
        raise TrackingError(
            f"MLflow experiment(s) {', '.join(map(repr, missing))} not found in {client.tracking_uri}: "
            f"use one of {', '.join(map(repr, known)) or '(none yet)'} via --experiment"
        )
    return ids


def find_runs(
    tracking_uri: str,
    experiment: str | Iterable[str],
    filter_string: str = "",
    *,
    parent_run_id: str | None = None,
    order_by: list[str] | None = None,
    max_results: int | None = None,
    history: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Runs of `experiment` (a name or names) matching an MLflow `filter_string`, newest first.

    Each run is a dict: run_id, run_name, experiment_id, status, start_time, end_time (ms),
    parent_run_id, params, metrics (latest values), tags, and, for each key in `history`,
    history[key] = [(step, value), ...] sorted by step.
    """
    client = get_client(tracking_uri)
    ids = _experiment_ids(client, experiment)
    filters = [filter_string] if filter_string else []
    if parent_run_id:
        filters.append(f"tags.`{PARENT_TAG}` = '{parent_run_id}'")
    runs, token = [], None
    while True:
        page = client.search_runs(
            ids,
            filter_string=" and ".join(filters),
            order_by=order_by or ["attributes.start_time DESC"],
            max_results=_PAGE,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token or (max_results is not None and len(runs) >= max_results):
            break
    if max_results is not None:
        runs = runs[:max_results]
    keys = list(history)
    out = []
    for r in runs:
        row = {
            "run_id": r.info.run_id,
            "run_name": r.info.run_name,
            "experiment_id": r.info.experiment_id,
            "status": r.info.status,
            "start_time": r.info.start_time,
            "end_time": r.info.end_time,
            "parent_run_id": r.data.tags.get(PARENT_TAG),
            "params": dict(r.data.params),
            "metrics": dict(r.data.metrics),
            "tags": {k: v for k, v in r.data.tags.items()},
        }
        if keys:
            row["history"] = {k: metric_history(tracking_uri, r.info.run_id, k) for k in keys}
        out.append(row)
    return out


def metric_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """[(step, value), ...] of one metric, sorted by step: a learning curve."""
    client = get_client(tracking_uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
