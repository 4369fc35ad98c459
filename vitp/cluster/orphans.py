"""Placement groups that outlive the job that made them. Ray removes a job's placement groups (all
but detached ones) when the job ends, yet a Train worker group's under a Tune trial whose sweep
driver was SIGKILLed can stay, created or still pending, and hold its CPUs for good: the chaos soak's
pre-training then waited forever for CPUs for its data tasks. A driver on a cluster removes such
groups when it connects and every INTERVAL_S after that (`watch`)."""
from __future__ import annotations

import logging
import re
import threading
import time

import ray

log = logging.getLogger(__name__)

INTERVAL_S = 30.0
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job's status once its driver is gone
VITP = re.compile(r"(^|[\s/])vitp(\.cli)?(\s|$)")  # an entrypoint that runs our CLI
_thread: threading.Thread | None = None


def orphans() -> list[tuple[str, str]]:
    """(placement group id, job id) of each placement group not removed and not detached whose job
    ran the vitp CLI and has ended. Other jobs' groups are left alone (a detached actor may keep
    its job's groups in use), and a job the cluster does not list counts as running."""
    from ray.util.state import list_jobs, list_placement_groups

    ended = {j.job_id for j in list_jobs(limit=10_000, raise_on_missing_output=False)
             if j.job_id and str(getattr(j.status, "value", j.status)) in ENDED and VITP.search(j.entrypoint or "")}
    if not ended:
        return []
    groups = list_placement_groups(detail=True, limit=10_000, filters=[("state", "!=", "REMOVED")],
                                   raise_on_missing_output=False)
    return [(g.placement_group_id, g.creator_job_id) for g in groups
            if not g.is_detached and g.creator_job_id in ended]


def remove_orphans() -> list[str]:
    """Remove every orphan (above), naming each in a warning; the ids removed."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    gone = []
    for pg_id, job_id in orphans():
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
        except Exception as e:  # noqa: BLE001 - removed meanwhile (by Ray or another driver)
            log.debug("placement group %s not removed: %s", pg_id, e)
            continue
        log.warning("removed placement group %s of job %s, which has ended: it held its resources", pg_id, job_id)
        gone.append(pg_id)
    return gone


def _loop() -> None:
    while ray.is_initialized():
        try:
            remove_orphans()
        except Exception as e:  # noqa: BLE001 - housekeeping: never a reason to stop the driver
            # no dashboard (Ray's state API), or the driver disconnecting: `vitp --verbose` says which
            log.debug("placement groups of ended jobs are not checked by this driver: %s", e)
            return
        time.sleep(INTERVAL_S)


def watch() -> None:
    """remove_orphans now and every INTERVAL_S, in a daemon thread, while this process is connected
    to a cluster (one thread per process)."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_loop, name="vitp-orphan-placement-groups", daemon=True)
        _thread.start()
