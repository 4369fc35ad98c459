"""Sweeps: Ray Tune over fine-tuning trials, MLflow parent/child runs on a real server,
driver kill + --resume (and a resume after every trial had finished), a failing grid point, ASHA,
an Optuna search over distributions, population-based training (an exploit verified by the
weights) and HyperBand (a paused trial resumed)."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# One Train worker per trial: what these tests check is Tune's and MLflow's side of a sweep, and
# on the session's 4 logical CPUs two such trials run at once (vitp.tune.sweep.max_concurrent).
FAST = ["--set=train.steps=40", "--set=train.eval_every=20", "--set=train.log_every=20",
        "--set=parallel.num_workers=1"]
SHORT = ["--set=train.steps=4", "--set=train.eval_every=4", "--set=train.log_every=2", "--set=optim.warmup_steps=1",
         "--set=parallel.num_workers=1"]  # where what is tested is how trials end, not what they learn


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vitp.tracking import start_server

    root = tmp_path_factory.mktemp("mlflow")
    handle = start_server(f"sqlite:///{root}/mlflow.db", str(root / "artifacts"))
    yield handle
    handle.stop()


_STARTED: list[subprocess.Popen] = []  # the `vitp` processes the running test started


@pytest.fixture(autouse=True)
def _no_sweep_outlives_its_test():
    """A `vitp` a test left running (its wait timed out, an assertion failed first) is killed with its
    process group when the test ends: a hung sweep driver would hold the session Ray's CPUs and
    stall the tests after it."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _vitp(args, env, log_path=None):
    """`vitp ...` in a process group of its own; output to `log_path` (a file nobody has to drain:
    Tune's loop runs in this driver and would block on a full pipe) or to a pipe read by
    communicate()."""
    out = open(log_path, "w") if log_path else subprocess.PIPE
    try:
        proc = subprocess.Popen([sys.executable, "-m", "vitp.cli", *args], env=env, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    finally:
        if log_path:
            out.close()
    _STARTED.append(proc)
    return proc


def _work(tmp_path, digits_shards) -> str:
    """The sweep's work_dir, its digits shards already prepared (the session's, linked where a
    sweep's `ensure_shards` looks for them); other datasets are prepared by the sweep."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "digits").symlink_to(digits_shards)
    return str(tmp_path)


def _env(ray_session):
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}


def _children(uri, sweep):
    from vitp.tracking import TrackingError
    from vitp.tracking.compare import compare_rows

    try:
        return compare_rows(uri, "vit-pipeline-debug", sweep=sweep)
    except TrackingError:  # the experiment does not exist until the sweep's first run
        return []


def _saved_trials(sweep_dir) -> list[tuple[dict, dict]]:
    """(trial, run metadata) of each trial in the newest saved Tune sweep state ([] if none saved)."""
    import json

    states = sorted(sweep_dir.glob("experiment_state-*.json"))
    if not states:
        return []
    try:
        trials = json.loads(states[-1].read_text())["trial_data"]
    except (OSError, ValueError, KeyError):  # being written
        return []
    return [(json.loads(trial), json.loads(meta)) for trial, meta in trials]


def _terminated_trials(sweep_dir) -> int:
    """How many trials the newest saved Tune sweep state marks TERMINATED (0 if none saved)."""
    return sum(trial["status"] == "TERMINATED" for trial, _ in _saved_trials(sweep_dir))


def _mark_trials_pending(sweep_dir) -> int:
    """Rewrite the newest saved sweep state as if the driver died before Tune recorded its
    trials as done (their training and MLflow runs had finished). Returns how many changed."""
    import json

    path = sorted(sweep_dir.glob("experiment_state-*.json"))[-1]
    state = json.loads(path.read_text())
    changed = 0
    for pair in state["trial_data"]:
        trial = json.loads(pair[0])
        changed += trial["status"] == "TERMINATED"
        trial["status"] = "PENDING"
        pair[0] = json.dumps(trial)
    path.write_text(json.dumps(state))
    return changed


@pytest.mark.long(reason="a sweep beyond CI's (the CLI chain's, the rehearsal's, the ASHA, Optuna, PBT and "
                         "HyperBand ones)")
@pytest.mark.e2e
def test_sweep_two_datasets_kill_and_resume(tmp_path, server, ray_session, digits_shards):
    from vitp.tracking.compare import best_per_dataset, compare_rows, format_table
    from vitp.tracking.store import get_client

    args = ["sweep", "debug_finetune", "--name", "s1", f"--set=work_dir={_work(tmp_path, digits_shards)}",
            "--tracking-uri", server.uri, "--space", "data.source=digits,synthetic",
            "--space", "optim.lr=0.03,0.1", *FAST]
    env = _env(ray_session)
    first_log = tmp_path / "first.log"
    first = _vitp(args, env, log_path=first_log)
    t0 = time.time()
    done = []
    while time.time() - t0 < 600 and first.poll() is None:  # kill after the first trial finishes
        done = [r for r in _children(server.uri, "s1") if r["status"] == "FINISHED"]
        if done:
            break
        time.sleep(1)
    assert done, f"no trial finished before the driver exited: {first_log.read_text()[-3000:]}"
    # kill only once Tune's saved sweep state records the finished trial(s) as terminated
    # (saved every TUNE_GLOBAL_CHECKPOINT_S=2 s; slower while other trials start on a busy host)
    t0 = time.time()
    while _terminated_trials(tmp_path / "sweeps" / "s1") < len(done) and time.time() - t0 < 180:
        time.sleep(0.5)
    assert _terminated_trials(tmp_path / "sweeps" / "s1") >= len(done), (
        f"sweep state never saved: {first_log.read_text()[-3000:]}")
    first.send_signal(signal.SIGKILL)
    first.wait()
    client = get_client(server.uri)
    finished_before = {r["run_id"]: client.get_run(r["run_id"]).info.end_time
                       for r in _children(server.uri, "s1") if r["status"] == "FINISHED"}
    assert all(r["status"] != "FINISHED" or r["run_id"] in finished_before
               for r in _children(server.uri, "s1"))

    second = _vitp(args + ["--resume"], env)
    log, _ = second.communicate(timeout=900)
    assert second.returncode == 0, log[-4000:]

    rows = _children(server.uri, "s1")
    assert len(rows) == 4, format_table(rows)  # one child per trial: trials == search space
    names = [r["run_name"] for r in rows]
    assert len(set(names)) == 4
    assert all(r["status"] == "FINISHED" for r in rows)
    for run_id, end_time in finished_before.items():  # finished trials were not re-run
        run = client.get_run(run_id)
        assert run.info.end_time == end_time
        assert run.data.tags.get("vitp.attempt", "1") == "1"
    # the parent: one per sweep, best trial per dataset matches the children
    parents = compare_rows(server.uri, "vit-pipeline-debug", sweep="s1", include_parents=True)
    (parent,) = [r for r in parents if r["run_name"] == "sweep-s1"]
    prun = client.get_run(parent["run_id"])
    assert prun.info.status == "FINISHED"
    best = best_per_dataset(rows)
    assert set(best) == {"digits", "synthetic"}
    for dataset, row in best.items():
        assert prun.data.tags[f"best_trial/{dataset}"] == row["run_id"]
        assert prun.data.metrics[f"best/{dataset}/val_top1"] == pytest.approx(row["best_top1"])
    # vitp compare lists them, best marked per dataset
    out = subprocess.run([sys.executable, "-m", "vitp.cli", "compare", "--tracking-uri", server.uri,
                          "--sweep", "s1", "--format", "json", "--plot", str(tmp_path / "s1.png")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    table = json.loads(out.stdout)
    marked = {r["dataset"]: r["run_id"] for r in table if r["best"]}
    assert marked == {d: r["run_id"] for d, r in best.items()}
    assert (tmp_path / "s1.png").stat().st_size > 10_000
    assert (tmp_path / "s1-search.png").stat().st_size > 10_000  # best so far vs trials and time
    artifacts = sorted(a.path for a in client.list_artifacts(parent["run_id"], "compare"))
    assert artifacts == ["compare/s1-search.png", "compare/s1.png"]

    # The driver dies after every trial's training and MLflow run finished but before Tune
    # recorded them as done: resumed, each trial reports its final checkpoint, trains nothing.
    before = {r["run_id"]: client.get_run(r["run_id"]) for r in rows}
    losses = {i: len(client.get_metric_history(i, "train/loss")) for i in before}
    assert _mark_trials_pending(tmp_path / "sweeps" / "s1") == 4
    third = _vitp(args + ["--resume"], env)
    log, _ = third.communicate(timeout=900)
    assert third.returncode == 0, log[-4000:]
    assert "already finished" in log, log[-4000:]
    again = _children(server.uri, "s1")
    assert {r["run_id"] for r in again} == set(before)
    for run_id, run in before.items():  # each run left as it was
        after = client.get_run(run_id)
        assert after.info.status == "FINISHED" and after.info.end_time == run.info.end_time
        assert after.data.tags.get("vitp.attempt", "1") == run.data.tags.get("vitp.attempt", "1")
        assert len(client.get_metric_history(run_id, "train/loss")) == losses[run_id]  # nothing retrained
    prun = client.get_run(parent["run_id"])
    for dataset, row in best_per_dataset(again).items():
        assert prun.data.tags[f"best_trial/{dataset}"] == row["run_id"]
        assert prun.data.metrics[f"best/{dataset}/val_top1"] == pytest.approx(row["best_top1"])
    # the re-resumed sweep summarised again, after (not hidden behind) the earlier summary's step
    steps = sorted(m.step for m in client.get_metric_history(prun.info.run_id, "sweep/seconds"))
    assert len(steps) == len(set(steps)) >= 2, steps


def _damaged_export(path) -> str:
    """An export of the debug recipe whose weights file was cut short (a download that stopped):
    its config.json is sound, so only a worker loading the weights finds the damage."""
    import torch

    from vitp.model.weights import write_export
    from vitp.recipes import with_overrides

    write_export(str(path), {"pos_embed": torch.zeros(1, 17, 64)}, with_overrides("debug").to_dict(), {"step": 4})
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return str(path)


def _trial_failures(sweep_dir) -> dict[str, int]:
    """{trial's experiment tag (its grid point): times Tune saw it fail} from the saved sweep state."""
    return {trial["experiment_tag"]: meta["num_failures"] for trial, meta in _saved_trials(sweep_dir)}


def _planted_exports(root, unfit_key: str, bad_dtype: str) -> tuple[str, str]:
    """Two exports of the debug recipe (sound config.json) whose weights fail in a worker with
    the planted text in the error: one holds a single tensor named `unfit_key` (it does not fit the
    model: a ValueError, a fault that is retried), one a header whose dtype is `bad_dtype`
    (safetensors repeats it: the weights cannot be read, an InputError, a user's mistake)."""
    import json
    import struct

    import torch

    from vitp.model.weights import write_export
    from vitp.recipes import with_overrides

    unfit, damaged = root / "unfit-export", root / "damaged-export"
    write_export(str(unfit), {unfit_key: torch.zeros(2)}, with_overrides("debug").to_dict(), {"step": 4})
    write_export(str(damaged), {"pos_embed": torch.zeros(2)}, with_overrides("debug").to_dict(), {"step": 4})
    header = json.dumps({"pos_embed": {"dtype": bad_dtype, "shape": [2], "data_offsets": [0, 8]}}).encode()
    (damaged / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    return str(unfit), str(damaged)


@pytest.mark.e2e
def test_a_fault_is_retried_and_a_users_mistake_is_not(tmp_path, server, ray_session, digits_shards):
    """CI's form of the next test, two trials: a fault (weights that do not fit the model, a
    ValueError inside training) is retried tune.trial_retries times; a user's mistake (a damaged
    source, an InputError in the workers) ends its trial on its first attempt. Both end FAILED with
    what went wrong, and the sweep exits 1. Each error carries a token-shaped secret (the weights
    file's text, repeated by the error): no trace of it under the work dir, where Tune keeps its
    state, errors and (now off) result files, nor in the MLflow runs."""
    import secrets
    import string

    from vitp.tracking.store import get_client

    def token(prefix: str) -> str:
        return prefix + "".join(secrets.choice(string.ascii_letters) for _ in range(34))

    planted = {"unfit": token("hf_"), "damaged": token("ghp_")}
    (tmp_path / "from").mkdir()
    unfit, damaged = _planted_exports(tmp_path / "from", planted["unfit"], planted["damaged"])
    work = tmp_path / "work"
    work.mkdir()
    args = ["sweep", "debug_finetune", "--name", "s-fail", f"--set=work_dir={_work(work, digits_shards)}",
            "--tracking-uri", server.uri, "--from", unfit, "--from", damaged, "--space", "optim.lr=0.1",
            "--set=tune.trial_retries=1", *SHORT]
    proc = _vitp(args, _env(ray_session))
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 1 and "2 trial(s) failed" in log, log[-4000:]
    failures = _trial_failures(work / "sweeps" / "s-fail")  # Tune's own count of failed attempts
    assert sorted(("damaged-export" in tag, n) for tag, n in failures.items()) == [(False, 2), (True, 0)], failures
    client = get_client(server.uri)
    rows = _children(server.uri, "s-fail")
    assert sorted((r["source"] == damaged, r["status"]) for r in rows) == [(False, "FAILED"), (True, "FAILED")], rows
    for row in rows:
        error = client.get_run(row["run_id"]).data.tags["vitp.error"]
        assert ("not a readable weights file" in error) == (row["source"] == damaged), error
        assert not any(s in error for s in planted.values()), error
    assert list((work / "sweeps" / "s-fail").rglob("error.txt"))  # the fault's, written by Tune
    for path in (p for p in work.rglob("*") if p.is_file() and "shards" not in p.parts):
        data = path.read_bytes()
        assert not [s for s in planted.values() if s.encode() in data or s.encode().hex().encode() in data], path
    assert not list(work.rglob("progress.csv")) + list(work.rglob("result.json")) + list(work.rglob("events.out*"))


@pytest.mark.long(reason="four trials, one finishing beside the failures; CI runs the two failures "
                         "(test_a_fault_is_retried_and_a_users_mistake_is_not)")
@pytest.mark.e2e
def test_failing_grid_point_fails_alone(tmp_path, server, ray_session, digits_shards):
    """Two ways a grid point fails while the others finish: a fault (model.num_classes=5 on 10-class
    digits: labels past the head, inside training) is retried trial_retries times; a user's mistake
    (a damaged source, an InputError in the workers) ends its trial on the first attempt."""
    from vitp.tracking.store import get_client

    damaged = _damaged_export(tmp_path / "damaged-export")
    args = ["sweep", "debug_finetune", "--name", "s2", f"--set=work_dir={_work(tmp_path, digits_shards)}",
            "--tracking-uri", server.uri, "--from", "scratch", "--from", damaged, "--space", "optim.lr=0.1",
            "--space", "model.num_classes=10,5", "--set=tune.trial_retries=1", *FAST]
    proc = _vitp(args, _env(ray_session))
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 1, log[-4000:]  # the sweep ran to the end; exit 1: trials failed
    assert "3 trial(s) failed" in log, log[-4000:]
    assert log.count("not a readable weights file") >= 2, log[-4000:]  # its line, per damaged trial
    rows = _children(server.uri, "s2")
    status = sorted((r["source"] == damaged, "num_classes5-" in r["run_name"], r["status"]) for r in rows)
    assert status == [(False, False, "FINISHED"), (False, True, "FAILED"),
                      (True, False, "FAILED"), (True, True, "FAILED")], status
    failures = _trial_failures(tmp_path / "sweeps" / "s2")  # Tune's own count of attempts that failed
    assert sorted(("damaged-export" in tag, "num_classes=5" in tag, n) for tag, n in failures.items()) == [
        (False, False, 0), (False, True, 2), (True, False, 0), (True, True, 0)], failures
    client = get_client(server.uri)
    for row in rows:
        if row["status"] == "FAILED":  # what went wrong, in the run
            error = client.get_run(row["run_id"]).data.tags["vitp.error"]
            assert ("not a readable weights file" in error) == (row["source"] == damaged), error
    exp = client.get_experiment_by_name("vit-pipeline-debug")
    (parent,) = client.search_runs([exp.experiment_id], "attributes.run_name = 'sweep-s2'")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["failed_trials"] == "3"
    assert parent.data.metrics["sweep/failed"] == 3


@pytest.mark.e2e
def test_a_trial_asha_stops_is_killed_with_its_scheduler_and_step_not_failed(tmp_path, server, ray_session,
                                                                              digits_shards):
    """A random search, one trial at a time: the first (lr 0.1) sets the bar at the first
    evaluation; the second (lr 1e-7: its zero-initialised head barely moves) is below it and ASHA
    stops it there. The learning rates are a grid axis (each once, in order); each trial's momentum
    is drawn, within its range, and logged with its run."""
    from vitp.tracking.store import get_client
    from vitp.tune.progress import STOPPED_AT_TAG, STOPPED_BY_TAG

    args = ["sweep", "debug_finetune", "--name", "s-asha", f"--set=work_dir={_work(tmp_path, digits_shards)}",
            "--tracking-uri", server.uri, "--space", "optim.lr=grid([0.1, 1e-7])", "--scheduler", "asha",
            "--search", "random", "--space", "optim.momentum=uniform(0.8, 0.9)",
            "--set=tune.max_concurrent_trials=1", "--set=train.steps=100", "--set=train.eval_every=20",
            "--set=train.log_every=10"]
    proc = _vitp(args, _env(ray_session))
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]  # a pruned trial is not a failure
    assert "stopped early by asha at step 20 of 100" in log, log[-4000:]
    runs = {("lr1e-07" in r["run_name"]): r for r in _children(server.uri, "s-asha")}
    assert runs[False]["status"] == "FINISHED" and runs[True]["status"] == "KILLED", runs
    tags = get_client(server.uri).get_run(runs[True]["run_id"]).data.tags
    assert (tags[STOPPED_BY_TAG], tags[STOPPED_AT_TAG]) == ("asha", "20")
    # the stop ends the trial's process and its Train run with it: it does not train on to step 100
    steps = [m.step for m in get_client(server.uri).get_metric_history(runs[True]["run_id"], "train/loss")]
    assert steps and max(steps) < 100, steps
    momenta = [float(get_client(server.uri).get_run(r["run_id"]).data.params["optim.momentum"]) for r in runs.values()]
    assert all(0.8 <= m <= 0.9 for m in momenta) and momenta[0] != momenta[1], momenta


@pytest.mark.e2e
def test_an_optuna_search_over_distributions_killed_and_resumed_continues_its_study(tmp_path, server, ray_session,
                                                                                   digits_shards):
    """Optuna's TPE over a log-uniform learning rate, an optimizer choice and a momentum that
    depends on it, one trial at a time; the driver is interrupted (Ctrl-C) after two trials and ends
    its parent run KILLED, the resumed one SIGKILLed after the third. Resumed, the same search goes
    on: the finished trials are not re-run and the study continues where it was (a study started
    afresh with the same seed would propose the first trial's values again). Each
    trial's logged config holds the values drawn for it, within their ranges, the conditional one
    by its optimizer's case; one parent run records the search and its seed."""
    from vitp.tracking.store import ERROR_TAG, get_client

    args = ["sweep", "debug_finetune", "--name", "s-tpe", f"--set=work_dir={_work(tmp_path, digits_shards)}",
            "--tracking-uri", server.uri, "--search", "optuna", "--set=tune.num_samples=4",
            "--set=tune.startup_trials=2", "--set=tune.seed=3", "--set=tune.max_concurrent_trials=1",
            "--space", "optim.lr=loguniform(1e-3,0.3)", "--space", "optim.name=sgd,adamw",
            "--space", "optim.momentum=when(optim.name, {'sgd': uniform(0.5, 0.9), 'adamw': 0.9})",
            "--set=train.steps=20", "--set=train.eval_every=10", "--set=train.log_every=10",
            "--set=parallel.num_workers=1"]
    env, first_log = _env(ray_session), tmp_path / "first.log"
    first = _vitp(args, env, log_path=first_log)
    t0, done = time.time(), []
    while time.time() - t0 < 600 and first.poll() is None and len(done) < 2:
        done = [r for r in _children(server.uri, "s-tpe") if r["status"] == "FINISHED"]
        time.sleep(1)
    assert len(done) >= 2, f"two trials did not finish before the driver exited: {first_log.read_text()[-3000:]}"
    t0 = time.time()
    while _terminated_trials(tmp_path / "sweeps" / "s-tpe") < len(done) and time.time() - t0 < 180:
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)  # Ctrl-C: Tune saves the search and returns; the sweep is not done
    assert first.wait(timeout=300) == 130, first_log.read_text()[-3000:]
    assert "interrupted: continue it with --resume" in first_log.read_text()
    client = get_client(server.uri)
    experiment = client.get_run(done[0]["run_id"]).info.experiment_id
    (parent,) = client.search_runs([experiment], "attributes.run_name = 'sweep-s-tpe'")
    assert parent.info.status == "KILLED"  # not FINISHED with trials left
    finished_before = {r["run_id"]: client.get_run(r["run_id"]).info.end_time for r in done}

    # resumed, then SIGKILLed once a third trial finished (Tune's periodic save is all it has)
    second_log = tmp_path / "second.log"
    second = _vitp(args + ["--resume"], env, log_path=second_log)
    t0 = time.time()
    while time.time() - t0 < 600 and second.poll() is None and len(done) < 3:
        done = [r for r in _children(server.uri, "s-tpe") if r["status"] == "FINISHED"]
        time.sleep(1)
    t0 = time.time()
    while _terminated_trials(tmp_path / "sweeps" / "s-tpe") < len(done) and time.time() - t0 < 180:
        time.sleep(0.5)
    second.send_signal(signal.SIGKILL)
    second.wait()
    assert len(done) >= 3, second_log.read_text()[-3000:]
    finished_before.update({r["run_id"]: client.get_run(r["run_id"]).info.end_time for r in done
                            if r["run_id"] not in finished_before})

    third = _vitp(args + ["--resume"], env)
    log, _ = third.communicate(timeout=900)
    assert third.returncode == 0, log[-4000:]
    runs = [r for r in _children(server.uri, "s-tpe") if r["status"] == "FINISHED"]
    # the SIGKILL may land just after Tune started the next trial, before its saved state named it:
    # that trial's run ends FAILED, saying so, and the resumed search runs its values again
    lost = [client.get_run(r["run_id"]) for r in _children(server.uri, "s-tpe") if r["status"] != "FINISHED"]
    assert len(runs) == 4 and len(lost) <= 1, (runs, lost)
    assert all(r.info.status == "FAILED" and "ended without ending its run" in r.data.tags[ERROR_TAG]
               for r in lost), lost
    for run_id, end_time in finished_before.items():
        assert client.get_run(run_id).info.end_time == end_time
    drawn = []
    for r in runs:
        run = client.get_run(r["run_id"])
        params = run.data.params
        lr, name, momentum = float(params["optim.lr"]), params["optim.name"], float(params["optim.momentum"])
        assert 1e-3 <= lr <= 0.3 and name in ("sgd", "adamw"), params
        assert (0.5 <= momentum <= 0.9) if name == "sgd" else momentum == 0.9, params
        assert r["run_name"].endswith("-t" + run.data.tags["trial_id"]), r["run_name"]  # two equal draws: two runs
        drawn.append(lr)
    assert len(set(drawn)) == 4, drawn
    (parent,) = client.search_runs([run.info.experiment_id], "attributes.run_name = 'sweep-s-tpe'")
    assert (parent.data.params["sweep.search"], parent.data.params["sweep.seed"]) == ("optuna", "3")
    assert parent.info.status == "FINISHED"  # the same parent run, continued

    # a driver killed before Tune recorded any trial leaves only tuner.pkl (restored from it alone,
    # Tune would search without the space): --resume starts the search afresh, values drawn again
    sweep_dir = tmp_path / "sweeps" / "s-tpe"
    for state in [*sweep_dir.glob("experiment_state-*.json"), *sweep_dir.glob("searcher-state-*.pkl")]:
        state.unlink()
    assert (sweep_dir / "tuner.pkl").exists()
    before, fourth_log = {r["run_id"] for r in _children(server.uri, "s-tpe")}, tmp_path / "fourth.log"
    fourth = _vitp(args + ["--resume"], env, log_path=fourth_log)
    t0, new = time.time(), []
    while time.time() - t0 < 600 and fourth.poll() is None and not new:  # its first trial's run is enough
        new = [r for r in _children(server.uri, "s-tpe") if r["run_id"] not in before]
        time.sleep(1)
    fourth.send_signal(signal.SIGINT)
    assert fourth.wait(timeout=300) == 130, fourth_log.read_text()[-4000:]
    log = fourth_log.read_text()
    assert new and "no trial was recorded" in log and "starts afresh" in log, log[-4000:]
    for r in new:
        params = client.get_run(r["run_id"]).data.params
        assert "-lr" in r["run_name"] and 1e-3 <= float(params["optim.lr"]) <= 0.3, (r["run_name"], params)


@pytest.mark.e2e
def test_pbt_copies_the_better_trials_checkpoint_into_the_worse_and_records_the_perturbation(
        tmp_path, server, ray_session, digits_shards):
    """Population-based training of two trials at once, lr 0.1 and 1e-7 (whose zero-initialised head
    barely moves): at an evaluation where the second is the worse, it goes on from a copy of the
    first's checkpoint, whose weights the copy holds exactly, with a perturbed learning rate. Its
    MLflow run records the donor (tag pbt.exploit.STEP), the values at every start (pbt/optim.lr)
    and a changed value as a param (optim.lr.continued_at_STEP); no step is logged twice."""
    import re

    import torch

    from vitp.tracking.store import get_client
    from vitp.train.export import consolidate

    args = ["sweep", "debug_finetune", "--name", "s-pbt", f"--set=work_dir={_work(tmp_path, digits_shards)}",
            "--tracking-uri", server.uri, "--space", "optim.lr=0.1,1e-7", "--scheduler", "pbt",
            "--set=tune.max_concurrent_trials=2", "--set=train.steps=20", "--set=train.eval_every=10",
            "--set=train.log_every=10", "--set=parallel.num_workers=1"]
    proc = _vitp(args, _env(ray_session), log_path=tmp_path / "sweep.log")
    proc.wait(timeout=900)
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    client = get_client(server.uri)
    runs = {r["run_name"]: client.get_run(r["run_id"]) for r in _children(server.uri, "s-pbt")}
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs.values()), runs
    exploits = [(name, int(key.rsplit(".", 1)[1]), value) for name, run in runs.items()
                for key, value in run.data.tags.items() if key.startswith("pbt.exploit.")]
    assert exploits, f"no trial exploited another: {log[-4000:]}"
    name, step, value = min(exploits, key=lambda e: e[1])  # the first exploit
    (donor,) = [other for other in runs if other != name]
    assert value.startswith(f"{donor} (") and f"/runs/{donor}/checkpoint_{step:08d}" in value, value
    copy = tmp_path / "runs" / name / f"checkpoint_{step:08d}"
    a, b = consolidate(str(tmp_path / "runs" / donor / copy.name)), consolidate(str(copy))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the donor's weights
    assert re.search(rf"\[{re.escape(name)}\] resumed from \S+/runs/{re.escape(name)}/{copy.name} at step {step}",
                     log), log[-4000:]
    run = runs[name]
    lrs = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "pbt/optim.lr")}
    assert 0 in lrs and step in lrs and lrs[step] in (pytest.approx(0.1), pytest.approx(1e-7)), lrs
    first = float(run.data.params["optim.lr"])
    if lrs[step] != pytest.approx(first):  # the value changed: params keep the first, the new one beside it
        assert float(run.data.params[f"optim.lr.continued_at_{step}"]) == pytest.approx(lrs[step])
    for r in runs.values():
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
        assert len(steps) == len(set(steps)) and max(steps) == 20, (r.info.run_name, sorted(steps))


