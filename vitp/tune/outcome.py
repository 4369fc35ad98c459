"""The sweep's MLflow parent run: opened (or continued) through a tracking server outage, and what
a finished sweep found recorded on it: the best FINISHED child per dataset (the rule `vitp compare`
uses) and the failed trials. MLflow only through `vitp.tracking`."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

from ..tracking import RunLogger, find_runs
from ..tracking.compare import best_per_dataset
from ..tracking.store import quote, tag_filters, through_mlflow_outages
from ..tracking.values import source_tags
from .progress import USER_ERROR, trial_error


def open_parent(spec, resume: bool, log: Callable[[str], None]) -> RunLogger:
    """Start sweep `spec`'s parent run, or with `resume` continue its newest one whatever its status
    (its trials name it as parent); log its params and sweep.json. While the tracking server does
    not answer it tries again (`through_mlflow_outages`), each try resuming the one before by name."""
    return through_mlflow_outages(lambda: _open_parent(spec, resume), f"[sweep {spec.name}] its parent MLflow run",
                                  log)


def _open_parent(spec, resume: bool) -> RunLogger:
    parent = RunLogger.start(spec.tracking_uri, spec.experiment, f"sweep-{spec.name}",
                             run_id=_parent_run_id(spec) if resume else None,
                             background=True,  # its heartbeat: a live sweep is never taken for stale
                             tags={"sweep": spec.name, "kind": "sweep", "recipe": spec.base_recipe,
                                   **source_tags(f"vitp sweep {spec.name}")})
    try:
        if not parent.resumed:  # a resumed parent keeps the params of the run that started it
            parent.log_params({"sweep.space": json.dumps(spec.tune.space), "sweep.search": spec.tune.search,
                               "sweep.scheduler": spec.tune.scheduler, "sweep.metric": spec.tune.metric,
                               "sweep.seed": spec.tune.seed, "sweep.startup_trials": spec.tune.startup_trials,
                               "sweep.num_samples": spec.tune.num_samples, "sweep.base_recipe": spec.base_recipe,
                               "sweep.overrides": json.dumps(spec.overrides)})
        parent.log_dict(spec.to_dict(), "sweep.json")
    except BaseException:
        parent.close(timeout_s=0)  # its spool stays for the next try's start
        raise
    return parent


def _parent_run_id(spec) -> Optional[str]:
    """The newest parent run of sweep `spec.name` in its experiment, or None."""
    filters = [f"attributes.run_name = {quote('sweep-' + spec.name)}", *tag_filters(spec.name, None)]
    runs = find_runs(spec.tracking_uri, spec.experiment, " and ".join(filters))
    runs = [r for r in runs if not r["parent_run_id"]]
    return runs[0]["run_id"] if runs else None


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


def summarise(spec, parent, results, seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Best trial per dataset (from the MLflow children) and the failures of sweep `spec` (a
    SweepSpec), into its parent run; through a tracking server outage."""
    failed = [{"trial": os.path.basename(str(r.path)), "config": {k: v for k, v in (r.config or {}).items()
                                                                 if not k.startswith("__")},
               "error": trial_error(r.error, r.metrics)}
              for r in results if r.error or (r.metrics or {}).get(USER_ERROR)]
    what = f"[sweep {spec.name}] its summary"
    best = through_mlflow_outages(lambda: best_trials(spec.tracking_uri, spec.experiment, parent.run_id,
                                                      spec.tune.metric, spec.tune.mode), what, log)
    name = spec.tune.metric.replace("/", "_")
    # a resumed sweep's parent may hold an earlier summary: log after it, so the newest is latest
    step = parent.last_step + 1
    for dataset, b in best.items():  # metrics are spooled (a background logger): no wait here
        parent.log_metrics({f"best/{dataset}/{name}": b["top1"]}, step=step)
    parent.log_metrics({"sweep/trials": len(results), "sweep/failed": len(failed),
                        "sweep/seconds": seconds}, step=step)
    tags = {**{f"best_trial/{dataset}": b["run_id"] for dataset, b in best.items()}, "failed_trials": str(len(failed))}
    through_mlflow_outages(lambda: (parent.set_tags(tags),
                                    parent.log_dict({"best": best, "failed": failed}, "sweep_summary.json")),
                           what, log)
    return {"parent_run_id": parent.run_id, "trials": len(results), "failed": failed,
            "best": best, "seconds": seconds}
