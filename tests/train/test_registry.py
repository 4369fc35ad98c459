"""`vitp export --register`: an export becomes an MLflow model of the run that trained it (config
as params, that run's metrics), a registered version that serves the same logits as the model,
and fine-tunes from the export name that version. Real SQLite store, no Ray."""
import dataclasses

import mlflow
import numpy as np
import pytest
import torch

from vitp.config import ExperimentConfig
from vitp.errors import InputError
from vitp.model.vit import ViT
from vitp.model.weights import write_export
from vitp.recipes import with_overrides
from vitp.tracking import RunLogger
from vitp.train.registry import register_export
from vitp.train.transfer import finetune_config


def test_registered_export_serves_the_model_and_names_its_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with RunLogger.start(uri, "reg", "pre") as run:
        run.log_metrics({"val/top1": 0.25, "train/loss": 2.0}, step=10)
        run.log_metrics({"val/top1": 0.5, "train/loss": 1.5}, step=20)
    cfg = ExperimentConfig(recipe="debug")
    cfg = cfg.replace(model=dataclasses.replace(cfg.model, variant="mu/4", num_classes=3),
                      data=dataclasses.replace(cfg.data, image_size=16), tracking=dataclasses.replace(
                          cfg.tracking, uri=uri, experiment="reg"))
    torch.manual_seed(0)
    model = ViT("mu/4", image_size=16, num_classes=3, head="pretrain").eval()
    export = write_export(str(tmp_path / "export"), model.state_dict(), cfg.to_dict(),
                          {"step": 20, "mlflow_run_id": run.run_id})

    lines = []
    reg = register_export(export, "vit-test", uri, log=lines.append)
    assert reg["model_uri"] == "models:/vit-test/1" and reg["run_id"] == run.run_id
    assert "models:/vit-test/1" in lines[-1]

    client = mlflow.MlflowClient(uri)
    version = client.get_model_version("vit-test", "1")
    assert version.tags["val/top1"] == "0.5" and version.tags["source_run_id"] == run.run_id
    assert version.source == f"models:/{reg['model_id']}" and version.run_id == run.run_id
    logged = client.get_logged_model(reg["model_id"])
    assert logged.source_run_id == run.run_id and logged.params["model.variant"] == "mu/4"
    assert {m.key: m.value for m in logged.metrics} == {"val/top1": 0.5, "train/loss": 1.5}
    history = client.get_metric_history(run.run_id, "val/top1")
    assert [(m.step, m.value) for m in history] == [(10, 0.25), (20, 0.5)]  # the run is unchanged

    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    served = mlflow.pyfunc.load_model("models:/vit-test/1").predict(x)
    with torch.no_grad():
        np.testing.assert_allclose(served, model(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)

    _, tags = finetune_config(with_overrides("debug_finetune"), export)
    assert tags["source_model"] == "models:/vit-test/1" and tags["source_model_id"] == reg["model_id"]
    assert register_export(export, "vit-test", uri)["model_uri"] == "models:/vit-test/2"  # a new version

    with pytest.raises(InputError, match="not an export"):
        register_export(str(tmp_path), "vit-test", uri)
