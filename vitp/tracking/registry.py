"""The MLflow side of `vitp export --register NAME`: a served model (its pyfunc class given by the
caller: vitp.train.registry) logged as a model of the run that trained it, with that run's config
as params and its latest metrics, registered as a new version of NAME. No torch: what the model is
arrives as a config and the pyfunc object.
"""
from __future__ import annotations

from importlib import metadata
from typing import Any, Callable

import mlflow
import numpy as np
from mlflow.entities import Metric

from .. import storage
from ..config import ExperimentConfig
from ..console import get_logger, quiet_output
from ..names import check_name
from .store import get_client, get_or_create_experiment
from .values import params_for_mlflow

_log = get_logger(__name__)


def _signature(image_size: int, classes: int):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, image_size, image_size))]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, classes))]))


def register_model(export_dir: str, name: str, cfg: ExperimentConfig, python_model: Any, *, step: int,
                   mlflow_run_id: str | None, tracking_uri: str,
                   log: Callable[[str], None] = _log.info) -> dict[str, Any]:
    """Log `export_dir` (its files the model's artifact "export") through `python_model` as a
    model of run `mlflow_run_id` (when that run is in the store at `tracking_uri`) and register it
    under `name`; returns {name, version, model_id, model_uri, run_id}."""
    check_name("--register", name)
    uri = tracking_uri
    client = get_client(uri)
    run = None
    if mlflow_run_id:
        try:
            run = client.get_run(mlflow_run_id)
        except Exception:  # trained against another store: the model is registered without its run
            log(f"[register] run {mlflow_run_id} is not in {uri}: registering without its metrics")
    experiment_id = run.info.experiment_id if run else get_or_create_experiment(client, cfg.tracking.experiment)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run.info.run_id if run else None,
                                       params=params_for_mlflow(cfg.to_dict()),
                                       tags={"recipe": cfg.recipe, "variant": cfg.model.variant, "step": str(step)})
    torch_version = metadata.version("torch").split("+")[0]  # what serving installs (no import here)
    with storage.local_copy(export_dir) as local, quiet_output():
        mlflow.pyfunc.log_model(name=name, python_model=python_model, artifacts={"export": local},
                                model_id=model.model_id,
                                signature=_signature(cfg.data.image_size, cfg.model.num_classes),
                                pip_requirements=[f"torch=={torch_version}", "safetensors", "vit-pipeline"])
    metrics = {}
    if run:
        for key in run.data.metrics:  # the latest value of each, linked to the model as logged
            last = client.get_metric_history(run.info.run_id, key)[-1]
            metrics[key] = last.value
            client.log_batch(run.info.run_id, metrics=[Metric(key, last.value, last.timestamp, last.step,
                                                              model_id=model.model_id)])
    with quiet_output():  # "Successfully registered ..."; the caller says it
        version = mlflow.register_model(f"models:/{model.model_id}", name, tags={
            "source_run_id": run.info.run_id if run else "", "step": str(step),
            **{k: f"{v:.4g}" for k, v in metrics.items() if k.startswith("val/")}})
    return {"name": name, "version": str(version.version), "model_id": model.model_id,
            "model_uri": f"models:/{name}/{version.version}", "run_id": run.info.run_id if run else None}
