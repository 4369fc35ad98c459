"""Mark RUNNING MLflow runs whose process died (SIGKILL, OOM, lost node) KILLED, judged by heartbeat.

A background RunLogger refreshes the `vitp.heartbeat` tag (unix seconds) every ~30 s; a run without
one is judged by its start time. Never marks a run FINISHED. No torch, no ray.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from mlflow.entities import Run

from vitp.tracking.spool import HEARTBEAT_TAG
from vitp.tracking.store import TrackingError, get_client

log = logging.getLogger(__name__)

STALE_TAG = "vitp.stale"  # why mark_stale_runs ended the run


@dataclass(frozen=True)
class StaleRun:
    run_id: str
    run_name: str
    last_seen: float  # unix seconds: the last heartbeat, else the start time
    idle_s: float  # seconds without a heartbeat when it was marked


def last_seen(run: Run) -> float:
    """Unix seconds of the run's last heartbeat, else of its start."""
    try:
        return float(run.data.tags[HEARTBEAT_TAG])
    except (KeyError, ValueError):
        return run.info.start_time / 1000


def mark_stale_runs(tracking_uri: str, experiment: str, stale_after_s: float = 600.0, *,
                    dry_run: bool = False) -> list[StaleRun]:
    """End KILLED every RUNNING run of `experiment` without a heartbeat for stale_after_s seconds.

    Returns the runs it marked (with dry_run=True: would mark). Only runs whose owner logs with
    RunLogger.start(background=True) heartbeat (every run vitp starts does: training, sweep parents,
    few-shot and reference runs); a live run without one looks stale once it is older
    than stale_after_s, so keep it well above the heartbeat interval (default 600 s). A marked run
    that is resumed later (start() by name or id) simply becomes RUNNING again.
    """
    if not stale_after_s > 0:
        raise TrackingError(
            f"stale_after_s={stale_after_s!r}: pass the seconds without a heartbeat after which a "
            "RUNNING run counts as dead (several heartbeat intervals, e.g. 600)"
        )
    client = get_client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise TrackingError(
            f"experiment {experiment!r} not found in {client.tracking_uri}: pass the experiment "
            "the runs were logged to (--set tracking.experiment=<name>)"
        )
    running, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'",
                                  max_results=1000, page_token=token)
        running += list(page)
        token = page.token
        if not token:
            break
    marked = []
    for run in running:
        now = time.time()
        if now - last_seen(run) < stale_after_s:
            continue
        run = client.get_run(run.info.run_id)  # re-read: a resume or heartbeat may have just come in
        seen = last_seen(run)
        if run.info.status != "RUNNING" or now - seen < stale_after_s:
            continue
        stale = StaleRun(run.info.run_id, run.info.run_name or "", seen, now - seen)
        if not dry_run:
            client.set_tag(stale.run_id, STALE_TAG, f"no heartbeat for {stale.idle_s:.0f} s: marked KILLED")
            client.set_terminated(stale.run_id, "KILLED", end_time=int(seen * 1000))
            log.warning("MLflow run %s (%s): no heartbeat for %.0f s, marked KILLED",
                        stale.run_id, stale.run_name, stale.idle_s)
        marked.append(stale)
    return marked
