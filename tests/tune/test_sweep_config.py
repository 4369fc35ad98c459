"""Trial configs without Ray: `finetune_config` takes the model shape from the source unless the
user set it; `build_spec` resolves each dataset's recipe once, validates every dataset x source
before Ray starts, and trials are typed edits of those configs."""
import dataclasses
import os

import pytest

from vitp.config import ConfigError, ExperimentConfig, set_values, validate
from vitp.errors import InputError
from vitp.model.vit import ViT
from vitp.model.weights import write_export
from vitp.recipes import overrides_for, resolve, with_overrides
from vitp.train.transfer import finetune_config
from vitp.tune.spec import build_spec, dataset_runs, probes, trial_config


@pytest.fixture
def export_dir(tmp_path):
    """An export of a "debug"-recipe mu/4 model with average pooling at 16 px, MLflow run r9."""
    cfg = ExperimentConfig(recipe="debug")
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, variant="mu/4", pool="gap", num_classes=3),
                      data=dataclasses.replace(cfg.data, image_size=16, source="synthetic"))
    m = ViT("mu/4", image_size=16, num_classes=3, pool="gap", head="pretrain")
    return write_export(str(tmp_path / "export"), m.state_dict(), cfg.to_dict(),
                        {"step": 5, "mlflow_run_id": "r9"})


def test_finetune_config_takes_the_source_shape_and_names_the_run(export_dir):
    cfg, tags = finetune_config(with_overrides("debug_finetune"), export_dir)
    m = cfg.model
    assert (m.variant, m.pool, m.head, cfg.train.init_from) == ("mu/4", "gap", "finetune", export_dir)
    assert cfg.tracking.run_name == "debug_finetune-mu4-digits-from-debug"
    assert tags == {"source": export_dir, "source_kind": "weights", "source_run_id": "r9",
                    "source_image_size": "16"}
    validate(cfg)

    scratch, tags = finetune_config(with_overrides("debug_finetune"), "scratch")
    assert scratch.model.variant == "pico/8" and scratch.train.init_from == ""
    assert scratch.tracking.run_name == "debug_finetune-pico8-digits-scratch"
    assert tags == {"source": "scratch", "source_kind": "scratch"}


def test_finetune_config_lets_the_user_win_and_does_not_validate(export_dir):
    user = with_overrides("debug_finetune", ["model.pool=cls", "tracking.run_name=mine", "optim.lr=-1"])
    cfg, _ = finetune_config(user, export_dir, user_keys={"model.pool", "tracking.run_name", "optim.lr"})
    assert (cfg.model.variant, cfg.model.pool, cfg.tracking.run_name) == ("mu/4", "cls", "mine")
    with pytest.raises(ConfigError, match="optim.lr"):  # the caller validates, once
        validate(cfg)
    with pytest.raises(InputError, match="nope: no such file or directory"):
        finetune_config(user, os.path.join(export_dir, "nope"))


def test_build_spec_typed_trials_validated_once(tmp_path, export_dir):
    base = resolve("debug_finetune", [f"work_dir={tmp_path}/w", "train.steps=30"], check_paths=False)
    spec = build_spec("s", base, "debug_finetune", [f"work_dir={tmp_path}/w", "train.steps=30"],
                      changes={"tune.scheduler": "asha"},
                      recipes=["debug_finetune", "demo_finetune"], sources=[export_dir, "scratch"],
                      extra_space={"optim.lr": [0.5, 0.25]})
    assert set(spec.configs) == {"debug_finetune", "demo_finetune"}
    for d in spec.configs.values():  # every dataset's recipe got the user's --set and typed changes
        assert d["work_dir"] == f"{tmp_path}/w" and d["train"]["steps"] == 30
        assert d["tune"]["scheduler"] == "asha"
    assert spec.tune.space["optim.lr"] == [0.5, 0.25] and spec.work_dir == f"{tmp_path}/w"
    # the sweep's store and Tune state are the base run's, and every trial logs to that store
    assert (spec.tracking_uri, spec.dir) == (f"sqlite:///{tmp_path}/w/mlflow.db", f"{tmp_path}/w/sweeps/s")
    assert {trial_config(spec, t)[0].tracking.uri for t in probes(spec)} == {spec.tracking_uri}
    served = build_spec("s", set_values(base, {"tracking.uri": "http://127.0.0.1:5000"}), "debug_finetune", [])
    assert served.tracking_uri == "http://127.0.0.1:5000"
    assert {trial_config(served, t)[0].tracking.uri for t in probes(served)} == {"http://127.0.0.1:5000"}

    cfg, tags = trial_config(spec, {"recipe": "demo_finetune", "source": export_dir, "optim.lr": 0.25})
    assert cfg.recipe == "demo_finetune" and cfg.optim.lr == 0.25 and cfg.model.variant == "mu/4"
    assert cfg.train.checkpoint_every == 0  # the recipe's (a trial keeps its checkpoints)
    name = cfg.tracking.run_name
    assert name.startswith("s-demo_finetune-from-") and name.endswith("_export-lr0.25"), name
    assert (cfg.tracking.uri, cfg.tracking.experiment) == (spec.tracking_uri, spec.experiment)
    assert tags["source_run_id"] == "r9"
    # both recipes fine-tune on the same digits shards: prepared once
    assert [(r.cfg.recipe, r.cfg.data.source) for r in dataset_runs(spec)] == [("debug_finetune", "digits")]