@pytest.mark.e2e
def test_hyperband_pauses_a_trial_at_its_rung_resumes_the_better_and_stops_the_worse(
        tmp_path, server, ray_session, digits_shards):
    """HyperBand over four learning rates, one trial at a time, two evaluations each: Tune's first
    bracket trains its two trials in full (the sweep log says so); in the second, the third trial
    (lr 0.1) is paused at its first evaluation (step 20: by step 10 neither beats chance), the
    fourth (lr 1e-7, whose zero-initialised head barely moves) is stopped there (KILLED, tagged by
    hyperband) and the third goes on from its own checkpoint to the end. No step is logged twice."""
    import re

    from vitp.tracking.store import get_client
    from vitp.tune.progress import STOPPED_AT_TAG, STOPPED_BY_TAG

    args = ["sweep", "debug_finetune", "--name", "s-hb", f"--set=work_dir={_work(tmp_path, digits_shards)}",
            "--tracking-uri", server.uri, "--space", "optim.lr=0.03,0.3,0.1,1e-7", "--scheduler", "hyperband",
            "--set=tune.max_concurrent_trials=1", "--set=train.steps=40", "--set=train.eval_every=20",
            "--set=train.log_every=10", "--set=parallel.num_workers=1"]
    proc = _vitp(args, _env(ray_session), log_path=tmp_path / "sweep.log")
    proc.wait(timeout=900)
    log = (tmp_path / "sweep.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "brackets of 2 trials in full; 2 trials stopping at evaluation 1" in log, log[:4000]
    client = get_client(server.uri)
    runs = {float(r.data.params["optim.lr"]): r for r in
            (client.get_run(c["run_id"]) for c in _children(server.uri, "s-hb"))}
    assert sorted(runs) == [1e-7, 0.03, 0.1, 0.3], runs
    stopped = runs[1e-7]
    assert stopped.info.status == "KILLED", log[-4000:]
    assert (stopped.data.tags[STOPPED_BY_TAG], stopped.data.tags[STOPPED_AT_TAG]) == ("hyperband", "20")
    assert all(runs[lr].info.status == "FINISHED" for lr in (0.03, 0.1, 0.3)), log[-4000:]
    paused = runs[0.1].info.run_name
    assert re.search(rf"\[{re.escape(paused)}\] resumed from \S+/runs/{re.escape(paused)}/checkpoint_00000020 "
                     r"at step 20", log), log[-4000:]
    for lr, r in runs.items():
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
        assert len(steps) == len(set(steps)) and (max(steps) < 40 if lr == 1e-7 else max(steps) == 40), (lr, steps)
