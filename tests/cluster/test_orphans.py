"""The placement group of a Train run whose controller dies with its Tune trial (ASHA stops the
trial, PBT or HyperBand pauses it) while the sweep goes on: on a Ray without a dashboard (the local
Ray vitp starts, this session's) Ray keeps it and its CPUs until the job ends; the driver's
watcher (vitp/cluster/orphans.py, started by connect_ray) releases it. Another job's such group is
left alone."""
import subprocess
import sys
import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from vitp.cluster import orphans

from .conftest import ROOT

OTHER_JOB = """
import sys, ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=0)
class Maker:
    def make(self):
        pg = placement_group([{"CPU": 0.01}])
        ray.get(pg.ready())
        return pg.id.hex()

maker = Maker.remote()
pg_id = ray.get(maker.make.remote())
ray.kill(maker)  # its group stays: this job goes on (reading stdin) until the test is done
print("PG " + pg_id, flush=True)
sys.stdin.read()
"""


def _live() -> set[str]:
    return {pg_id for pg_id, g in placement_group_table().items() if g["state"] != "REMOVED"}


def _wait(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)


@pytest.mark.e2e
def test_a_train_run_that_ended_with_its_trial_gives_its_cpus_back(ray_session, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", OTHER_JOB, ray.get_runtime_context().gcs_address], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = other.stdout.readline()
        assert line.startswith("PG "), f"the other job's driver said {line!r} and exited {other.poll()}"
        theirs = line.split()[1]

        @ray.remote(num_cpus=0)
        class Trial:  # as a Tune trial's actor: it runs a Train run's driver (fit)
            def fit(self, storage_path: str) -> None:
                from ray.train import RunConfig, ScalingConfig
                from ray.train.torch import TorchTrainer

                TorchTrainer(lambda: time.sleep(3600), scaling_config=ScalingConfig(num_workers=1),
                             run_config=RunConfig(name="ended-with-its-trial", storage_path=storage_path)).fit()

        before = _live()
        trial = Trial.remote()
        trial.fit.remote(str(tmp_path))
        _wait(lambda: _live() - before, "worker group placement group")
        (group,) = _live() - before
        cpus = ray.available_resources().get("CPU", 0.0)
        ray.kill(trial)  # as Tune ends a stopped trial's process: the controller ends with it
        time.sleep(5)  # Train's own cleaner would have removed it by now if it could
        assert group in _live(), "Ray released it alone: orphans.watch_job is no longer needed"
        assert ray.available_resources().get("CPU", 0.0) <= cpus

        orphans.watch_job()
        _wait(lambda: group not in _live(), "release of the ended run's placement group")
        _wait(lambda: ray.available_resources().get("CPU", 0.0) >= cpus + 1, "CPU given back")
        assert theirs in _live()  # the other job's group, its creator dead too, stays
    finally:
        other.stdin.close()
        other.wait(timeout=60)


CLEANER = "vitp-orphan-placement-groups"


@pytest.fixture
def quick_backoff(monkeypatch):
    """The cleaner's round every 10 ms, its backoff doubling from 20 ms to at most 30 ms, and its
    give-up after 4 failures in a row: the same loop as a 4-day run's, in well under a second."""
    monkeypatch.setattr(orphans, "INTERVAL_S", 0.01)
    monkeypatch.setattr(orphans, "BACKOFF_MAX_S", 0.03)
    monkeypatch.setattr(orphans, "GIVE_UP_AFTER", 4)
    orphans._threads.pop(CLEANER, None)
    yield
    orphans._threads.pop(CLEANER, None)


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vitp.cluster.orphans" and r.levelname == "WARNING"]


def test_the_cleaner_retries_a_failing_state_api_and_a_success_resets_its_count(ray_session, quick_backoff,
                                                                                 monkeypatch, caplog):
    """The state API failing (a dashboard restarting under a 4-day run) stops the cleaner no more:
    each failure is a warning naming the error (redacted) and the wait before the next try, which
    doubles up to its cap; a success starts the count again, so only GIVE_UP_AFTER failures in a
    row end it, with one line saying it gave up, why, and what is lost."""
    script = iter(["fail", "fail", "fail", "ok", "fail", "fail", "ok"])  # then it fails for good
    calls = []

    def flaky_orphans():  # what remove_orphans asks the state API through
        calls.append(next(script, "fail"))
        if calls[-1] == "fail":
            raise ConnectionError(f"dashboard http://admin:hunter2@head:8265 refused (call {len(calls)})")
        return []

    monkeypatch.setattr(orphans, "orphans", flaky_orphans)
    with caplog.at_level("WARNING", logger="vitp.cluster.orphans"):
        orphans.watch()
        orphans._threads[CLEANER].join(timeout=60)
    assert not orphans._threads[CLEANER].is_alive(), f"the cleaner still runs after {len(calls)} rounds"
    # 3 failures, a success, 2, a success, then the 4 in a row that end it: the count was reset
    assert calls == ["fail"] * 3 + ["ok"] + ["fail"] * 2 + ["ok"] + ["fail"] * 4, calls
    said = _said(caplog)
    retries, (gave_up,) = said[:-1], said[-1:]
    assert len(retries) == 8 and all(line.startswith(f"{CLEANER}: ConnectionError: dashboard") for line in retries)
    waits = [float(line.rsplit("trying again in ", 1)[1].removesuffix(" s")) for line in retries]
    assert waits == [0.02, 0.03, 0.03, 0.02, 0.03, 0.02, 0.03, 0.03], waits  # doubling, capped, reset
    assert gave_up.startswith(f"{CLEANER}: gave up after 4 failures in a row"), gave_up
    assert "(call 11)" in gave_up and gave_up.endswith(orphans.CLEANER_STOPPED), gave_up
    assert not any("hunter2" in line for line in said), said


def test_the_cleaner_says_when_it_gives_up_asking_the_cluster(ray_session, quick_backoff, caplog):
    """Ray's state API lives in the dashboard, which this session's local Ray lacks (as a driver on a
    worker node cannot reach the head's): the cleaner of ended jobs' groups tries GIVE_UP_AFTER times,
    then stops with one warning naming the consequence and the fix, instead of going quiet."""
    with caplog.at_level("WARNING", logger="vitp.cluster.orphans"):
        orphans.watch()
        orphans._threads[CLEANER].join(timeout=120)
    assert not orphans._threads[CLEANER].is_alive()
    said = _said(caplog)
    assert len(said) == 4 and all("trying again in" in line for line in said[:3]), said
    assert sum("gave up" in line for line in said) == 1 and said[-1].endswith(orphans.CLEANER_STOPPED), said
    assert "vitp_driver" in said[-1] and "ray list placement-groups" in said[-1]