def test_build_spec_rejects_a_bad_value_or_source_before_ray(tmp_path, export_dir):
    base = resolve("debug_finetune", [f"work_dir={tmp_path}"], check_paths=False)
    with pytest.raises(ConfigError, match=r"(?s)sweep trial .*lr-1\.0: .*optim\.lr=-1\.0"):
        build_spec("s", base, "debug_finetune", [f"work_dir={tmp_path}"],
                   extra_space={"optim.lr": [0.1, -1.0]})
    with pytest.raises(InputError, match="missing: no such file"):
        build_spec("s", base, "debug_finetune", [f"work_dir={tmp_path}"], sources=[f"{tmp_path}/missing"])
    with pytest.raises(ConfigError, match="not recipes"):
        build_spec("s", base, "debug_finetune", [], recipes=["nope"])


def test_build_spec_validates_every_combination_of_the_grid(tmp_path):
    """Each axis is valid on its own; only ZeRO-0 together with optimizer offload is not."""
    base = resolve("debug_finetune", [f"work_dir={tmp_path}"], check_paths=False)
    space = {"parallel.zero_stage": [1, 0], "parallel.offload_optimizer": [False, True]}
    with pytest.raises(ConfigError, match=r"(?s)sweep trial .*offload_optimizerTrue.*zero_stage0: .*offload_optimizer"):
        build_spec("s", base, "debug_finetune", [f"work_dir={tmp_path}"], extra_space=space)
    ok = build_spec("s", base, "debug_finetune", [f"work_dir={tmp_path}"],
                    extra_space={"parallel.zero_stage": [1, 2], "parallel.offload_optimizer": [False, True]})
    assert ok.tune.space["parallel.zero_stage"] == [1, 2]


def test_a_sweep_saved_without_configs_rebuilds_them_from_its_overrides(tmp_path):
    """A SweepSpec restored from a Tune state that predates `configs` still yields its trials."""
    base = resolve("debug_finetune", [f"work_dir={tmp_path}"], check_paths=False)
    spec = build_spec("s", base, "debug_finetune", [f"work_dir={tmp_path}", "train.steps=30"])
    old = {k: v for k, v in spec.to_dict().items() if k not in ("configs", "tune")}
    old.update(spec.to_dict()["tune"])  # a spec of that time: the search settings at its top level
    restored = type(spec).from_dict(old)
    assert restored.tune == spec.tune
    trial = {k: v[0] for k, v in spec.tune.space.items()}
    assert trial_config(restored, trial)[0].to_dict() == trial_config(spec, trial)[0].to_dict()


