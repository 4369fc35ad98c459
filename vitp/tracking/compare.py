"""Reading runs back out of MLflow for `vitp compare`: runs as plain dicts, metric histories, the table.

Read-only; imports vitp.tracking and mlflow only; must not import torch or ray, nor plot (plots.py).
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Iterable

from mlflow.entities import ViewType
from mlflow.exceptions import MlflowException

from vitp.tracking.store import PARENT_TAG, TrackingError, get_client, quote, tag_filters

_PAGE = 1000


def _experiment_ids(client, experiments: str | Iterable[str] | None) -> list[str]:
    if experiments is None:  # every active experiment in the store
        ids, token = [], None
        while True:
            page = client.search_experiments(
                view_type=ViewType.ACTIVE_ONLY, max_results=_PAGE, page_token=token
            )
            ids.extend(e.experiment_id for e in page)
            token = page.token
            if not token:
                return ids
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
    experiment: str | Iterable[str] | None,
    filter_string: str = "",
    *,
    parent_run_id: str | None = None,
    order_by: list[str] | None = None,
    max_results: int | None = None,
    history: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Runs of `experiment` (a name, names, or None for all) matching an MLflow `filter_string`, newest first.

    Each run is a dict: run_id, run_name, experiment_id, status, start_time, end_time (ms),
    parent_run_id, params, metrics (latest values), tags, and, for each key in `history`,
    history[key] = [(step, value), ...] sorted by step.
    """
    client = get_client(tracking_uri)
    ids = _experiment_ids(client, experiment)
    if not ids:
        return []
    filters = [filter_string] if filter_string else []
    if parent_run_id:
        filters.append(f"tags.`{PARENT_TAG}` = {quote(parent_run_id)}")
    runs, token = [], None
    while True:
        try:
            page = client.search_runs(ids, filter_string=" and ".join(filters),
                                      order_by=order_by or ["attributes.start_time DESC"],
                                      max_results=_PAGE, page_token=token)
        except MlflowException as e:
            if e.error_code != "INVALID_PARAMETER_VALUE" or not filter_string:
                raise
            reason = " ".join(str(e.message).split())
            raise TrackingError(f"--filter {filter_string!r}: {reason}; MLflow's search syntax, e.g. "
                                "\"params.`optim.lr` = '0.01' and metrics.`val/top1` > 0.5\"") from None
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


# --------------------------------------------------------------------------------------
# The comparison table
# --------------------------------------------------------------------------------------

FEWSHOT_SHOTS = (1, 5, 10, 25)
COLUMNS = (
    "recipe", "variant", "dataset", "source", "lr", "train_fraction", "seed", "best_top1", "final_top1",
    *(f"fewshot_{k}" for k in FEWSHOT_SHOTS),
    "images_per_sec", "wall_time_s", "status", "run_name", "run_id", "parent", "sweep", "experiment",
)
# Text-table headers; columns not listed here are left out of the text table (kept in CSV/JSON).
_HEADERS = {
    "dataset": "dataset", "recipe": "recipe", "variant": "variant", "source": "source", "lr": "lr",
    "train_fraction": "train", "seed": "seed",
    "best_top1": "best top-1", "final_top1": "final top-1",
    **{f"fewshot_{k}": f"{k}-shot" for k in FEWSHOT_SHOTS},
    "images_per_sec": "images/s", "wall_time_s": "wall s", "status": "status",
    "run_name": "run name", "run_id": "run id", "parent": "parent",
}
_OPTIONAL = ("train_fraction", "seed")  # text columns shown only when some row has a value
_CLIP = 40  # long cells (checkpoint paths as source, run names) are cut from the left in text


def _float(text: Any) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _int(text: Any) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _source(tags: dict[str, str], params: dict[str, str]) -> str | None:
    if tags.get("source"):
        return tags["source"]
    if "train.init_from" in params:  # the resolved config: "" means from scratch
        return params["train.init_from"] or "scratch"
    return None


