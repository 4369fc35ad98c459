"""What a finished sweep found: the best FINISHED child per dataset (the rule `vitp compare` uses)
and the failed trials, recorded on the sweep's MLflow parent run. MLflow only through `vitp.tracking`."""
from __future__ import annotations

import os
from typing import Any

from ..tracking import find_runs
from ..tracking.compare import best_per_dataset
from .progress import USER_ERROR, trial_error


def best_trials(tracking_uri: str, experiment: str, parent_run_id: str, metric: str = "val/top1",
                mode: str = "max") -> dict[str, dict[str, Any]]:
    """{dataset: {run_id, run_name, top1, source}}: the best FINISHED child of a sweep parent per dataset.

    A trial's score is the best value of `metric` over its history (max or min by `mode`), the same
    rule as the "best top-1" column of `vitp compare`; ties go to the run name that sorts first.
    """
    rows = []
    for run in find_runs(tracking_uri, experiment, "attributes.status = 'FINISHED'",
                         parent_run_id=parent_run_id, history=[metric]):
        values = [v for _, v in run["history"][metric]]
        if values:
            rows.append({"dataset": run["tags"].get("dataset", "?"), "run_id": run["run_id"],
                         "run_name": run["run_name"], "source": run["tags"].get("source", ""),
                         "top1": max(values) if mode == "max" else min(values)})
    return {dataset: {k: row[k] for k in ("run_id", "run_name", "top1", "source")}
            for dataset, row in best_per_dataset(rows, key="top1", mode=mode).items()}


def summarise(spec, parent, results, seconds: float) -> dict[str, Any]:
    """Best trial per dataset (from the MLflow children) and the failures of sweep `spec` (a
    SweepSpec), into its parent run."""
    failed = [{"trial": os.path.basename(str(r.path)), "config": {k: v for k, v in (r.config or {}).items()
                                                                 if not k.startswith("__")},
               "error": trial_error(r.error, r.metrics)}
              for r in results if r.error or (r.metrics or {}).get(USER_ERROR)]
    best = best_trials(spec.tracking_uri, spec.experiment, parent.run_id, spec.metric, spec.mode)
    name = spec.metric.replace("/", "_")
    # a resumed sweep's parent may hold an earlier summary: log after it, so the newest is latest
    step = parent.last_step + 1
    for dataset, b in best.items():
        parent.log_metrics({f"best/{dataset}/{name}": b["top1"]}, step=step)
        parent.set_tags({f"best_trial/{dataset}": b["run_id"]})
    parent.log_metrics({"sweep/trials": len(results), "sweep/failed": len(failed),
                        "sweep/seconds": seconds}, step=step)
    parent.set_tags({"failed_trials": str(len(failed))})
    parent.log_dict({"best": best, "failed": failed}, "sweep_summary.json")
    return {"parent_run_id": parent.run_id, "trials": len(results), "failed": failed,
            "best": best, "seconds": seconds}