def test_recipe_prefixed_overrides_reach_that_datasets_trials_only(tmp_path):
    """`--set RECIPE:KEY=VALUE` in a sweep over several datasets (one job spec for a whole
    transfer): that recipe's trials get it, the others do not; kept as given for a restored sweep;
    a recipe the sweep does not run, or a key every trial shares, is refused before Ray starts."""
    (tmp_path / "c10").mkdir()
    (tmp_path / "pets").mkdir()
    sets = [f"work_dir={tmp_path}", "train.steps=7", "optim.warmup_steps=1", 'tune.space={"optim.lr":[0.01]}',
            f"finetune_cifar10:data.path={tmp_path}/c10", f"finetune_pets:data.path={tmp_path}/pets",
            "finetune_pets:train.steps=5"]
    base = with_overrides("finetune_cifar10", overrides_for("finetune_cifar10", sets))  # as `vitp sweep` does
    spec = build_spec("t", base, "finetune_cifar10", sets, recipes=["finetune_cifar10", "finetune_pets"])
    trials = {t["recipe"]: trial_config(spec, t)[0] for t in probes(spec)}
    assert set(trials) == {"finetune_cifar10", "finetune_pets"}  # one learning rate, two datasets
    assert (trials["finetune_pets"].data.path, trials["finetune_pets"].train.steps) == (f"{tmp_path}/pets", 5)
    assert (trials["finetune_cifar10"].data.path, trials["finetune_cifar10"].train.steps) == (f"{tmp_path}/c10", 7)
    restored = type(spec).from_dict({k: v for k, v in spec.to_dict().items() if k != "configs"})
    assert trial_config(restored, probes(spec)[1])[0].to_dict() == trial_config(spec, probes(spec)[1])[0].to_dict()
    with pytest.raises(ConfigError, match=r"finetune_flowers:train.steps=5: the sweep runs no recipe "
                                          r"'finetune_flowers'; its recipes: finetune_cifar10, finetune_pets"):
        build_spec("t", base, "finetune_cifar10", ["finetune_flowers:train.steps=5"],
                   recipes=["finetune_cifar10", "finetune_pets"])
    with pytest.raises(ConfigError, match=r"tracking.experiment is the same for every trial.*without 'finetune_pets:'"):
        build_spec("t", base, "finetune_cifar10", ["finetune_pets:tracking.experiment=x"],
                   recipes=["finetune_cifar10", "finetune_pets"])


def test_build_spec_points_are_crossed_with_the_space_and_checked(tmp_path, export_dir):
    """Explicit trials (the demo's seeds and data fractions) x every source; shard sets deduplicated
    by what they read; a point repeating a space key or naming a bad value fails before Ray."""
    base = resolve("demo_fractals", [f"work_dir={tmp_path}"], check_paths=False)
    points = [{"recipe": "demo_fractals", "data.train_fraction": 0.2, "train.seed": s} for s in (0, 1)]
    points.append({"recipe": "demo_finetune", "data.train_fraction": 1.0, "train.seed": 0})
    spec = build_spec("s", base, "demo_fractals", [], changes={"work_dir": str(tmp_path)},
                      sources=[export_dir, "scratch"], points=points)
    trials = probes(spec)
    assert len(trials) == 6
    assert sorted((t["recipe"], t["train.seed"], t["source"]) for t in trials) == sorted(
        (p["recipe"], p["train.seed"], s) for p in points for s in (export_dir, "scratch"))
    cfg, _ = trial_config(spec, trials[0])
    assert (cfg.data.train_fraction, cfg.data.synth_seed) == (0.2, 1)
    names = {trial_config(spec, t)[0].tracking.run_name for t in trials}
    assert len(names) == 6  # seeds and fractions name the runs apart
    # two seeds share the fractals' 20% shards; digits has its own
    assert [(r.cfg.recipe, r.cfg.data.train_fraction) for r in dataset_runs(spec)] == [
        ("demo_fractals", 0.2), ("demo_finetune", 1.0)]

    with pytest.raises(ConfigError, match="also in the search space"):
        build_spec("s", base, "demo_fractals", [], sources=["scratch"], points=[{"source": "scratch"}])
    with pytest.raises(ConfigError, match=r"train_fraction"):
        build_spec("s", base, "demo_fractals", [], points=[{"data.train_fraction": 0.0}])
    with pytest.raises(ConfigError, match="nope"):
        build_spec("s", base, "demo_fractals", [], points=[{"train.nope": 1}])


def test_a_sweep_of_an_experiment_file_in_a_folder_names_its_trials_by_the_files_stem(tmp_path):
    """`vitp sweep experiments/lr.yaml`: the trials' run names carry the file's stem (a run name is
    one path component), the file's settings in every trial."""
    folder = tmp_path / "experiments"
    folder.mkdir()
    exp = folder / "lr.yaml"
    exp.write_text(f"recipe: debug_finetune\nwork_dir: {tmp_path}/w\ntrain: {{steps: 30}}\n")
    base = with_overrides(str(exp))
    spec = build_spec("s", base, str(exp), [], extra_space={"optim.lr": [0.5]})
    (trial,) = probes(spec)
    cfg, _ = trial_config(spec, trial)
    assert cfg.tracking.run_name == "s-lr-scratch-lr0.5" and cfg.train.steps == 30


