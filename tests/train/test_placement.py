"""A gang the cluster cannot place (vitp/train/placement.py): `vitp pretrain` on the session's local
Ray (4 CPUs) asks for two 8-CPU workers, and instead of waiting for ever (Ray Train retries the start
every minute) ends after parallel.placement_timeout_s with one line naming what the gang asks for,
what the cluster's nodes offer, and the key to raise; exit 3, the MLflow run FAILED."""
import pytest

from vitp import cli
from vitp.errors import ClusterError
from vitp.train.placement import TIMEOUT_KEY, GangNotPlaced, PlacementClock


@pytest.mark.ray
@pytest.mark.slow
def test_a_gang_the_cluster_cannot_place_ends_the_run_in_one_line(ray_session, shards, tmp_path, capsys):
    from vitp.config import Run
    from vitp.recipes import resolve
    from vitp.tracking.store import get_client

    sets = [f"work_dir={tmp_path}", f"data.shards={shards}", "parallel.num_workers=2", "parallel.cpus_per_worker=8",
            f"{TIMEOUT_KEY}=3", "train.steps=10"]
    code = cli.main(["pretrain", "debug", *(a for s in sets for a in ("--set", s))])
    lines = [line for line in capsys.readouterr().err.splitlines() if "Train gang" in line]
    assert code == ClusterError.exit_code == 3, lines
    (line,) = lines
    assert "the Train gang needs 2 bundles of {CPU: 8} and was not placed in 3 s" in line, line
    assert "have room for 0 such bundles (the largest offers {CPU: 4}; {CPU: 4} in all" in line, line
    assert f"raise {TIMEOUT_KEY} (now 3; 0 waits forever)" in line, line
    client = get_client(Run.of(resolve("debug", sets)).tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("vit-pipeline-debug").experiment_id])
    assert run.info.status == "FAILED"


def test_the_clock_runs_while_no_group_runs_and_zero_waits_forever(monkeypatch):
    """The budget is the wait since a worker group was last wanted (a restart days into a run starts
    from zero), and 0 never ends it."""
    now = [100.0]
    monkeypatch.setattr("vitp.train.placement.time.monotonic", lambda: now[0])
    monkeypatch.setattr("vitp.train.placement.offer", lambda per_worker: "(the cluster)")
    clock = PlacementClock(60.0)
    clock.check(4, {"CPU": 64, "GPU": 8})  # the first wait starts
    now[0] += 59
    clock.check(4, {"CPU": 64, "GPU": 8})
    clock.placed()  # running, for days
    now[0] += 4 * 86_400
    clock.check(4, {"CPU": 64, "GPU": 8})  # a restart: a new wait
    now[0] += 60
    with pytest.raises(GangNotPlaced, match=r"^the Train gang needs 4 bundles of \{CPU: 64, GPU: 8\} and was not "
                                            r"placed in 60 s: \(the cluster\); .*raise parallel.placement_timeout_s"):
        clock.check(4, {"CPU": 64, "GPU": 8})
    elastic = PlacementClock(60.0)  # parallel.min_workers: the fewest workers it would start with
    elastic.check(2, {"CPU": 8}, min_workers=1)
    now[0] += 60
    with pytest.raises(GangNotPlaced, match=r"needs at least 1 \(of up to 2\) bundles of \{CPU: 8\}.*"
                                            r"lower parallel.min_workers /"):
        elastic.check(2, {"CPU": 8}, min_workers=1)
    forever = PlacementClock(0.0)
    forever.check(1, {"CPU": 1})
    now[0] += 365 * 86_400
    forever.check(1, {"CPU": 1})
