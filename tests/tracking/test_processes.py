"""Runs across processes: a SIGKILLed run stays RUNNING and is resumed; a fresh SQLite store opened
by several processes at once; the default store location; tracking/ imports neither torch nor ray.
"""
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from vitp.config import ConfigError, ExperimentConfig, Run, absolute_paths
from vitp.tracking import RunLogger, find_runs
from vitp.tracking.store import get_client

REPO = Path(__file__).resolve().parents[2]

# Starts a run, logs steps 0..4, says READY, then waits to be killed.
CHILD = textwrap.dedent("""
    import sys, time
    from vitp.tracking import RunLogger
    uri, experiment, name = sys.argv[1:4]
    run = RunLogger.start(uri, experiment, name)
    run.log_config({"optim": {"lr": 0.001}})
    for step in range(5):
        run.log_metrics({"train/loss": 5.0 - step}, step=step)
    print("READY", run.run_id, flush=True)
    time.sleep(600)
""")


def python(*args, **kw):
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.long_cases("server",
                        reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                               "doctor, rehearsal (CI: the SQLite twin)")
def test_sigkilled_run_stays_running_and_is_resumed_by_name(tracking_uri, experiment):
    proc = python("-c", CHILD, tracking_uri, experiment, "killed-pretrain")
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.poll() is not None else line
        run_id = line.split()[1]
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no __exit__: nothing can end the run
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    client = MlflowClient(tracking_uri)
    # What we leave: a SIGKILLed process cannot report, so its run stays RUNNING (never FINISHED).
    assert client.get_run(run_id).info.status == "RUNNING"

    with RunLogger.start(tracking_uri, experiment, "killed-pretrain") as resumed:
        assert resumed.resumed and resumed.run_id == run_id and resumed.last_step == 4
        resumed.log_config({"optim": {"lr": 0.001}})
        for step in range(3, 8):  # replay from the last checkpoint (step 3)
            resumed.log_metrics({"train/loss": 1.0}, step=step)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(8))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [r["run_id"] for r in find_runs(tracking_uri, experiment)] == [run_id]


@pytest.mark.slow  # two processes migrate one store
def test_fresh_sqlite_default_store_opened_by_two_processes_at_once(tmp_path):
    """MLflow migrates a new SQLite schema on first open; racing processes must not break it."""
    work = tmp_path / "work"
    script = textwrap.dedent("""
        import sys
        from vitp.config import ExperimentConfig
        from vitp.tracking import RunLogger
        from vitp.config import Run
        cfg = ExperimentConfig(work_dir=sys.argv[1])
        with RunLogger.start(Run.of(cfg).tracking_uri, cfg.tracking.experiment, sys.argv[2]) as run:
            run.log_config(cfg.to_dict())
            run.log_metrics({"train/loss": 1.0}, step=0)
    """)
    procs = [python("-c", script, str(work), f"worker-{i}") for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]

    uri = Run.of(ExperimentConfig(work_dir=str(work))).tracking_uri
    assert uri == f"sqlite:///{work.resolve()}/mlflow.db" and (work / "mlflow.db").exists()
    rows = find_runs(uri, "vit-pipeline")
    assert sorted(r["run_name"] for r in rows) == ["worker-0", "worker-1"]
    assert {r["status"] for r in rows} == {"FINISHED"}
    # Artifacts live beside the DB in the work dir, not in whatever cwd the process had.
    assert len(list((work / "mlartifacts").rglob("config.json"))) == 2
    assert not (REPO / "mlruns").exists()


def test_a_runs_tracking_uri_forms(tmp_path, monkeypatch):
    """A Run's store, made absolute where the run was resolved; nothing is made until the store is
    opened (get_client), which makes the folder it lives in."""
    monkeypatch.chdir(tmp_path)

    def uri(**tracking):
        cfg = ExperimentConfig(work_dir="rel/work")
        return Run.of(absolute_paths(cfg.replace(tracking=dataclasses.replace(cfg.tracking, **tracking)))).tracking_uri

    assert uri() == f"sqlite:///{tmp_path}/rel/work/mlflow.db" and not (tmp_path / "rel").exists()
    get_client(uri())
    assert (tmp_path / "rel/work/mlflow.db").is_file()
    assert uri(uri="http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert uri(uri="store/runs.db") == f"sqlite:///{tmp_path}/store/runs.db"
    assert uri(uri="sqlite:///relative.db") == f"sqlite:///{tmp_path}/relative.db"
    assert uri(uri=str(tmp_path / "mlruns")) == (tmp_path / "mlruns").as_uri()
    with pytest.raises(ConfigError, match="work_dir='s3://bucket/work'.*tracking.uri"):
        Run.of(ExperimentConfig(work_dir="s3://bucket/work")).tracking_uri


def test_tracking_imports_neither_torch_nor_ray():
    code = ("import sys, vitp.tracking, vitp.tracking.server, vitp.tracking.compare; "
            "bad = [m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
