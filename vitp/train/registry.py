"""`vitp export --register NAME`: an export becomes an MLflow model (pyfunc: eval-view images in,
class logits out) linked to the run that trained it (vitp.tracking.registry does the MLflow part),
registered as a new version of NAME; the export records the version so fine-tunes from it name it
(vitp.train.transfer). ViTModel stays here: a logged model names its class by this module path.
"""
from __future__ import annotations

from typing import Any, Callable

import mlflow
import numpy as np
import torch

from ..console import get_logger, quiet_output
from ..errors import InputError
from ..model.weights import mark_registered, read_config, source_info
from ..tracking.registry import register_model

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


def register_export(export_dir: str, name: str, tracking_uri: str,
                    log: Callable[[str], None] = _log.info) -> dict[str, Any]:
    """Log `export_dir` as a model of the run that trained it and register it under `name` in the
    store at `tracking_uri`; returns {name, version, model_id, model_uri, run_id}. InputError if it is
    not an export."""
    info = source_info(export_dir)
    if info.kind != "export":
        raise InputError(f"{export_dir}: not an export (no model.safetensors); run `vitp export "
                         "CHECKPOINT --out DIR` first, then register DIR")
    out = register_model(export_dir, name, read_config(export_dir), ViTModel(), step=info.step,
                         mlflow_run_id=info.mlflow_run_id, tracking_uri=tracking_uri, log=log)
    mark_registered(export_dir, {k: out[k] for k in ("name", "version", "model_id")})
    log(f"[register] {export_dir} -> {out['model_uri']} (logged model {out['model_id']}"
        + (f", run {out['run_id']})" if out["run_id"] else ")"))
    return out