def test_swept_path_values_are_made_absolute_where_the_sweep_is_built(tmp_path, monkeypatch):
    """Tune runs each trial in its own working directory: a relative data.shards in the space or a
    point is resolved in build_spec, against the directory the user gave it in."""
    monkeypatch.chdir(tmp_path)
    base = resolve("debug_finetune", ["work_dir=w"], check_paths=False)
    spec = build_spec("s", base, "debug_finetune", ["work_dir=w"], extra_space={"data.shards": ["a", "b"]},
                      points=[{"train.init_from": "scratch"}])
    assert spec.work_dir == str(tmp_path / "w") and spec.tune.space["data.shards"] == [str(tmp_path / "a"),
                                                                                  str(tmp_path / "b")]
    monkeypatch.chdir("/")
    assert {trial_config(spec, t)[0].data.shards for t in probes(spec)} == {str(tmp_path / "a"), str(tmp_path / "b")}


def test_only_reports_with_the_sweeps_metric_reach_tune():
    """A checkpoint between evaluations reports no val/top1; Tune would end the whole sweep on it
    (its strict metric check), so the trial's callback passes on only reports that carry it, each
    with the evaluations made so far and whether it is the run's last (what ASHA counts and spares)."""
    from vitp.recipes import resolve
    from vitp.tune.population import EVALUATION, LAST_EVALUATION
    from vitp.tune.progress import EvaluationReports

    class Queue(list):
        put = list.append

    cfg = resolve("debug_finetune", ["train.steps=400", "train.eval_every=150"], check_paths=False)
    callback = EvaluationReports.__new__(EvaluationReports)  # its Tune session's queue, without Tune
    callback.metric, callback.cfg, callback._training_actor_item_queue = "val/top1", cfg, Queue()
    callback.after_report(None, [{"step": 100, "train/loss": 1.0}], None)  # a checkpoint's report
    callback.after_report(None, [{"step": 300, "val/top1": 0.5}, {"step": 300}], None)
    callback.after_report(None, [{"step": 400, "val/top1": 0.6}], None)  # the last step evaluates too
    assert callback._training_actor_item_queue == [
        {"step": 300, "val/top1": 0.5, EVALUATION: 2, LAST_EVALUATION: False},
        {"step": 400, "val/top1": 0.6, EVALUATION: 3, LAST_EVALUATION: True}]


def test_a_restored_sweep_callback_takes_the_resumed_drivers_functions_and_its_place():
    """Tune.restore unpickles the callback saved with the sweep, not the one the resumed driver built:
    the restored one names trials with the driver's function (not "?"), keeps what it recorded (the
    trials the scheduler stopped, which settle() marks), and is the one the driver settles; what
    it counted goes on from Tune's last save of its state."""
    import pickle

    from vitp.tune.progress import SweepProgress

    def make(names):
        return SweepProgress("s-restore", 4, 2, "val/top1", "sqlite:///x.db", "e", run_name=names, scheduler="asha")

    saved = make(lambda config, trial_id="": "first-driver")
    saved.stopped["t1"], saved.ended = 40, 3
    blob = pickle.dumps(saved)
    fresh = make(lambda config, trial_id="": f"run-{trial_id}")
    restored = pickle.loads(blob)
    assert restored.run_name({}, "t2") == "run-t2" and restored.log is fresh.log
    assert (restored.stopped, restored.ended) == ({"t1": 40}, 3)
    assert SweepProgress.active("s-restore") is restored
    saved.ended, saved.durations = 5, [10.0, 12.0]  # Tune's periodic save of the callback's state
    restored.set_state(pickle.loads(pickle.dumps(saved.get_state())))
    assert (restored.ended, restored.durations, restored.stopped) == (5, [10.0, 12.0], {"t1": 40})


def test_ctrl_c_inside_tunes_fit_is_told_from_a_fit_that_ended():
    """Tune's own SIGINT handler (set at fit, as here) saves the search, returns normally and puts back
    the handler it found: CtrlC tells the two endings apart and restores what was there before."""
    import os
    import signal
    import time

    from vitp.tune.progress import CtrlC

    def tune_like():  # what ray.tune.tune._setup_signal_catching installs
        found = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, lambda signum, frame: signal.signal(signal.SIGINT, found))

    before = signal.getsignal(signal.SIGINT)
    with CtrlC() as ended:
        tune_like()
    assert not ended.pressed and signal.getsignal(signal.SIGINT) is before
    with CtrlC() as interrupted:
        tune_like()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs in this (main) thread
    assert interrupted.pressed and signal.getsignal(signal.SIGINT) is before


