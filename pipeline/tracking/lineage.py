"""What a run was made from, as MLflow records it: the shards it trained on (a dataset input, the
UI's Dataset column) and the registered model it started from (a model input). Registering a
model is pipeline.train.registry's job; this module only links runs to what exists.
"""
from __future__ import annotations

import hashlib
import json
import warnings

from mlflow import MlflowClient

from .. import storage
from .redact import redact_text


def log_dataset(client: MlflowClient, run_id: str, name: str, source: str, digest: str,
                context: str = "train") -> None:
    """Record a dataset as an input of `run_id`: `source` a path or URI (shown as MLflow resolves
    it, a password in it masked), `digest` what identifies its content (same shards, same digest)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source  # lazy: mlflow.data
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # MLflow registers its local source twice and says so
        warnings.simplefilter("ignore", UserWarning)
        resolved = resolve_dataset_source(redact_text(source))
    dataset = MetaDataset(resolved, name=name, digest=digest)
    client.log_inputs(run_id, datasets=[DatasetInput(
        dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])


def log_shards(client: MlflowClient, run_id: str, name: str, root: str, context: str = "train") -> None:
    """The Parquet shards at `root` as a dataset input of `run_id`, their digest taken from the
    manifest's shard list (same shards, same digest); nothing when there is no manifest."""
    path = storage.join(root, "manifest.json")
    if storage.exists(path):
        shards = storage.read_json(path).get("shards")
        digest = hashlib.sha1(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:12]
        log_dataset(client, run_id, name, root, digest, context)


def log_model_input(client: MlflowClient, run_id: str, model_id: str) -> None:
    """Record the logged model `model_id` as an input of `run_id` (a fine-tune's starting point)."""
    from mlflow.entities import LoggedModelInput

    client.log_inputs(run_id, models=[LoggedModelInput(model_id)])
