"""RunLogger against a real SQLite store and a real `mlflow server`: params, resume, dedup, status, lineage."""
import json

import pytest
from mlflow.tracking import MlflowClient

from vitp.config import ExperimentConfig, flatten
from vitp.tracking import (
    PARENT_TAG,
    REDACTED,
    ParamConflictError,
    RunLogger,
    TrackingError,
    find_runs,
)
from vitp.tracking.values import MAX_PARAM_VALUE, TRUNCATION_NOTE


def steps(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_config_params_are_flattened_and_secrets_redacted(tracking_uri, experiment, tmp_path):
    cfg = ExperimentConfig()
    cfg.tracking.uri = "https://alice:hunter2@mlflow.example.com"
    cfg.tracking.tags = {"hf_token": "hf_abcdefghijklmnopqrstuvwxyz", "owner": "alice"}
    cfg.data.path = "s3://bucket/corpus?X-Amz-Security-Token=topsecret"
    with RunLogger.start(
        tracking_uri, experiment, "params",
        tags={"aws_secret_access_key": "wJalrXUtnFEMI", "note": "key=AKIAIOSFODNN7EXAMPLE",
              "checkpoint": "/ckpt/step_100"},
    ) as run:
        run.log_config(cfg.to_dict())
        run.log_params({"long": "x" * (MAX_PARAM_VALUE + 500)})
        run.set_tags({"db_password": "pw", "model": "B/16"})

    client = MlflowClient(tracking_uri)
    r = client.get_run(run.run_id)
    params, tags = r.data.params, r.data.tags
    # Nested config -> dotted keys, one per leaf (the run's name is its name, not a param).
    assert set(flatten(cfg.to_dict())) - {"tracking.run_name"} <= set(params) and "tracking.run_name" not in params
    assert params["optim.lr"] == "0.001" and params["model.variant"] == "B/16"
    assert params["parallel.zero_stage"] == "1" and params["data.mean"] == "[0.5, 0.5, 0.5]"
    # Secrets never reach MLflow, in params or tags.
    everything = json.dumps([params, tags])
    for secret in ("hunter2", "hf_abcdefghij", "topsecret", "wJalrXUtnFEMI", "AKIAIOSFODNN7EXAMPLE"):
        assert secret not in everything, secret
    assert params["tracking.uri"] == "https://alice:***@mlflow.example.com"
    assert json.loads(params["tracking.tags"]) == {"hf_token": REDACTED, "owner": "alice"}
    assert tags["aws_secret_access_key"] == REDACTED and tags["db_password"] == REDACTED
    assert tags["checkpoint"] == "/ckpt/step_100" and tags["model"] == "B/16"
    # Long values are cut to MLflow's limit with a note saying where the rest is.
    assert len(params["long"]) == MAX_PARAM_VALUE and params["long"].endswith(TRUNCATION_NOTE)
    # config.json is the same resolved config, also redacted.
    path = client.download_artifacts(run.run_id, "config.json", str(tmp_path))
    saved = json.load(open(path))
    assert saved["optim"]["lr"] == 0.001 and saved["tracking"]["tags"]["hf_token"] == REDACTED
    assert "hunter2" not in json.dumps(saved)


def test_resume_by_name_continues_the_run_and_never_logs_a_step_twice(tracking_uri, experiment):
    cfg = ExperimentConfig().to_dict()
    first = RunLogger.start(tracking_uri, experiment, "pretrain-B16")
    assert not first.resumed and first.last_step == -1
    first.log_config(cfg)
    for s in range(5):
        first.log_metrics({"train/loss": 10.0 - s, "train/lr": 0.1}, step=s)
    first.end("FAILED")  # a crashed attempt

    second = RunLogger.start(tracking_uri, experiment, "pretrain-B16")
    assert second.resumed and second.run_id == first.run_id and second.last_step == 4
    client = MlflowClient(tracking_uri)
    assert client.get_run(second.run_id).info.status == "RUNNING"
    second.log_config(cfg)  # identical params: accepted, nothing re-logged
    # A Train worker attaching by id to the RUNNING run sees the same steps; it is not an attempt.
    worker = RunLogger.start(tracking_uri, experiment, "pretrain-B16", run_id=first.run_id)
    assert worker.resumed and worker.last_step == 4
    assert worker.log_metrics({"train/loss": 0.0}, step=4) == 0
    # The resumed attempt replays from step 0 (its last checkpoint) to 9.
    written = [second.log_metrics({"train/loss": 100.0 + s, "train/lr": 0.2}, step=s) for s in range(10)]
    assert written == [0] * 5 + [2] * 5
    second.log_metrics({"train/loss": 1.0}, step=7)  # out of order: dropped, not duplicated
    second.end()

    for key in ("train/loss", "train/lr"):
        assert steps(client, first.run_id, key) == list(range(10)), key
    history = {m.step: m.value for m in client.get_metric_history(first.run_id, "train/loss")}
    assert history[3] == 7.0 and history[6] == 106.0  # the first attempt's values are kept
    assert client.get_run(first.run_id).data.tags["vitp.attempt"] == "2"

    # A FINISHED run is never resumed by name: the same name now starts a fresh run.
    third = RunLogger.start(tracking_uri, experiment, "pretrain-B16")
    assert not third.resumed and third.run_id != first.run_id
    third.end()
    # resume_by_name=False always starts fresh.
    fourth = RunLogger.start(tracking_uri, experiment, "pretrain-B16", resume_by_name=False)
    assert not fourth.resumed and fourth.run_id not in (first.run_id, third.run_id)
    fourth.end("KILLED")


def test_resume_by_run_id_retries_a_trial_even_after_it_ended(tracking_uri, experiment):
    trial = RunLogger.start(tracking_uri, experiment, "trial_0000")
    trial.log_params({"optim.lr": 0.003})
    trial.log_metrics({"val/top1": 0.5}, step=0)
    trial.end("FAILED")
    retry = RunLogger.start(tracking_uri, experiment, "trial_0000", run_id=trial.run_id)
    assert retry.resumed and retry.run_id == trial.run_id and retry.last_step == 0
    retry.log_params({"optim.lr": 0.003})  # a retry re-logs its params: fine when identical
    retry.log_metrics({"val/top1": 0.5}, step=0)
    retry.log_metrics({"val/top1": 0.7}, step=1)
    retry.end()
    client = MlflowClient(tracking_uri)
    assert steps(client, trial.run_id, "val/top1") == [0, 1]
    assert client.get_run(trial.run_id).info.status == "FINISHED"

    with pytest.raises(TrackingError, match="run_id='0123456789abcdef0123456789abcdef' not found"):
        RunLogger.start(tracking_uri, experiment, "x", run_id="0123456789abcdef0123456789abcdef")


def test_changed_param_on_resume_raises_our_error_not_mlflows(tracking_uri, experiment):
    cfg = ExperimentConfig()
    run = RunLogger.start(tracking_uri, experiment, "conflict")
    run.log_config(cfg.to_dict())
    run.end("FAILED")

    again = RunLogger.start(tracking_uri, experiment, "conflict")
    assert again.run_id == run.run_id
    cfg.optim.lr = 0.003
    with pytest.raises(ParamConflictError) as err:
        again.log_config(cfg.to_dict())
    msg = str(err.value)
    assert "optim.lr" in msg and "'0.001'" in msg and "'0.003'" in msg
    assert "tracking.run_name" in msg and run.run_id in msg
    assert "Changing param values is not allowed" not in msg
    # Nothing of the new value reached MLflow.
    assert MlflowClient(tracking_uri).get_run(run.run_id).data.params["optim.lr"] == "0.001"
    again.end("FAILED")


def test_context_manager_sets_status_from_how_the_block_ended(tracking_uri, experiment):
    client = MlflowClient(tracking_uri)
    with RunLogger.start(tracking_uri, experiment, "ok") as ok:
        ok.log_metrics({"train/loss": 1.0}, step=0)
    assert client.get_run(ok.run_id).info.status == "FINISHED"

    with pytest.raises(RuntimeError, match="boom"):
        with RunLogger.start(tracking_uri, experiment, "crash") as crash:
            raise RuntimeError("boom")
    assert client.get_run(crash.run_id).info.status == "FAILED"

    with pytest.raises(KeyboardInterrupt):
        with RunLogger.start(tracking_uri, experiment, "interrupted") as interrupted:
            raise KeyboardInterrupt
    assert client.get_run(interrupted.run_id).info.status == "KILLED"

    with pytest.raises(SystemExit):
        with RunLogger.start(tracking_uri, experiment, "exit0") as exit0:
            raise SystemExit(0)
    assert client.get_run(exit0.run_id).info.status == "FINISHED"

    # A crashed run is resumable by name; the resumed attempt can then finish it.
    with RunLogger.start(tracking_uri, experiment, "crash") as again:
        assert again.resumed and again.run_id == crash.run_id
    assert client.get_run(crash.run_id).info.status == "FINISHED"

    with pytest.raises(TrackingError, match="use one of FINISHED, FAILED, KILLED"):
        RunLogger.start(tracking_uri, experiment, "bad-status").end("DONE")


def test_non_finite_metrics_are_skipped_with_a_warning(tracking_uri, experiment, caplog):
    with RunLogger.start(tracking_uri, experiment, "nan") as run:
        assert run.log_metrics({"train/loss": float("nan"), "train/lr": 0.1}, step=0) == 1
        run.log_metrics({"train/loss": 2.0}, step=1)
    assert "train/loss=nan at step 0 is not finite" in caplog.text
    assert steps(MlflowClient(tracking_uri), run.run_id, "train/loss") == [1]


def test_sweep_parent_and_children_are_linked_and_found(tracking_uri, experiment):
    parent = RunLogger.start(tracking_uri, experiment, "sweep-digits", tags={"vitp.pretrain_run_id": "abc"})
    parent.log_params({"tune": {"space": {"optim.lr": [0.001, 0.003, 0.01]}, "scheduler": "asha"}})
    children = []
    for i, lr in enumerate([0.001, 0.003, 0.01]):
        with RunLogger.start(tracking_uri, experiment, f"trial_{i:04d}", parent_run_id=parent.run_id,
                             tags={"vitp.pretrain_run_id": "abc"}) as child:
            child.log_params({"optim": {"lr": lr}, "data": {"source": "digits"}})
            for epoch in range(3):
                child.log_metrics({"val/top1": lr * 10 * (epoch + 1), "val/loss": 1.0 / (epoch + 1)}, epoch)
        children.append(child)
    parent.set_tags({"vitp.best_trial": children[-1].run_id})
    parent.end()

    # The same trial name under another sweep is a different run (resume by name is per parent).
    other = RunLogger.start(tracking_uri, experiment, "sweep-2")
    stray = RunLogger.start(tracking_uri, experiment, "trial_0000", parent_run_id=other.run_id)
    assert not stray.resumed and stray.run_id != children[0].run_id
    stray.end("KILLED")
    other.end("KILLED")

    rows = find_runs(tracking_uri, experiment, parent_run_id=parent.run_id, history=["val/top1"])
    assert sorted(r["run_id"] for r in rows) == sorted(c.run_id for c in children)
    by_name = {r["run_name"]: r for r in rows}
    t2 = by_name["trial_0002"]
    assert t2["parent_run_id"] == parent.run_id and t2["tags"][PARENT_TAG] == parent.run_id
    assert t2["params"] == {"optim.lr": "0.01", "data.source": "digits"}
    assert t2["metrics"]["val/top1"] == pytest.approx(0.3) and t2["status"] == "FINISHED"
    assert [s for s, _ in t2["history"]["val/top1"]] == [0, 1, 2]
    assert t2["tags"]["vitp.pretrain_run_id"] == "abc"

    one = find_runs(tracking_uri, experiment, "params.`optim.lr` = '0.003'")
    assert [r["run_name"] for r in one] == ["trial_0001"]
    everything = find_runs(tracking_uri, experiment)
    assert len(everything) == 6
    top = {r["run_name"]: r for r in everything}["sweep-digits"]
    assert top["parent_run_id"] is None and top["tags"]["vitp.best_trial"] == children[-1].run_id
    assert json.loads(top["params"]["tune.space"]) == {"optim.lr": [0.001, 0.003, 0.01]}

    with pytest.raises(TrackingError, match="no-such-experiment.*not found"):
        find_runs(tracking_uri, "no-such-experiment")