def _is_parent(run: dict[str, Any], parent_ids: set[str]) -> bool:
    # A sweep parent is tagged kind=sweep (before that tag: it carries the sweep tag and has no
    # parent itself, and no other kind); any run another run names as its parent is one too.
    # Runs of another kind in a sweep's name (the demo's raw-pixel references) are rows.
    kind, tags = run["tags"].get("kind"), run["tags"]
    return run["run_id"] in parent_ids or kind == "sweep" or (
        kind is None and bool(tags.get("sweep")) and not run["parent_run_id"])


def _row(tracking_uri: str, run: dict[str, Any], experiment_names: dict[str, str]) -> dict[str, Any]:
    tags, params, metrics = run["tags"], run["params"], run["metrics"]
    top1 = metric_history(tracking_uri, run["run_id"], "val/top1") if "val/top1" in metrics else []
    speed = (
        metric_history(tracking_uri, run["run_id"], "perf/images_per_sec")
        if "perf/images_per_sec" in metrics else []
    )
    start, end = run["start_time"], run["end_time"]
    row: dict[str, Any] = {
        "recipe": tags.get("recipe") or params.get("recipe"),
        "variant": tags.get("variant") or params.get("model.variant"),
        "dataset": tags.get("dataset") or params.get("data.source"),
        "source": _source(tags, params),
        "lr": _float(params.get("optim.lr")),
        "train_fraction": _float(tags.get("train_fraction") or params.get("data.train_fraction")),
        "seed": _int(params.get("train.seed")),
        "best_top1": max(v for _, v in top1) if top1 else None,
        "final_top1": top1[-1][1] if top1 else None,
    }
    for k in FEWSHOT_SHOTS:
        row[f"fewshot_{k}"] = metrics.get(f"fewshot/{k}shot_top1")
    row.update({
        "images_per_sec": sum(v for _, v in speed) / len(speed) if speed else None,
        # A RUNNING run has no end yet: its wall time is unknown, not "so far".
        "wall_time_s": (end - start) / 1000.0 if start and end else None,
        "start_time": start, "end_time": end,  # ms; not columns (search_curve orders trials by them)
        "status": run["status"],
        "run_name": run["run_name"],
        "params": params,  # every logged param (seeds.py groups by the swept ones); not a column
        "run_id": run["run_id"],
        "experiment_id": run["experiment_id"],
        "parent": run["parent_run_id"],
        "sweep": tags.get("sweep"),
        "experiment": experiment_names.get(run["experiment_id"], run["experiment_id"]),
    })
    return row


def compare_rows(
    tracking_uri: str,
    experiment: str | Iterable[str] | None = None,
    sweep: str | None = None,
    tags: dict[str, Any] | None = None,
    filter_string: str = "",
    include_parents: bool = False,
) -> list[dict[str, Any]]:
    """One row per run for `vitp compare`, with the keys in COLUMNS (missing values are None).

    `experiment`: a name, names, or None for every experiment; `sweep`: the sweep tag (parent and
    trials carry it); `tags`: {key: value} that must all match; `filter_string`: any MLflow filter
    (e.g. "params.`optim.lr` = '0.003'"). Sweep parent runs are left out unless `include_parents`.
    best_top1 is the max of the val/top1 history, final_top1 its last step, images_per_sec the mean
    of perf/images_per_sec, fewshot_<k> the latest fewshot/<k>shot_top1, wall_time_s end - start.
    """
    filters = ([filter_string] if filter_string else []) + tag_filters(sweep, tags)
    runs = find_runs(tracking_uri, experiment, " and ".join(filters))
    client = get_client(tracking_uri)
    names = {r["experiment_id"]: None for r in runs}
    for eid in names:
        names[eid] = client.get_experiment(eid).name
    parent_ids = {r["parent_run_id"] for r in runs if r["parent_run_id"]}
    if not include_parents:
        runs = [r for r in runs if not _is_parent(r, parent_ids)]
    return [_row(tracking_uri, r, names) for r in runs]


