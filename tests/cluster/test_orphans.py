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


def test_the_cleaner_says_when_it_cannot_ask_the_cluster(ray_session, caplog):
    """Ray's state API lives in the dashboard, which this session's local Ray lacks (as a driver on a
    worker node cannot reach the head's): the cleaner of ended jobs' groups stops with a warning
    naming the consequence and the fix, instead of going quiet."""
    orphans._threads.pop("vitp-orphan-placement-groups", None)
    with caplog.at_level("WARNING", logger="vitp.cluster.orphans"):
        orphans.watch()
        orphans._threads["vitp-orphan-placement-groups"].join(timeout=120)
    assert not orphans._threads["vitp-orphan-placement-groups"].is_alive()
    said = [r.getMessage() for r in caplog.records if r.name == "vitp.cluster.orphans"]
    assert len(said) == 1 and said[0].startswith(orphans.CLEANER_STOPPED), said
    assert "vitp_driver" in said[0] and "ray list placement-groups" in said[0]
