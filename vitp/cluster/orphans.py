"""Placement groups that outlive what made them and hold their CPUs: those vitp jobs that have
ended left on a cluster (`watch`, every driver on a cluster), and those of this job's Train runs
whose controllers died with the trials Tune stopped or paused (`watch_job`, every driver). Only
removes groups no live process can use; never touches another live job's."""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

import ray

from vitp.tracking.redact import redact_message

log = logging.getLogger(__name__)

INTERVAL_S = 30.0
RELEASE_EVERY_S = 2.0
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job's status once its driver is gone
VITP = re.compile(r"(^|[\s/])vitp(\.cli)?(\s|$)")  # an entrypoint that runs our CLI
_threads: dict[str, threading.Thread] = {}


def orphans() -> list[tuple[str, str]]:
    """(placement group id, job id) of each placement group not removed and not detached whose job
    ran the vitp CLI and has ended. Ray removes a job's groups when the job ends, yet a Train worker
    group's under a Tune trial whose sweep driver was SIGKILLed can stay, created or still pending
    (the chaos soak's pre-training then waited forever for CPUs for its data tasks). Other jobs'
    groups are left alone (a detached actor may keep its job's groups in use), and a job the
    cluster does not list counts as running."""
    from ray.util.state import list_jobs, list_placement_groups

    # this cluster's: without an address the state API scans the machine and fails where another
    # Ray runs beside the one this driver joined
    address = ray.get_runtime_context().gcs_address
    ended = {j.job_id for j in list_jobs(address=address, limit=10_000, raise_on_missing_output=False)
             if j.job_id and str(getattr(j.status, "value", j.status)) in ENDED and VITP.search(j.entrypoint or "")}
    if not ended:
        return []
    groups = list_placement_groups(address=address, detail=True, limit=10_000, filters=[("state", "!=", "REMOVED")],
                                   raise_on_missing_output=False)
    return [(g.placement_group_id, g.creator_job_id) for g in groups
            if not g.is_detached and g.creator_job_id in ended]


def _remove(pg_id: str) -> bool:
    """Remove the placement group `pg_id` (hex); False where it is gone already (removed meanwhile,
    by Ray or another driver)."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
    except Exception as e:  # noqa: BLE001 - removed meanwhile
        log.debug("placement group %s not removed: %s", pg_id, e)
        return False
    return True


def remove_orphans() -> list[str]:
    """Remove every orphan (above), naming each in a warning; the ids removed."""
    gone = []
    for pg_id, job_id in orphans():
        if _remove(pg_id):
            log.warning("removed placement group %s of job %s, which has ended: it held its resources",
                        pg_id, job_id)
            gone.append(pg_id)
    return gone


def dead_creators(job_id: str) -> list[str]:
    """Ids of job `job_id`'s placement groups, not removed and not detached, whose creator is an
    actor that has died: a Train run's worker group whose controller ended with the trial Tune
    stopped (ASHA) or paused (PBT, HyperBand). Ray removes a group only once its creator's job has
    ended too, and Train's own cleaner asks the dashboard's state API, which the local Ray lacks:
    ended trials' groups gathered until the last trials' data tasks found no CPU. Read from the
    GCS's table, which names each group's creator (Ray's public API does not, and its state API
    needs a dashboard). A group the driver made (Tune's trials') has no creator actor."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = gcs_pb2.PlacementGroupTableData
    out = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        pg = table.FromString(raw)
        if (pg.creator_job_id.hex() == job_id and pg.creator_actor_dead and not pg.is_detached
                and not ray.ActorID(pg.creator_actor_id).is_nil() and pg.state != table.REMOVED):
            out.append(pg.placement_group_id.hex())
    return out


def release_dead_creators() -> list[str]:
    """Remove this job's placement groups whose creator actor has died (above); the ids removed."""
    gone = [pg_id for pg_id in dead_creators(ray.get_runtime_context().get_job_id()) if _remove(pg_id)]
    if gone:
        log.debug("released %d placement group(s) of ended Train runs: %s", len(gone), ", ".join(gone))
    return gone


# A failed round (the dashboard restarting, a slow GCS) is tried again after twice the interval,
# doubling each failure in a row up to BACKOFF_MAX_S; GIVE_UP_AFTER failures in a row end the
# thread (a 4-day run outlives many hiccups, but not a state API that is gone). A success resets.
BACKOFF_MAX_S = 600.0
GIVE_UP_AFTER = 8


def _error(e: BaseException) -> str:
    """`e` on one line, cut short and redacted (a dashboard URL in it may carry a password)."""
    return f"{type(e).__name__}: {redact_message(' '.join(str(e).split()))[:200]}"


def _every(name: str, interval_s: float, fn: Callable[[], object], stopped: str) -> None:
    """fn() now and every interval_s, in a daemon thread named `name` (one per process), while this
    process is connected to Ray. A failure while still connected is said in a warning and tried again
    after a doubling backoff (BACKOFF_MAX_S at most); after GIVE_UP_AFTER in a row the thread ends
    with a warning saying so and what is lost (`stopped`)."""
    def loop() -> None:
        failures, first_failed = 0, 0.0
        while ray.is_initialized():
            try:
                fn()
                failures, wait_s = 0, interval_s
            except Exception as e:  # noqa: BLE001 - housekeeping: never a reason to stop the driver
                if not ray.is_initialized():
                    log.debug("%s: %s", name, e)  # the driver disconnecting
                    return
                failures += 1
                first_failed = first_failed if failures > 1 else time.monotonic()
                if failures >= GIVE_UP_AFTER:
                    log.warning("%s: gave up after %d failures in a row over %.0f s (the last: %s): %s", name,
                                failures, time.monotonic() - first_failed, _error(e), stopped)
                    return
                wait_s = min(interval_s * 2 ** failures, max(BACKOFF_MAX_S, interval_s))
                log.warning("%s: %s (%d failure(s) in a row, gives up at %d); trying again in %g s",
                            name, _error(e), failures, GIVE_UP_AFTER, wait_s)
            time.sleep(wait_s)

    if name not in _threads or not _threads[name].is_alive():
        _threads[name] = threading.Thread(target=loop, name=name, daemon=True)
        _threads[name].start()


# Said once the cleaner gives up asking the cluster (Ray's state API lives in the dashboard): a
# driver on a worker node, or a dashboard that stays down.
CLEANER_STOPPED = ("placement groups that ended vitp jobs leave holding CPUs will not be removed by this "
                   "driver: it cannot reach the dashboard's state API (a driver on a worker node? the job "
                   "specs ask for the head's vitp_driver resource: docs/cluster.md, 'Where drivers run'; "
                   "meanwhile `ray list placement-groups` shows them)")
RELEASER_STOPPED = ("placement groups of this job's Train runs whose trials Tune stopped or paused will not be "
                    "released by this driver: they hold their CPUs until the job ends (`ray list placement-groups` "
                    "shows them)")


def watch() -> None:
    """remove_orphans now and every INTERVAL_S while this process is connected to a cluster."""
    _every("vitp-orphan-placement-groups", INTERVAL_S, remove_orphans, stopped=CLEANER_STOPPED)


def watch_job() -> None:
    """release_dead_creators now and every RELEASE_EVERY_S while this process is connected."""
    _every("vitp-ended-train-runs-placement-groups", RELEASE_EVERY_S, release_dead_creators,
           stopped=RELEASER_STOPPED)