def _sort_key(row: dict[str, Any]):
    best = row.get("best_top1")
    return (row.get("dataset") or "~", best is None, -(best or 0.0), row.get("run_name") or "")


def best_per_dataset(rows: Iterable[dict[str, Any]], key: str = "best_top1",
                     mode: str = "max") -> dict[str, dict[str, Any]]:
    """{dataset: the row with the best `key`}: highest for mode "max", lowest for "min".

    Only finished runs compete: rows whose status is not FINISHED (failed, killed, still running) and
    rows without a dataset or a value for `key` are skipped. Ties go to the run whose name (then id)
    sorts first, so the answer does not depend on row order. A sweep's parent run records its best
    trials with this same rule, so `vitp compare` and the parent always agree.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    sign = -1.0 if mode == "max" else 1.0
    scored = [r for r in rows if r.get("dataset") and r.get(key) is not None
              and r.get("status", "FINISHED") == "FINISHED"]
    best: dict[str, dict[str, Any]] = {}
    for row in sorted(scored, key=lambda r: (sign * r[key], r.get("run_name") or "", r.get("run_id") or "")):
        best.setdefault(row["dataset"], row)
    return best


def cell(key: str, value: Any) -> str:
    if value is None or value == "":
        return "-"
    if key in ("best_top1", "final_top1") or key.startswith("fewshot_"):
        return f"{value:.4f}"
    if key == "lr":
        return f"{value:g}"
    if key == "train_fraction":
        return f"{value:.0%}"
    if key in ("images_per_sec", "wall_time_s"):
        return f"{value:.1f}"
    if key == "parent":
        return str(value)[:8]
    text = str(value)
    return text if len(text) <= _CLIP else "..." + text[-(_CLIP - 3):]


def format_table(rows: Iterable[dict[str, Any]], fmt: str = "text") -> str:
    """The rows as "text" (aligned columns), "csv" or "json", sorted by dataset then best top-1 desc.

    The best run per dataset is marked: `*` in the text table, best=true in CSV/JSON. Text leaves out
    few-shot columns no row has, shortens parent ids to 8 characters and long cells from the left.
    """
    rows = sorted(rows, key=_sort_key)
    winners = {id(r) for r in best_per_dataset(rows).values()}
    if fmt == "json":
        return json.dumps([{"best": id(r) in winners, **{c: r.get(c) for c in COLUMNS}} for r in rows],
                          indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=["best", *COLUMNS], lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({"best": "*" if id(r) in winners else "",
                             **{c: "" if r.get(c) is None else r.get(c) for c in COLUMNS}})
        return buf.getvalue()
    if fmt != "text":
        raise TrackingError(f"table format {fmt!r} is not known: use text, csv or json")
    if not rows:
        return "(no runs match: check --experiment, --sweep and --tag)"
    keys = [k for k in _HEADERS if k not in _OPTIONAL and not k.startswith("fewshot_")
            or any(r.get(k) is not None for r in rows)]
    table = [["", *(_HEADERS[k] for k in keys)]]
    table += [["*" if id(r) in winners else "", *(cell(k, r.get(k)) for k in keys)] for r in rows]
    numeric = {i + 1 for i, k in enumerate(keys)
               if k in ("lr", "train_fraction", "seed", "best_top1", "final_top1", "images_per_sec",
                        "wall_time_s")
               or k.startswith("fewshot_")}
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = []
    for line in table:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Seeds aggregated: one row per configuration
# --------------------------------------------------------------------------------------

# What makes two runs the same configuration (they differ in seed, name and id only).
def sweep_parents(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Run ids of the sweep parents the rows' trials belong to (where `--plot` logs the PNG)."""
    return sorted({r["parent"] for r in rows if r.get("parent")})