def test_a_trial_run_left_running_by_a_dead_trial_ends_failed_with_its_error(tmp_path):
    """A trial whose actor or node died never ended its own MLflow run: on_trial_error ends it
    FAILED with the error Tune recorded, and settle() (the sweep done) ends any other trial run of
    the sweep still RUNNING (its driver died before on_trial_error); the parent run, finished
    trials, a completed trial's run left RUNNING (MLflow was down as it ended: some metrics are not
    in), another sweep's runs and, while the sweep is not done, its trials are left as they are."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from vitp.tune.progress import SweepProgress

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")

    def run(sweep, trial_id=None, status=None):
        tags = {"sweep": sweep, **({"trial_id": trial_id} if trial_id else {})}
        run_id = client.create_run(exp, tags=tags).info.run_id
        if status:
            client.set_terminated(run_id, status)
        return run_id

    parent, died, finished, orphan = run("s"), run("s", "t1"), run("s", "t2", "FINISHED"), run("s", "t3")
    other, unsent = run("other", "t1"), run("s", "t4")
    lines = []
    progress = SweepProgress("s", 3, 2, "val/top1", uri, "e", run_name=lambda config, trial_id="": trial_id,
                             log=lines.append)
    progress.on_trial_error(0, [], SimpleNamespace(trial_id="t1", config={}, error_msg=(
        "Traceback (most recent call last):\n  ...\nRayActorError: The actor is unavailable: Socket closed")))
    progress.on_trial_complete(0, [], SimpleNamespace(trial_id="t4", config={}, last_result={"val/top1": 0.5}))
    progress.settle(done=False)  # interrupted: its trials may go on after --resume
    status = {r: client.get_run(r).info.status for r in (parent, died, finished, orphan, other)}
    assert status == {parent: "RUNNING", died: "FAILED", finished: "FINISHED", orphan: "RUNNING", other: "RUNNING"}
    assert client.get_run(died).data.tags["vitp.error"] == "RayActorError: The actor is unavailable: Socket closed"
    progress.settle()
    assert [client.get_run(r).info.status for r in (parent, orphan, other, unsent)] == [
        "RUNNING", "FAILED", "RUNNING", "RUNNING"]
    assert "ended without ending its run" in client.get_run(orphan).data.tags["vitp.error"]
    assert not [line for line in lines if "could not mark" in line], lines


def test_a_trial_an_earlier_driver_stopped_is_marked_killed_by_the_driver_resumed_after_it(tmp_path):
    """The scheduler stopped a trial and the sweep's driver marked its run KILLED, was killed, and was
    started again with --resume: the new driver has no memory of the stop, and the trial's own
    process ended the run FINISHED meanwhile (a run that planned 200 steps with 79 logged, as the
    chaos soak found). settle() marks it KILLED again from its tags; another sweep's is left."""
    from mlflow.tracking import MlflowClient

    from vitp.tune.progress import STOPPED_AT_TAG, STOPPED_BY_TAG, SweepProgress

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    stopped = {STOPPED_BY_TAG: "asha", STOPPED_AT_TAG: "79"}
    ours = client.create_run(exp, tags={"sweep": "s", "trial_id": "t1", **stopped}).info.run_id
    done = client.create_run(exp, tags={"sweep": "s", "trial_id": "t2"}).info.run_id
    theirs = client.create_run(exp, tags={"sweep": "other", "trial_id": "t1", **stopped}).info.run_id
    for run_id in (ours, done, theirs):
        client.set_terminated(run_id, "FINISHED")
    lines = []
    SweepProgress("s", 3, 2, "val/top1", uri, "e", run_name=lambda config, trial_id="": trial_id,
                  log=lines.append).settle()
    assert [client.get_run(r).info.status for r in (ours, done, theirs)] == ["KILLED", "FINISHED", "FINISHED"]
    assert client.get_run(ours).data.tags[STOPPED_AT_TAG] == "79"
    assert not [line for line in lines if "could not mark" in line], lines
