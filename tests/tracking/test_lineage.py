"""What MLflow's UI reads to show a run's lineage, checked in the store: experiments marked as
model training, the shards as a dataset input, a registered model as a fine-tune's model input."""
from mlflow.tracking import MlflowClient

from vitp.tracking import RunLogger
from vitp.tracking.lineage import log_dataset, log_model_input
from vitp.tracking.store import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, get_or_create_experiment


def test_experiments_are_marked_model_training_even_when_made_elsewhere(tracking_uri, experiment):
    client = MlflowClient(tracking_uri)
    exp_id = get_or_create_experiment(client, experiment)
    assert client.get_experiment(exp_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    bare = client.create_experiment(experiment + "-bare")  # e.g. by an older version
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(bare).tags
    assert get_or_create_experiment(client, experiment + "-bare") == bare
    assert client.get_experiment(bare).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    chosen = client.create_experiment(experiment + "-genai", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    get_or_create_experiment(client, experiment + "-genai")  # a kind someone chose is kept
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_dataset_and_model_inputs_are_recorded_on_the_run(tracking_uri, experiment, tmp_path):
    with RunLogger.start(tracking_uri, experiment, "pre") as pre:
        pass
    client = MlflowClient(tracking_uri)
    model = client.create_logged_model(pre.experiment_id, name="vit-x", source_run_id=pre.run_id)
    with RunLogger.start(tracking_uri, experiment, "ft") as ft:
        log_dataset(ft.client, ft.run_id, "digits-train0.2", str(tmp_path / "shards"), "abc123def456")
        log_model_input(ft.client, ft.run_id, model.model_id)
    inputs = client.get_run(ft.run_id).inputs
    (d,) = inputs.dataset_inputs
    assert (d.dataset.name, d.dataset.digest) == ("digits-train0.2", "abc123def456")
    assert str(tmp_path / "shards") in d.dataset.source
    assert {t.key: t.value for t in d.tags}["mlflow.data.context"] == "train"
    assert [m.model_id for m in inputs.model_inputs] == [model.model_id]


def test_a_dataset_source_keeps_no_password(tracking_uri, experiment):
    with RunLogger.start(tracking_uri, experiment, "creds") as run:
        log_dataset(run.client, run.run_id, "shards", "https://bob:s3cr%2Ft/k@data.example.com/shards", "0123")
    (d,) = MlflowClient(tracking_uri).get_run(run.run_id).inputs.dataset_inputs
    assert "s3cr" not in d.dataset.source and "bob:***@data.example.com/shards" in d.dataset.source


def test_a_run_page_pasted_from_the_mlflow_ui_is_a_recipe_for_a_run_like_it(mlflow_server, tmp_path):
    """`vitp CMD http://HOST:PORT/#/experiments/E/runs/RUN_ID`: the run is read from the server the
    page names (no --tracking-uri, no MLFLOW_TRACKING_URI), its logged config under a name of its own."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from vitp.config import ExperimentConfig
    from vitp.recipes import resolve

    cfg = resolve("debug", ["optim.lr=0.03", f"work_dir={tmp_path}"], check_paths=False)
    logger = RunLogger.start(mlflow_server.uri, "like-a-page", cfg.run_name)
    logger.log_config(cfg.to_dict())
    logger.end()
    experiment_id = MlflowClient(mlflow_server.uri).get_run(logger.run_id).info.experiment_id
    page = f"{mlflow_server.uri}/#/experiments/{experiment_id}/runs/{logger.run_id}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    vitp = [shutil.which("vitp")] if shutil.which("vitp") else [sys.executable, "-m", "vitp.cli"]
    p = subprocess.run([*vitp, "config", page], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr
    got = ExperimentConfig.from_dict(json.loads(p.stdout))
    assert got.tracking.run_name == f"{cfg.run_name}-like-{logger.run_id[:8]}"
    assert got.optim.lr == 0.03 and got.to_dict()["train"] == cfg.to_dict()["train"]
