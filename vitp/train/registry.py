"""`vitp export --register NAME`: an export becomes an MLflow model (pyfunc: eval-view images in,
class logits out) linked to the run that trained it, with that run's config as params and its
latest metrics, registered as a new version of NAME; the export records the version so fine-tunes
from it name it (vitp.train.transfer).
"""
from __future__ import annotations

from typing import Any, Callable

import mlflow
import numpy as np
import torch
from mlflow.entities import Metric

from .. import storage
from ..console import get_logger, quiet_output
from ..errors import InputError
from ..names import check_name
from ..model.weights import mark_registered, read_config, source_info
from ..tracking.store import get_client, get_or_create_experiment, resolve_tracking_uri
from ..tracking.values import params_for_mlflow

_log = get_logger(__name__)


# MLflow warns, at class definition, that `predict` has no type hints (in a filter of its own
# that ours cannot override); the signature logged with the model describes its input instead.
with quiet_output():
    class ViTModel(mlflow.pyfunc.PythonModel):
        """The served form of an export: float32 images (N, 3, S, S), normalised as the eval view
        (vitp.data.decode), in; class logits (N, classes) out (the logged signature)."""

        def load_context(self, context) -> None:
            from .export import load_model

            self.model = load_model(context.artifacts["export"])

        def predict(self, context, model_input, params=None):
            with torch.no_grad():
                return self.model(torch.as_tensor(np.asarray(model_input, dtype=np.float32))).numpy()


def _signature(image_size: int, classes: int):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, image_size, image_size))]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, classes))]))


def register_export(export_dir: str, name: str, tracking_uri: str | None = None,
                    log: Callable[[str], None] = _log.info) -> dict[str, Any]:
    """Log `export_dir` as a model of the run that trained it and register it under `name`;
    returns {name, version, model_id, model_uri, run_id}. InputError if it is not an export."""
    check_name("--register", name)
    info = source_info(export_dir)
    if info.kind != "export":
        raise InputError(f"{export_dir}: not an export (no model.safetensors); run `vitp export "
                         "CHECKPOINT --out DIR` first, then register DIR")
    cfg = read_config(export_dir)
    uri = tracking_uri or resolve_tracking_uri(cfg)
    client = get_client(uri)
    run = None
    if info.mlflow_run_id:
        try:
            run = client.get_run(info.mlflow_run_id)
        except Exception:  # trained against another store: the model is registered without its run
            log(f"[register] run {info.mlflow_run_id} is not in {uri}: registering without its metrics")
    experiment_id = run.info.experiment_id if run else get_or_create_experiment(client, cfg.tracking.experiment)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run.info.run_id if run else None,
                                       params=params_for_mlflow(cfg.to_dict()),
                                       tags={"recipe": cfg.recipe, "variant": cfg.model.variant,
                                             "step": str(info.step)})
    with storage.local_copy(export_dir) as local, quiet_output():
        mlflow.pyfunc.log_model(name=name, python_model=ViTModel(), artifacts={"export": local},
                                model_id=model.model_id,
                                signature=_signature(cfg.data.image_size, cfg.model.num_classes),
                                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "safetensors",
                                                  "vit-pipeline"])
    metrics = {}
    if run:
        for key in run.data.metrics:  # the latest value of each, linked to the model as logged
            last = client.get_metric_history(run.info.run_id, key)[-1]
            metrics[key] = last.value
            client.log_batch(run.info.run_id, metrics=[Metric(key, last.value, last.timestamp, last.step,
                                                              model_id=model.model_id)])
    with quiet_output():  # "Successfully registered ..."; we say it below
        version = mlflow.register_model(f"models:/{model.model_id}", name, tags={
            "source_run_id": run.info.run_id if run else "", "step": str(info.step),
            **{k: f"{v:.4g}" for k, v in metrics.items() if k.startswith("val/")}})
    registered = {"name": name, "version": str(version.version), "model_id": model.model_id}
    mark_registered(export_dir, registered)
    log(f"[register] {export_dir} -> models:/{name}/{version.version} (logged model {model.model_id}"
        + (f", run {run.info.run_id})" if run else ")"))
    return {**registered, "model_uri": f"models:/{name}/{version.version}",
            "run_id": run.info.run_id if run else None}
